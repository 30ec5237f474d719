"""Bad input: one line naming the problem, a non-zero exit, no traceback; dead workers stop the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_cluster import worker_below
from transformers import GPT2Config

from edge_node.worker_process import last_error
from tests.conftest import SEQ_LEN
from xronos.cli import main
from xronos.contract.splits import ShardSplit


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def base_args(model, data, out):
    return [
        "run",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        str(SEQ_LEN),
        "--quiet",
    ]


def test_split_that_does_not_sum(model_dir, data_file, tmp_path, capsys):
    code, err = run_cli(
        base_args(model_dir("mha_untied"), data_file, tmp_path) + ["--nodes", "3", "--split", "kv=5/2/2"], capsys
    )
    assert code == 2 and err == ["xronos: error: split kv_groups 5+2+2=9 does not sum to the model's 8"]


def test_split_with_wrong_rank_count(model_dir, data_file, tmp_path, capsys):
    code, err = run_cli(
        base_args(model_dir("mha_untied"), data_file, tmp_path) + ["--nodes", "3", "--split", "kv=4/4"], capsys
    )
    assert code == 2 and len(err) == 1 and "one entry per rank" in err[0]


def test_missing_model_directory(data_file, tmp_path, capsys):
    code, err = run_cli(base_args(tmp_path / "nope", data_file, tmp_path / "o"), capsys)
    assert code == 2 and err == [
        f"xronos: error: model directory '{tmp_path / 'nope'}' has no config.json (expected a Hugging Face model)"
    ]


def test_unsupported_architecture(data_file, tmp_path, capsys):
    GPT2Config().save_pretrained(tmp_path / "gpt2")
    code, err = run_cli(base_args(tmp_path / "gpt2", data_file, tmp_path / "o"), capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("xronos: error: unsupported architecture 'gpt2'")


def test_rows_shorter_than_seq_len(model_dir, data_file, tmp_path, capsys):
    args = base_args(model_dir("mha_untied"), data_file, tmp_path)
    args[args.index("--seq-len") + 1] = "999"
    code, err = run_cli(args, capsys)
    assert code == 2 and len(err) == 1 and "shorter than --seq-len 999" in err[0]


def test_unknown_mode_is_refused_by_the_parser(model_dir, data_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(base_args(model_dir("mha_untied"), data_file, tmp_path) + ["--mode", "fast"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_dying_worker_stops_the_job_and_is_named(model_dir, data_file, tmp_path):
    """SIGKILL rank 1 mid-job: the launcher stops the others and names rank 1 and the signal."""
    cmd = [
        sys.executable,
        "-m",
        "xronos.cli",
        *base_args(model_dir("mha_untied"), data_file, tmp_path / "o"),
        "--nodes",
        "3",
        "--mode",
        "tp",
    ]
    cmd[cmd.index("--steps") + 1] = "100000"
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        workers: list[int | None] = [None] * 3
        while time.monotonic() < deadline and not all(workers):
            workers = [worker_below(launcher.pid, f"spec-{d}.json") for d in range(3)]
            time.sleep(0.2)
        assert all(workers)
        rank1 = workers[1]
        assert rank1 is not None
        time.sleep(8)  # let the job start training
        os.kill(rank1, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 2
        assert "xronos: error: worker rank 1 was killed by SIGKILL" in err
        kept = tmp_path / "o" / "device-1.log"
        assert f"(its log: {kept})" in err and kept.is_file()  # the run's directory is gone, the log is not
        assert "Traceback" not in err.split("xronos: error:")[-1]
    finally:
        launcher.kill()  # a failed assertion must not leave a 100000-step job running
    time.sleep(0.5)
    assert not any(_alive(p) for p in workers), "orphan worker processes left behind"


def test_a_failed_worker_is_explained_by_its_exception_in_one_line():
    """The exception line of the worker's last traceback, with what pydantic adds after it (field, value)."""
    tail = [
        "Traceback (most recent call last):",
        '  File "worker.py", line 9, in main',
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for DeviceProfile",
        "kv_fixed_seconds",
        "  Input should be greater than or equal to 0 [input_value=-5.6e-17]",
        "    For further information visit https://errors.pydantic.dev/2.13/v/greater_than_equal",
    ]
    assert last_error(tail) == (
        "ValidationError: 1 validation error for DeviceProfile kv_fixed_seconds "
        "Input should be greater than or equal to 0 [input_value=-5.6e-17]"
    )
    assert (
        last_error(["step 3 ok", "torch.distributed.DistBackendError: [gloo] closed by peer"])
        == "DistBackendError: [gloo] closed by peer"
    )
    assert last_error(["loss 2.31", "", "Killed"]) == "Killed"  # no traceback: the last line
    assert last_error([]) == ""


def test_bench_refuses_pp_micro_batches_that_do_not_divide_the_batch(model_dir, data_file, tmp_path, capsys):
    args = [
        "bench",
        "--model",
        str(model_dir("mha_untied")),
        "--data",
        str(data_file),
        "--output",
        str(tmp_path),
        "--batch-size",
        "4",
        "--seq-len",
        str(SEQ_LEN),
        "--modes",
        "pp,tp",
        "--pp-micro-batches",
        "2,3",
    ]
    code, err = run_cli(args, capsys)
    assert code == 2 and err == ["xronos: error: --pp-micro-batches 3 does not divide --batch-size 4"]


def test_bench_runs_pp_once_per_micro_batch_count():
    from xronos.bench import bench_runs

    assert bench_runs(["xronos", "pp", "tp"], [2, 4]) == [
        ("xronos", "xronos", None),
        ("pp m=2", "pp", 2),
        ("pp m=4", "pp", 4),
        ("tp", "tp", None),
    ]
    assert bench_runs(["pp"], [2]) == [("pp", "pp", 2)]
    assert bench_runs(["pp", "single"], None) == [("pp", "pp", None), ("single", "single", None)]


def test_bench_rounds_report_the_median_round_and_ratios_round_by_round(model_dir, data_file, tmp_path, capsys):
    from xronos.bench import layouts_by_round, median_round, round_ratios

    assert layouts_by_round(["kv 2/1 · mlp 1088/448", "kv 2/1/0 · mlp 960/384/192*"], [0.035, 0.061]) == (
        "1: kv 2/1 · mlp 1088/448 (idle 3.5%); 2: kv 2/1/0 · mlp 960/384/192* (idle 6.1%)"
    )
    assert layouts_by_round(["kv 1/1/1", "kv 1/1/1"], [0.04, 0.05]) is None  # the same plan every round
    assert median_round([3.0, 1.0, 2.0]) == 2
    assert median_round([4.0, 1.0, 3.0, 2.0]) == 3  # of an even number, the lower middle one
    assert round_ratios({"xronos": [2.0, 3.0], "tp": [4.0, 5.0]}, "xronos", "tp") == [0.5, 0.6]
    args = [
        "bench",
        "--model",
        str(model_dir("mha_untied")),
        "--data",
        str(data_file),
        "--output",
        str(tmp_path),
        "--batch-size",
        "4",
        "--seq-len",
        str(SEQ_LEN),
        "--modes",
        "tp",
        "--rounds",
        "0",
    ]
    code, err = run_cli(args, capsys)
    assert code == 2 and err == ["xronos: error: --rounds must be at least 1, got 0"]


def test_bench_idle_summary_gives_each_round_and_their_mean():
    from xronos.bench import idle_summary

    rounds = {"xronos": [0.049, 0.053, 0.015], "tp": [0.36, 0.362, 0.35]}
    assert idle_summary(0.053, 0.362, 0.044, rounds) == (
        "idle: xronos 5.3% (its plan predicted 4.4%), tp 36.2% (6.8x less); by round xronos 4.9% 5.3% 1.5%,"
        " tp 36.0% 36.2% 35.0%; mean over rounds xronos 3.9%, tp 35.7% (9.2x less)"
    )
    assert idle_summary(0.05, 0.1, None, {"xronos": [0.05], "tp": [0.1]}) == "idle: xronos 5.0%, tp 10.0% (2.0x less)"


def test_bench_prediction_takes_the_checks_that_priced_the_final_split():
    """Predicted / measured, round by round: the plan's, and with the job's own paces the median over the
    checks from the last re-shard on, not the plan's profiles nor the checks that priced a split the job left."""
    from xronos.bench import prediction_text
    from xronos.contract.report import ReplanCheck, RunReport
    from xronos.contract.splits import ShardSplit

    moved = ShardSplit(kv_groups=[2, 1], mlp_columns=[1024, 512], vocab_rows=[5632, 2560])

    def check(step: int, predicted: float | None, new_split: ShardSplit | None = None) -> ReplanCheck:
        return ReplanCheck(
            after_step=step,
            measured_compute_seconds=[1.0, 1.0],
            predicted_compute_seconds=[1.0, 1.0],
            new_split=new_split,
            predicted_step_seconds=predicted,
        )

    def report(planned: float | None, measured: float, replans: list[ReplanCheck]) -> RunReport:
        return RunReport.model_construct(predicted_step_seconds=planned, mean_step_seconds=measured, replans=replans)

    checks = [check(4, 9.0), check(6, 4.4, moved), check(8, 4.6), check(10, 5.2), check(12, None)]
    # median of 4.4, 4.6, 5.2; the check before the re-shard priced another split
    assert prediction_text([report(6.9, 4.6, checks)]) == "1.50, 1.00 after the re-plan checks"
    kept = [check(4, 4.0), check(6, 5.0), check(8, 6.0)]
    rounds = [report(6.9, 4.6, checks), report(4.4, 4.0, kept), report(4.0, 4.0, [])]
    assert prediction_text(rounds) == "1.10 (1.00-1.50), 1.12 (1.00-1.25) after the re-plan checks"
    assert prediction_text([report(4.0, 4.0, [])]) == "1.00"  # no check: the plan's alone
    assert prediction_text([report(None, 4.0, kept)]) is None  # nothing predicted


def test_bench_json_keeps_every_round(model_dir, data_file, tmp_path, capsys):
    """Each round's whole report, the median round's among them, so an odd round can be traced."""
    from xronos.bench import BenchResult, median_round

    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--model",
        str(model_dir("mha_untied")),
        "--data",
        str(data_file),
        "--output",
        str(tmp_path / "b"),
        "--batch-size",
        "2",
        "--seq-len",
        str(SEQ_LEN),
        "--steps",
        "3",
        "--nodes",
        "2",
        "--modes",
        "tp,single",
        "--rounds",
        "2",
        "--quiet",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = BenchResult.model_validate_json(out.read_text())
    for mode in ("tp", "single"):
        rounds = result.round_reports[mode]
        assert [r.mode for r in rounds] == [mode, mode]
        assert [r.mean_step_seconds for r in rounds] == result.rounds[mode]
        assert [r.idle_ratio for r in rounds] == result.round_idle[mode]
        assert result.reports[mode] == rounds[median_round(result.rounds[mode])]
    assert "step seconds by round: tp " in capsys.readouterr().out


def test_split_marks_the_ranks_whose_weight_gradients_come_later():
    from xronos.contract.splits import parse_split

    assert parse_split("kv=2/1/0,mlp=896/384/256*,vocab=1/2/3") == {
        "weight_grads_later": [False, False, True],
        "kv_groups": [2, 1, 0],
        "mlp_columns": [896, 384, 256],
        "vocab_rows": [1, 2, 3],
    }
    assert "weight_grads_later" not in parse_split("kv=2/1/0,mlp=896/384/256")
    assert parse_split("kv=1/1/1*,mlp=512/512/512")["attention_weight_grads_later"] == [False, False, True]
    # vocabulary sizes say how many of their rows' weight gradients come later
    assert parse_split("kv=2/1/0,mlp=896/384/256,vocab=512/256*64/256*256") == {
        "kv_groups": [2, 1, 0],
        "mlp_columns": [896, 384, 256],
        "vocab_rows_later": [0, 64, 256],
        "vocab_rows": [512, 256, 256],
    }
    with pytest.raises(ValueError, match="a vocabulary size's mark is"):
        parse_split("kv=2/1/0,mlp=896/384/256,vocab=1/2*/3")
    with pytest.raises(ValueError, match="only kv, mlp and vocab sizes take a"):
        parse_split("layers=2*/1")
    with pytest.raises(ValueError, match="exceeds its 2 vocabulary rows"):
        ShardSplit(kv_groups=[1, 1], mlp_columns=[1, 1], vocab_rows=[1, 2], vocab_rows_later=[0, 3])
    split = ShardSplit(kv_groups=[1, 1], mlp_columns=[1, 1], vocab_rows=[1, 2], vocab_rows_later=[0, 2])
    assert split.describe() == "kv 1/1 · mlp 1/1 · vocab 1/2*2"
    assert ShardSplit(**parse_split(split.describe().replace(" · ", ",").replace(" ", "="))) == split
