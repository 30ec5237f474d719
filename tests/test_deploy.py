"""`xronos deploy` against a real Docker engine (tests/docker_engine.py), and its inventory's errors.

Through the command line, as a user runs it: containers made with the
inventory's limits, restart policy, host network and labels, the password in a
file only the node's user reads (never in `docker inspect`, the output or a
flag), the Prometheus targets, `status`, a second rollout replacing the
containers, an unreachable device reported while the others are deployed, and
`remove`. Bad inventories: one line naming the file and the field, exit 2.
"""

from __future__ import annotations

import io
import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from docker_engine import Engine

from xronos.cli import main
from xronos.contract.errors import XronosError

PASSWORDS = {
    "XRONOS_PASSWORD_PYTEST_A": "pw-a-4c1f9e",
    "XRONOS_PASSWORD_PYTEST_B": "pw-b-77d0aa",
    "XRONOS_PASSWORD_PYTEST_C": "pw-c-0b3e52",
}


@pytest.fixture(scope="session")
def engine():
    engine = Engine()
    try:
        yield engine
    finally:
        for container in engine.client.containers.list(all=True, filters={"label": "io.xronos.role=node"}):
            if container.name.startswith("xronos-node-pytest-"):
                container.remove(force=True)
        engine.close()


def write_inventory(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


@pytest.fixture
def inventory(engine, tmp_path, monkeypatch):
    image = engine.tiny_image()
    for name, value in PASSWORDS.items():
        monkeypatch.setenv(name, value)
    return write_inventory(
        tmp_path / "devices.yaml",
        f"""\
        image: {image}
        pull: never
        broker: mqtt://192.0.2.10:1883
        devices:
          - name: gw-kitchen
            base_url: {engine.url}
            node_id: pytest-a
            cpus: 1.5
            memory: 256m
            metrics_port: 9181
          - name: hub-living
            base_url: {engine.url}
            node_id: pytest-b
            cpus: 0.25
            memory: 128m
            restart: on-failure
            max_retries: 4
            metrics_port: 9182
            address: 198.51.100.7
            gloo_interface: eth0
          - name: car-1
            base_url: unix://{tmp_path}/no-engine-here.sock
            node_id: pytest-c
        """,
    )


def test_deploy_status_redeploy_and_remove_through_the_engine(engine, inventory, tmp_path, capsys):
    targets = tmp_path / "targets" / "xronos-deploy.json"
    args = ["deploy", "--inventory", str(inventory), "--targets", str(targets)]

    code, out, err = run(args, capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("xronos: error: 1 of 3 devices not deployed: car-1 (unreachable: no socket at ")
    assert "gw-kitchen  ok" in out and "hub-living  ok" in out and "car-1       FAILED" in out

    a = engine.client.containers.get("xronos-node-pytest-a")
    b = engine.client.containers.get("xronos-node-pytest-b")
    assert a.status == b.status == "running"
    host_a, host_b = a.attrs["HostConfig"], b.attrs["HostConfig"]
    assert (host_a["NanoCpus"], host_a["Memory"], host_a["NetworkMode"]) == (1_500_000_000, 256 * 2**20, "host")
    assert (host_b["NanoCpus"], host_b["Memory"], host_b["NetworkMode"]) == (250_000_000, 128 * 2**20, "host")
    assert host_a["RestartPolicy"]["Name"] == "unless-stopped"
    assert host_b["RestartPolicy"] == {"Name": "on-failure", "MaximumRetryCount": 4}
    assert host_a["Init"] is True
    assert a.labels == {"io.xronos.role": "node", "io.xronos.node-id": "pytest-a", "io.xronos.device": "gw-kitchen"}
    assert a.attrs["Config"]["Cmd"] == ["node", "--node-id", "pytest-a", "--metrics-port", "9181", "--threads", "1"]
    assert b.attrs["Config"]["Cmd"][-2:] == ["--address", "198.51.100.7"]
    env = dict(e.split("=", 1) for e in a.attrs["Config"]["Env"])
    assert env["XRONOS_BROKER"] == "mqtt://192.0.2.10:1883" and env["XRONOS_USERNAME"] == "pytest-a"
    assert env["XRONOS_PASSWORD_FILE"] == "/run/secrets/xronos-mqtt-password" and "GLOO_SOCKET_IFNAME" not in env
    assert "GLOO_SOCKET_IFNAME=eth0" in b.attrs["Config"]["Env"]
    assert [m["Destination"] for m in a.attrs["Mounts"]] and {m["Name"] for m in a.attrs["Mounts"]} == {
        "xronos-models",
        "xronos-data",
        "xronos-checkpoints",
    }

    # the password: in a file the node's user alone reads, nowhere else
    code_read, secret = a.exec_run(["cat", "/run/secrets/xronos-mqtt-password"])
    assert code_read == 0 and secret.decode() == PASSWORDS["XRONOS_PASSWORD_PYTEST_A"]
    _, listing = a.exec_run(["stat", "-c", "%a %u", "/run/secrets/xronos-mqtt-password"])
    assert listing.decode().split() == ["400", "10001"]
    for value in PASSWORDS.values():
        assert value not in json.dumps(a.attrs) + json.dumps(b.attrs) + out + "\n".join(err)

    assert json.loads(targets.read_text()) == [
        {"targets": ["127.0.0.1:9181"], "labels": {"role": "node", "device": "gw-kitchen"}},
        {"targets": ["198.51.100.7:9182"], "labels": {"role": "node", "device": "hub-living"}},
        {"targets": ["127.0.0.1:9101"], "labels": {"role": "node", "device": "car-1"}},
    ]

    code, out, err = run(["deploy", "status", "--inventory", str(inventory)], capsys)
    assert code == 2 and "1 of 3 devices not running: car-1" in err[0]
    assert "xronos-node-pytest-a running" in out and "cpus 0.25, memory 128 MiB" in out

    first_id = a.id
    code, out, err = run(args, capsys)  # a second rollout replaces the containers
    assert code == 2
    assert engine.client.containers.get("xronos-node-pytest-a").id != first_id

    code, out, err = run(["deploy", "remove", "--inventory", str(inventory), "--targets", str(targets)], capsys)
    assert code == 2 and "1 of 3 devices not removed: car-1" in err[0]
    assert "removed xronos-node-pytest-a" in out and "removed xronos-node-pytest-b" in out
    assert not engine.client.containers.list(all=True, filters={"name": "xronos-node-pytest-"})
    assert json.loads(targets.read_text()) == [  # only the device that could not be reached may still run one
        {"targets": ["127.0.0.1:9101"], "labels": {"role": "node", "device": "car-1"}}
    ]


def test_a_device_without_its_password_is_reported_and_left_as_it_was(engine, inventory, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("XRONOS_PASSWORD_PYTEST_B")
    code, out, err = run(["deploy", "--inventory", str(inventory), "--targets", str(tmp_path / "t.json")], capsys)
    assert code == 2 and "hub-living (no MQTT password: set XRONOS_PASSWORD_PYTEST_B" in err[0]
    names = {c.name for c in engine.client.containers.list(all=True, filters={"name": "xronos-node-pytest-"})}
    assert names == {"xronos-node-pytest-a"}
    run(["deploy", "remove", "--inventory", str(inventory), "--targets", str(tmp_path / "t.json")], capsys)


def test_dry_run_changes_nothing_and_shows_no_secret(engine, inventory, tmp_path, capsys):
    code, out, err = run(
        ["deploy", "--inventory", str(inventory), "--dry-run", "--targets", str(tmp_path / "t.json")], capsys
    )
    assert code == 0 and err == []
    assert out.startswith("dry run: nothing is changed\n")
    assert "command   xronos node --node-id pytest-b --metrics-port 9182 --threads 1 --address 198.51.100.7" in out
    assert "limits    cpus 0.25, memory 128m, restart on-failure (max 4), network host (collectives on eth0)" in out
    assert "password from $XRONOS_PASSWORD_PYTEST_A (set)" in out
    assert all(value not in out for value in PASSWORDS.values())
    assert not (tmp_path / "t.json").exists()
    assert not engine.client.containers.list(all=True, filters={"name": "xronos-node-pytest-"})


def test_a_missing_image_is_reported_per_device(engine, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XRONOS_PASSWORD_PYTEST_A", "x")
    inventory = write_inventory(
        tmp_path / "devices.yaml",
        f"""\
        image: xronos-test/not-built:here
        pull: never
        broker: mqtt://127.0.0.1:1883
        devices: [{{name: pytest-a, base_url: "{engine.url}"}}]
        """,
    )
    code, out, err = run(["deploy", "--inventory", str(inventory), "--targets", str(tmp_path / "t.json")], capsys)
    assert code == 2 and "image xronos-test/not-built:here is not on the device (pull: never)" in err[0]


BAD_INVENTORIES = [
    (
        "broker: mqtt://b:1883\ndevices:\n  - {name: a, base_url: 'unix:///s', cpus: 0}\n",
        "devices[0] (a).cpus: Input should be greater than 0",
    ),
    (
        "broker: mqtt://b:1883\ndevices:\n  - {name: a, base_url: 'tcp://10.0.0.2:2376'}\n",
        "devices[0] (a): a tcp:// engine needs tls (ca_cert, client_cert, client_key)",
    ),
    (
        "broker: mqtt://b:1883\ndevices:\n  - {name: a, base_url: 'http://10.0.0.2'}\n",
        "devices[0] (a): base_url 'http://10.0.0.2': use ssh://user@host, tcp://host:2376 or unix:///path",
    ),
    (
        "broker: mqtt://b:1883\ndevices:\n  - {name: a, base_url: 'ssh://h', memory: lots}\n",
        "devices[0] (a).memory: String should match pattern",
    ),
    (
        "broker: mqtt://b:1883\ndevices:\n  - {name: a, base_url: 'ssh://h', password: hunter2}\n",
        "devices[0] (a).password: Extra inputs are not permitted",
    ),
    (
        "broker: mqtt://b:1883\ndevices:\n  - {name: a, base_url: 'ssh://h'}\n  - {name: b, base_url: 'ssh://g', node_id: a}\n",
        "two devices have the node id 'a'",
    ),
    (
        "broker: mqtt://b:1883\ndevices:\n  - {name: a, base_url: 'ssh://h'}\n  - {name: b, base_url: 'ssh://h'}\n",
        "device 'b': another device on ssh://h has metrics_port 9101",
    ),
    (
        "broker: mqtts://b:8883\ndevices:\n  - {name: a, base_url: 'ssh://h'}\n",
        "an mqtts:// broker needs mqtt_certs (the folder deploy/mosquitto/make-certs.sh wrote)",
    ),
    (
        "broker: mqtt://n0:hunter2@b:1883\ndevices:\n  - {name: a, base_url: 'ssh://h'}\n",
        "bad broker URL 'mqtt://n0:***@b:1883': credentials do not go in the URL",
    ),
    (
        "broker: ws://b\ndevices:\n  - {name: a, base_url: 'ssh://h'}\n",
        "bad broker URL 'ws://b': use mqtts://host:8883 (TLS) or mqtt://host:1883",
    ),
    ("broker: mqtt://b:1883\ndevices: []\n", "devices: List should have at least 1 item"),
    ("devices:\n  - {name: a, base_url: 'ssh://h'}\n", "broker: Field required"),
    ("broker: [unclosed\n", "not valid YAML at line 2"),
    ("- just\n- a list\n", "expected a mapping with broker and devices, got list"),
]


@pytest.mark.parametrize("text, message", BAD_INVENTORIES, ids=[m.split(":")[0][:30] for _, m in BAD_INVENTORIES])
def test_a_bad_inventory_is_one_line_naming_the_field(text, message, tmp_path, capsys):
    path = tmp_path / "devices.yaml"
    path.write_text(text)
    code, out, err = run(["deploy", "--inventory", str(path), "--dry-run"], capsys)
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"xronos: error: {path}: ") and message in err[0], err[0]


def test_a_missing_inventory_is_one_line(tmp_path, capsys):
    code, out, err = run(["deploy", "status", "--inventory", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and err == [
        f"xronos: error: cannot read the inventory '{tmp_path / 'nope.yaml'}': No such file or directory"
    ]


def test_an_mqtts_inventory_hands_the_node_its_tls_files_as_secrets(tmp_path, monkeypatch, capsys):
    """With the TLS broker: the node's CA, certificate and key (make-certs.sh) go into the same
    0400 secret files as the password, named by XRONOS_*_FILE variables, never by their content."""
    import tarfile

    from xronos.deploy import _secret_tar, node_environment, read_tls_files
    from xronos.inventory import load_inventory

    make_certs = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto" / "make-certs.sh"
    subprocess.run(["sh", str(make_certs), str(tmp_path / "certs"), "gw-1"], check=True, capture_output=True)
    path = tmp_path / "devices.yaml"
    path.write_text(
        "broker: mqtts://10.0.0.1:8883\nmqtt_certs: certs\ndevices:\n  - {name: gw-1, base_url: 'unix:///nope.sock'}\n"
    )
    inventory = load_inventory(path)
    device = inventory.devices[0]
    env = node_environment(inventory, device)
    assert env["XRONOS_BROKER"] == "mqtts://10.0.0.1:8883"
    assert env["XRONOS_CA_FILE"] == "/run/secrets/xronos-mqtt-ca.crt"
    assert env["XRONOS_CERT_FILE"] == "/run/secrets/xronos-mqtt-client.crt"
    assert env["XRONOS_KEY_FILE"] == "/run/secrets/xronos-mqtt-client.key"
    files = read_tls_files(inventory, device)
    assert files["xronos-mqtt-client.key"] == (tmp_path / "certs" / "gw-1.key").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(_secret_tar("pw", "10001:10001", files))) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"xronos-mqtt-password", *files}
    assert all(m.mode == 0o400 and m.uid == 10001 for m in members.values())
    monkeypatch.setenv("XRONOS_PASSWORD_GW_1", "s3cret-gw")
    code, out, err = run(["deploy", "--inventory", str(path), "--dry-run"], capsys)
    assert "tls       CA, certificate and key from" in out and "s3cret-gw" not in out + "".join(err)
    (tmp_path / "certs" / "gw-1.key").unlink()
    with pytest.raises(XronosError, match="gw-1.key.*make-certs.sh"):
        read_tls_files(inventory, device)
