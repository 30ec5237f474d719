"""Bad options: whatever number a user types, `xronos` accepts it or says why in one line and exits 2.

A property-based test (hypothesis) throws generated values at every numeric option of
`run`, `bench`, `train`, `node`, `controller` and `status`, in process. Each command is
set up to stop just before it would start work (an `--output` that is a file, a broker
URL that is not one), so an accepted value ends in that known error and a refused one
in its own; neither may end in a traceback. Values outside an option's domain (nan,
inf, zero or negative where a count or a duration is meant) must be refused by the
option itself, not by something further on.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_node.checkpoint import seal
from tests.conftest import SEQ_LEN
from xronos.cli import main

OUTPUT_IS_A_FILE = "is a file, not a directory"
BAD_BROKER = "bad broker URL"


def run(argv: list[str]) -> tuple[int, list[str]]:
    """`xronos ARGV` in this process: its exit code and stderr lines (argparse's exit included)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue().strip().splitlines()


def assert_one_line_error(code, err, argv) -> str:
    assert code == 2, (argv, code, err)
    assert len(err) == 1 and err[0].startswith("xronos: error: "), (argv, err)
    assert "Traceback" not in err[0]
    return err[0]


@pytest.fixture(scope="module")
def setup(model_dir, data_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-options")
    output = root / "output-file"
    output.write_text("not a directory")
    return dict(model=str(model_dir("mha_untied")), data=str(data_file), output=str(output), root=root)


def job_args(setup) -> list[str]:
    return ["--model", setup["model"], "--data", setup["data"], "--output", setup["output"], "--seq-len", str(SEQ_LEN)]


# -- the generated values -------------------------------------------------------------------------
numbers = st.one_of(
    st.integers(-(10**25), 10**25),
    st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, 0.0005, 0.001, 1024.0, 1024.5, 2**40, 2**40 + 1]),
)
texts = st.one_of(
    numbers.map(str),
    st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity", "1e400", "0x10", "1_000", " 3", "", "1,2", "½"]),
    st.text(max_size=8),
)
speed_lists = st.lists(numbers.map(str) | st.sampled_from(["nan", "inf", "-1", "0"]), min_size=1, max_size=4).map(
    ",".join
)


def _value(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def outside(text: str, low: float, high: float, whole: bool) -> bool:
    """True when TEXT is certainly not a value of the option's domain [low, high] (whole numbers if `whole`)."""
    if whole:
        try:
            value = int(text)
        except ValueError:
            return True
        return not low <= value <= high
    value = _value(text)
    return value is None or not math.isfinite(value) or not low <= value <= high


# option: (domain low, high, whole number)
RUN_OPTIONS = {
    "--steps": (1, 10**7, True),
    "--batch-size": (1, 65536, True),
    "--grad-accum": (1, 65536, True),
    "--seq-len": (2, 131072, True),
    "--lr": (5e-324, 10, False),
    "--seed": (-(2**40), 2**40, True),
    "--checkpoint-every": (0, 10**7, True),
    "--micro-batches": (1, 65536, True),
    "--replan-after": (0, 10**7, True),
    "--nodes": (1, 256, True),
    "--threads": (1, 1024, True),
    "--metrics-port": (0, 65535, True),
    "--lora": (1, 4096, True),
    "--lora-alpha": (1, 2**20, True),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(sorted(RUN_OPTIONS)), text=texts, command=st.sampled_from(["run", "bench"]))
def test_every_numeric_option_of_run_and_bench_is_accepted_or_refused_in_one_line(setup, option, text, command):
    if command == "bench" and option in ("--threads", "--metrics-port"):
        command = "run"
    argv = [command, *job_args(setup), "--batch-size", "2", "--quiet", f"{option}={text}"]
    if option != "--nodes":
        argv += ["--nodes", "2"]
    message = assert_one_line_error(*run(argv), argv)
    low, high, whole = RUN_OPTIONS[option]
    if outside(text, low, high, whole):
        assert OUTPUT_IS_A_FILE not in message, f"{option}={text!r} was accepted: {message}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(speeds=speed_lists, command=st.sampled_from(["run", "bench"]))
def test_speeds_are_finite_and_emulable_or_refused_in_one_line(setup, speeds, command):
    count = len(speeds.split(","))
    argv = [command, *job_args(setup), "--batch-size", "2", "--quiet", "--nodes", str(count), f"--speeds={speeds}"]
    message = assert_one_line_error(*run(argv), argv)
    if any(outside(s, 0.001, 1024, False) for s in speeds.split(",")):
        assert OUTPUT_IS_A_FILE not in message, f"--speeds {speeds!r} was accepted"


SERVICE_OPTIONS = {
    # command: {option: (low, high, whole)}
    "node": {
        "--speed": (0.001, 1024, False),
        "--threads": (1, 1024, True),
        "--heartbeat-seconds": (0.1, 3600, False),
        "--metrics-port": (0, 65535, True),
    },
    "controller": {
        "--heartbeat-timeout": (0.1, 86400, False),
        "--keep-jobs": (1, 100_000, True),
        "--metrics-port": (0, 65535, True),
    },
    "status": {"--listen": (5e-324, 3600, False)},
    "train": {"--timeout": (5e-324, 864000, False), **{k: RUN_OPTIONS[k] for k in list(RUN_OPTIONS)[:9]}},
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=texts)
def test_every_numeric_option_of_the_services_is_accepted_or_refused_in_one_line(setup, data, text):
    """Accepted values reach the broker URL, which is not one: the next thing after the options."""
    command = data.draw(st.sampled_from(sorted(SERVICE_OPTIONS)))
    option = data.draw(st.sampled_from(sorted(SERVICE_OPTIONS[command])))
    argv = [command, "--broker", "ftp://nowhere", f"{option}={text}"]
    if command == "node":
        argv += ["--node-id", "n0", "--workdir", str(setup["root"] / "node")]
    if command == "train":
        argv += job_args(setup)
    message = assert_one_line_error(*run(argv), argv)
    if outside(text, *SERVICE_OPTIONS[command][option]):
        assert BAD_BROKER not in message, f"{command} {option}={text!r} was accepted"


# -- the cases the issue names, one by one ---------------------------------------------------------
def test_the_named_cases_each_get_their_own_reason(setup, tmp_path, data_file):
    base = ["run", *job_args(setup), "--batch-size", "2", "--quiet"]
    cases = {
        "--speeds nan": (base + ["--nodes", "3", "--speeds", "nan,1,1"], "--speeds"),
        "--speeds inf": (base + ["--nodes", "3", "--speeds", "1,inf,1"], "--speeds"),
        "--nodes 0": (base + ["--nodes", "0"], "--nodes: expected a whole number from 1"),
        "negative steps": (base + ["--steps", "-1"], "--steps"),
        "zero lr": (base + ["--lr", "0"], "--lr"),
        "split for fewer ranks": (
            base + ["--nodes", "3", "--mode", "tp", "--split", "kv=4/4,mlp=96/96,vocab=160/160"],
            "--split kv lists 2 sizes for --nodes 3",
        ),
        "split in single mode": (base + ["--mode", "single", "--split", "kv=8"], "--split is for modes"),
        "metrics ports past 65535": (base + ["--nodes", "3", "--metrics-port", "65534"], "leaves no port"),
        "--memory for fewer devices": (base + ["--nodes", "3", "--memory", "4,4"], "--memory lists 2 caps"),
        "--memory 0": (base + ["--nodes", "1", "--memory", "0"], "--memory: memory caps must be GiB over 0"),
        "--merge without --lora": (base + ["--merge"], "--merge needs --lora"),
        "--lora-alpha without --lora": (base + ["--lora-alpha", "8"], "--lora-alpha needs --lora R"),
        "--lora-base-dtype without --lora": (
            base + ["--lora-base-dtype", "bfloat16"],
            "--lora-base-dtype needs --lora R",
        ),
        "--lora in mode pp": (base + ["--lora", "4", "--mode", "pp"], "--lora is not supported in mode pp"),
        "--lora in bench mode pp": (
            ["bench", *base[1:], "--lora", "4", "--modes", "xronos,pp"],
            "--lora is not supported in mode pp",
        ),
        "unknown LoRA target": (base + ["--lora", "4", "--lora-targets", "q_proj,lm_head"], "unknown projection"),
        "LoRA target twice": (base + ["--lora", "4", "--lora-targets", "q_proj,q_proj"], "named twice"),
        "--lora-dropout 1": (base + ["--lora", "4", "--lora-dropout", "1"], "--lora-dropout: expected a fraction"),
    }
    for name, (argv, expected) in cases.items():
        message = assert_one_line_error(*run(argv), argv)
        assert expected in message, (name, message)
    code, err = run(["node", "--node-id", "n0", "--speed", "inf"])
    assert "--speed: expected a number from 0.001 up to 1024, got 'inf'" in assert_one_line_error(code, err, "node")


def test_fewer_rows_than_the_batch_is_an_error_not_repeated_rows(setup, tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(SEQ_LEN))}) + "\n" for _ in range(3)))
    argv = ["run", "--model", setup["model"], "--data", str(data), "--output", str(tmp_path / "o")]
    argv += ["--seq-len", str(SEQ_LEN), "--batch-size", "4", "--quiet"]
    message = assert_one_line_error(*run(argv), argv)
    assert "3 rows of --seq-len 16, fewer than --batch-size 4" in message


def test_resume_with_another_model_than_the_checkpoints_is_refused(setup, model_dir, tmp_path):
    """The checkpoint's weights would silently replace --model's: say so instead."""
    output = tmp_path / "out"
    checkpoint = output / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    shutil.copy(model_dir("gqa_tied") / "config.json", checkpoint / "config.json")
    # the same --model path as recorded (the lead's check), but the files there are another model's
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, "model": setup["model"]}))
    seal(checkpoint, {})
    argv = ["run", "--model", setup["model"], "--data", setup["data"], "--output", str(output)]
    argv += ["--seq-len", str(SEQ_LEN), "--batch-size", "2", "--quiet", "--resume"]
    message = assert_one_line_error(*run(argv), argv)
    assert f"--resume: the checkpoint {checkpoint} is of another model than --model" in message
    assert "hidden_size 48 (--model: 64)" in message
