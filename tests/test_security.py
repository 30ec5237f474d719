"""Who gets in where, against a real Mosquitto run from the shipped `deploy/mosquitto/mosquitto.conf`
and `acl` (only paths and ports substituted), with certificates from `make-certs.sh`:
roles cannot exceed their ACLs (MQTT v5 reason codes), nodes cannot pose as each other or take
over each other's client id, the operator cannot pose as a node, TLS works and plaintext is refused,
and no password shows in `ps`, a log, a metric or a retained message of a whole job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from live_cluster import wait_for
from paho.mqtt.reasoncodes import ReasonCode

from edge_node.worker_process import free_port, stop_processes
from xronos.mosquitto import Mosquitto

REPO = Path(__file__).resolve().parent.parent
MAKE_CERTS = REPO / "deploy" / "mosquitto" / "make-certs.sh"
MAKE_PASSWORDS = REPO / "deploy" / "mosquitto" / "make-passwords.sh"
USERS = {
    "controller": "ctl-" + uuid.uuid4().hex,
    "operator": "op-" + uuid.uuid4().hex,
    "n0": "n0-" + uuid.uuid4().hex,
    "n1": "n1-" + uuid.uuid4().hex,
}
NOT_AUTHORIZED = 135


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    env = {**os.environ, "XRONOS_BROKER_NAMES": "127.0.0.1 localhost"}
    subprocess.run(["sh", str(MAKE_CERTS), str(out), "n0", "n1"], check=True, env=env, capture_output=True)
    return out


@pytest.fixture(scope="module")
def broker(certs):
    with Mosquitto(users=USERS, certs=certs) as m:
        yield m


def client(broker, certs: Path, user: str, client_id: str, *, operator_port: bool = False, v5: bool = True, **kw):
    """A raw paho client over TLS with `user`'s certificate; `.events` records connects, disconnects, acks."""
    c = paho.Client(
        paho.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
    )
    c.events = {"connack": [], "disconnect": [], "puback": {}, "messages": []}
    c.on_connect = lambda cl, u, f, rc, p: c.events["connack"].append(rc)
    c.on_disconnect = lambda cl, u, f, rc, p: c.events["disconnect"].append(rc)
    c.on_publish = lambda cl, u, mid, rc, p: c.events["puback"].__setitem__(mid, rc)
    c.on_message = lambda cl, u, m: c.events["messages"].append((m.topic, m.payload))
    c.username_pw_set(user, kw.get("password", USERS.get(user)))
    c.tls_set(ca_certs=str(certs / "ca.crt"), certfile=str(certs / f"{user}.crt"), keyfile=str(certs / f"{user}.key"))
    if "will" in kw:
        c.will_set(*kw["will"], qos=1, retain=True)
    port = broker.operator_port if operator_port else broker.port
    c.connect("127.0.0.1", port, keepalive=5)
    c.loop_start()
    wait_for(lambda: c.events["connack"], 10, f"{user}'s CONNACK")
    return c


def publish(c, topic: str, payload: bytes) -> int:
    """Publish at QoS 1 and return the PUBACK's reason code (v5) once it came."""
    info = c.publish(topic, payload, qos=1)
    wait_for(lambda: info.mid in c.events["puback"], 10, f"PUBACK for {topic}")
    rc = c.events["puback"][info.mid]
    return rc.value if isinstance(rc, ReasonCode) else int(rc)


def close(*clients) -> None:
    for c in clients:
        c.disconnect()
        c.loop_stop()


def test_each_role_writes_only_its_own_topics(broker, certs):
    """The ACL as shipped: every forbidden publish is answered `Not authorized` (v5 PUBACK 135) and
    never reaches a subscriber that may read everything; every allowed one arrives."""
    watcher = client(broker, certs, "controller", "xronos-watch-roles", operator_port=True)
    watcher.subscribe("xronos/#", qos=1)
    n0 = client(broker, certs, "n0", "xronos-node-n0")
    operator = client(broker, certs, "operator", "xronos-operator-roles", operator_port=True)
    controller = client(broker, certs, "controller", "xronos-controller")
    assignment = json.dumps({"schema_version": 1, "job_id": "evil", "node_id": "n1", "phase": "profile"}).encode()
    try:
        time.sleep(0.5)  # the subscription is in place
        forbidden = [
            (n0, "xronos/nodes/n1/assignment", assignment),  # a node writes an assignment
            (n0, "xronos/nodes/n0/assignment", assignment),  # ... even its own
            (n0, "xronos/cmd/train", b'{"schema_version": 1, "job_id": "x"}'),  # a node commands
            (n0, "xronos/nodes/n1/status", b'{"state": "offline"}'),  # a node writes another's topics
            (n0, "xronos/nodes/n1/heartbeat", b"{}"),
            (n0, "xronos/nodes/n1/result", b"{}"),
            (n0, "xronos/jobs/j/status", b"{}"),
            (operator, "xronos/nodes/operator/status", b'{"state": "online"}'),  # the operator poses as a node
            (operator, "xronos/nodes/operator/profile", b"{}"),
            (operator, "xronos/nodes/n0/status", b"{}"),
            (operator, "xronos/nodes/n1/assignment", assignment),  # the operator writes an assignment
            (operator, "xronos/jobs/j/status", b"{}"),
            (controller, "xronos/cmd/train", b"{}"),  # the controller commands
            (controller, "xronos/nodes/controller/status", b"{}"),  # ... or poses as a node
            (controller, "xronos/nodes/n0/heartbeat", b"{}"),
        ]
        for c, topic, payload in forbidden:
            assert publish(c, topic, payload) == NOT_AUTHORIZED, topic
        allowed = [
            (n0, "xronos/nodes/n0/heartbeat", b"n0-own"),
            (operator, "xronos/cmd/stop", b"operator-command"),
            (controller, "xronos/nodes/n1/assignment", b"controller-assignment"),
            (controller, "xronos/jobs/j/status", b"controller-status"),
        ]
        for c, topic, payload in allowed:
            assert publish(c, topic, payload) == 0, topic
        wait_for(lambda: len(watcher.events["messages"]) >= len(allowed), 10, "the allowed messages")
        time.sleep(0.5)
        got = watcher.events["messages"]
        assert sorted(got) == sorted((t, p) for _, t, p in allowed), got
        assert not watcher.events["disconnect"]
    finally:
        close(watcher, n0, operator, controller)


def test_a_forbidden_publish_over_mqtt_3_1_1_is_dropped_silently(broker, certs):
    """What the Xronos clients speak: the broker gives no reason code, the message just never arrives."""
    watcher = client(broker, certs, "controller", "xronos-watch-311", operator_port=True)
    watcher.subscribe("xronos/nodes/+/assignment", qos=1)
    n1 = client(broker, certs, "n1", "xronos-node-n1", v5=False)
    try:
        time.sleep(0.3)
        n1.publish("xronos/nodes/n1/assignment", b'{"forged": true}', qos=1).wait_for_publish(5)
        time.sleep(1.0)
        assert watcher.events["messages"] == []
    finally:
        close(watcher, n1)


def test_no_user_takes_over_another_users_session(broker, certs):
    """Client ids are bound to usernames: n0 claiming n1's client id, on either listener, and the
    operator claiming it, leave n1 connected and its will unfired; operators' tools coexist."""
    watcher = client(broker, certs, "controller", "xronos-watch-ids", operator_port=True)
    watcher.subscribe("xronos/nodes/n1/status", qos=1)
    n1 = client(broker, certs, "n1", "xronos-node-n1", v5=False, will=("xronos/nodes/n1/status", b"n1-will"))
    thieves = []
    try:
        time.sleep(0.3)
        # on the devices' listener the broker renames the client to its user: n0 stays n0
        thieves.append(client(broker, certs, "n0", "xronos-node-n1"))
        assert thieves[-1].events["connack"][0].value == 0
        # on the operators' listener n1's real id ("n1") lacks the xronos- prefix: refused
        thieves.append(client(broker, certs, "n0", "n1", operator_port=True))
        assert thieves[-1].events["connack"][0].is_failure
        thieves.append(client(broker, certs, "operator", "n1", operator_port=True))
        assert thieves[-1].events["connack"][0].is_failure
        # the old-style id on the operators' listener is nobody's id there
        thieves.append(client(broker, certs, "n0", "xronos-node-n1", operator_port=True))
        thieves.append(client(broker, certs, "operator", "xronos-node-n1"))  # renamed to "operator"
        # two operator tools at once (xronos train --wait beside xronos status)
        tools = [client(broker, certs, "operator", f"xronos-operator-{uuid.uuid4().hex}", operator_port=True)]
        tools.append(client(broker, certs, "operator", f"xronos-status-{uuid.uuid4().hex}", operator_port=True))
        thieves += tools
        time.sleep(2.0)
        assert n1.is_connected() and n1.events["disconnect"] == [], n1.events["disconnect"]
        assert all(t.is_connected() and not t.events["disconnect"] for t in tools)
        assert watcher.events["messages"] == []  # n1's will never fired
        # n1 itself reconnecting replaces its own session: the broker did bind the id to the user
        again = client(broker, certs, "n1", "xronos-anything-else", v5=False)
        wait_for(lambda: n1.events["disconnect"], 10, "n1's old session to be replaced by its own new one")
        thieves.append(again)
    finally:
        close(watcher, n1, *thieves)


def xronos_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("XRONOS_")}
    return subprocess.run(
        [sys.executable, "-m", "xronos.cli", *args],
        env=clean | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tls_env(certs: Path, user: str, url: str, password_file: Path | None = None) -> dict:
    env = {
        "XRONOS_BROKER": url,
        "XRONOS_USERNAME": user,
        "XRONOS_CA_FILE": str(certs / "ca.crt"),
        "XRONOS_CERT_FILE": str(certs / f"{user}.crt"),
        "XRONOS_KEY_FILE": str(certs / f"{user}.key"),
    }
    return env | ({"XRONOS_PASSWORD_FILE": str(password_file)} if password_file else {})


def test_tls_connections_work_and_plaintext_ones_are_refused(broker, certs, tmp_path):
    pw = tmp_path / "operator.pw"
    pw.write_text(USERS["operator"] + "\n")
    ok = xronos_cli("status", "--json", "--listen", "0.5", env=tls_env(certs, "operator", broker.operator_url, pw))
    assert ok.returncode == 0, ok.stderr
    assert set(json.loads(ok.stdout)) == {"nodes", "jobs"}
    # the same with flags instead of variables
    flags = xronos_cli(
        "status",
        "--json",
        "--listen",
        "0.5",
        "--broker",
        broker.operator_url,
        "--username",
        "operator",
        "--password-file",
        str(pw),
        "--ca-file",
        str(certs / "ca.crt"),
        "--cert-file",
        str(certs / "operator.crt"),
        "--key-file",
        str(certs / "operator.key"),
    )
    assert flags.returncode == 0, flags.stderr

    for port in (broker.port, broker.operator_port):  # plain MQTT to either listener: no CONNACK ever
        plain = xronos_cli("status", env={"XRONOS_BROKER": f"mqtt://127.0.0.1:{port}", "XRONOS_USERNAME": "operator"})
        assert plain.returncode == 2 and plain.stderr.startswith("xronos: error: cannot connect"), plain.stderr
        assert "no answer" in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    raw = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="xronos-plain", protocol=paho.MQTTv311)
    raw.username_pw_set("operator", USERS["operator"])
    acks = []
    raw.on_connect = lambda *a: acks.append(a[3])
    raw.connect("127.0.0.1", broker.operator_port)
    raw.loop_start()
    time.sleep(2)
    raw.loop_stop()
    assert acks == []

    # TLS without a client certificate, or with one from another CA: refused in one line
    env = tls_env(certs, "operator", broker.operator_url, pw)
    no_cert = xronos_cli(
        "status", env={k: v for k, v in env.items() if k not in ("XRONOS_CERT_FILE", "XRONOS_KEY_FILE")}
    )
    assert no_cert.returncode == 2 and "TLS to the broker" in no_cert.stderr, no_cert.stderr
    other = tmp_path / "other-ca"
    subprocess.run(["sh", str(MAKE_CERTS), str(other)], check=True, capture_output=True)
    foreign = xronos_cli(
        "status",
        env=env | {"XRONOS_CERT_FILE": str(other / "operator.crt"), "XRONOS_KEY_FILE": str(other / "operator.key")},
    )
    assert foreign.returncode == 2 and "TLS to the broker" in foreign.stderr, foreign.stderr
    untrusted = xronos_cli("status", env=env | {"XRONOS_CA_FILE": str(other / "ca.crt")})
    assert untrusted.returncode == 2 and "certificate verify failed" in untrusted.stderr, untrusted.stderr
    wrong_pw = tmp_path / "wrong.pw"
    wrong_pw.write_text("not-it\n")
    refused = xronos_cli("status", env=env | {"XRONOS_PASSWORD_FILE": str(wrong_pw)})
    assert refused.returncode == 2 and refused.stderr.strip().endswith("Not authorized"), refused.stderr


def test_secrets_are_refused_on_the_command_line_and_redacted_in_errors(tmp_path):
    given = xronos_cli("status", "--password", "hunter2-argv")
    assert given.returncode == 2 and "XRONOS_PASSWORD" in given.stderr and "--password-file" in given.stderr
    assert "hunter2-argv" not in given.stderr + given.stdout
    embedded = xronos_cli("broker", "--password", "hunter2-argv", "--port", str(free_port()))
    assert embedded.returncode == 2 and "hunter2-argv" not in embedded.stderr
    for url in (
        "mqtt://n0:hunter2-url@127.0.0.1:1883",
        "mqtt://n0:hunter2-url@127.0.0.1:port",
        "ftp://a:hunter2-url@h",
    ):
        bad = xronos_cli("status", "--broker", url)
        assert bad.returncode == 2 and bad.stderr.startswith("xronos: error: bad broker URL"), bad.stderr
        assert "hunter2-url" not in bad.stderr and "***" in bad.stderr, bad.stderr
    env_url = xronos_cli("status", env={"XRONOS_BROKER": "mqtts://n0:hunter2-env@127.0.0.1"})
    assert env_url.returncode == 2 and "hunter2-env" not in env_url.stderr, env_url.stderr
    half = xronos_cli("status", "--broker", "mqtts://127.0.0.1:8883", "--cert-file", str(tmp_path / "c.crt"))
    assert half.returncode == 2 and "--key-file" in half.stderr, half.stderr


def test_make_passwords_keeps_passwords_out_of_argv(tmp_path, certs):
    """make-passwords.sh with a recording stand-in in front of the real mosquitto_passwd: no
    password in any argv, and the file it wrote lets the users into the shipped broker."""
    shim = tmp_path / "bin"
    shim.mkdir()
    log = tmp_path / "argv.log"
    real = subprocess.run(["sh", "-c", "command -v mosquitto_passwd"], capture_output=True, text=True).stdout.strip()
    assert real, "mosquitto_passwd is not installed (apt-get install --no-install-recommends mosquitto)"
    (shim / "mosquitto_passwd").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {real} "$@"\n')
    (shim / "mosquitto_passwd").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    env |= {f"XRONOS_PASSWORD_{u.upper()}": pw for u, pw in USERS.items()}
    passwd = tmp_path / "passwd"
    done = subprocess.run(["sh", str(MAKE_PASSWORDS), str(passwd), "n0", "n1"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = log.read_text()
    assert calls.count("\n") == 4 and all(pw not in calls for pw in USERS.values()), calls
    assert oct(passwd.stat().st_mode & 0o777) == "0o600"
    assert sorted(line.split(":")[0] for line in passwd.read_text().splitlines()) == sorted(USERS)
    refused = subprocess.run(["sh", str(MAKE_PASSWORDS), str(tmp_path / "p2"), "operator"], capture_output=True)
    assert refused.returncode == 2  # a node called like a role would get the role's ACL


# -- a whole job, started the documented way: no password anywhere ---------------------------
def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_a_job_over_tls_leaks_no_password(broker, certs, tmp_path, model_dir, data_file):
    """Controller, two nodes and `xronos train --wait` as the README starts them (TLS, passwords in
    files): `ps` (arguments and environments) never shows a password while the job runs, and no
    log, metric, state file or retained message of the job holds one."""
    root = tmp_path
    files = {}
    for user, password in USERS.items():
        files[user] = root / f"{user}.pw"
        files[user].write_text(password + "\n")
        files[user].chmod(0o600)
    ports = {"controller": free_port(), "n0": free_port(), "n1": free_port()}
    procs, logs = [], []

    def start(user: str, *args: str) -> None:
        log = root / f"{user}.log"
        logs.append(log)
        env = {k: v for k, v in os.environ.items() if not k.startswith("XRONOS_")}
        env |= tls_env(certs, user, broker.url, files[user])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "xronos.cli", *args], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
            )
        )

    start(
        "controller",
        "controller",
        "--metrics-port",
        str(ports["controller"]),
        "--state-dir",
        str(root / "state"),
        "--probe-broker",  # the test's operator listener is not on the shipped port 8884
        broker.operator_url,
    )
    for node in ("n0", "n1"):
        start(node, "node", "--node-id", node, "--metrics-port", str(ports[node]), "--workdir", str(root / node))
    seen_ps: list[str] = []
    stop_ps = threading.Event()

    def sample_ps() -> None:
        while not stop_ps.is_set():
            seen_ps.append(
                subprocess.run(["ps", "-e", "-ww", "e", "-o", "args"], capture_output=True, text=True).stdout
            )
            time.sleep(0.3)

    try:

        def both_online() -> bool:
            try:
                return "xronos_nodes_online 2.0" in scrape(ports["controller"])
            except OSError:
                return False

        wait_for(both_online, 90, "the controller to see both nodes over TLS", poll=0.5)
        sampler = threading.Thread(target=sample_ps, daemon=True)
        sampler.start()
        train = xronos_cli(
            "train",
            "--model",
            str(model_dir("gqa_tied")),
            "--data",
            str(data_file),
            "--output",
            str(root / "out"),
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--mode",
            "tp",
            "--job-id",
            "tls-job",
            "--wait",
            "--timeout",
            "300",
            "--quiet",
            "--password-file",
            str(files["operator"]),
            env={k: v for k, v in tls_env(certs, "operator", broker.operator_url).items()},
            timeout=360,
        )
        stop_ps.set()
        sampler.join(timeout=10)
        assert train.returncode == 0, train.stdout + train.stderr
        assert "completed" in train.stdout
        metrics = {name: scrape(port) for name, port in ports.items()}
        assert 'xronos_tokens_total{job_id="tls-job"' in metrics["n0"]
        retained = client(broker, certs, "controller", "xronos-watch-retained", operator_port=True)
        retained.subscribe("xronos/#", qos=1)
        wait_for(lambda: any(t == "xronos/jobs/tls-job/status" for t, _ in retained.events["messages"]), 10, "retained")
        time.sleep(0.5)
        close(retained)
    finally:
        stop_ps.set()
        stop_processes(procs, grace=15)

    workers = [s for s in seen_ps if re.search(r"xronos\.cli node|worker", s)]
    assert len(seen_ps) >= 3 and workers, "ps was not sampled while the job ran"
    texts = {f"ps sample {i}": s for i, s in enumerate(seen_ps)}
    texts |= {f"metrics of {n}": m for n, m in metrics.items()}
    texts |= {"train output": train.stdout + train.stderr}
    texts |= {f"retained {t}": p.decode(errors="replace") for t, p in retained.events["messages"]}
    for folder in (root / "state", root / "n0", root / "n1"):
        for path in folder.rglob("*"):
            if path.is_file() and path.stat().st_size < 50_000_000:
                texts[str(path)] = path.read_bytes().decode(errors="replace")
    for log in logs:
        texts[str(log)] = log.read_text(errors="replace")
    texts["mosquitto log"] = (broker.dir / "mosquitto.log").read_text(errors="replace")
    assert any("worker.log" in name for name in texts), sorted(texts)
    leaks = [(name, user) for name, text in texts.items() for user, pw in USERS.items() if pw in text]
    assert not leaks, leaks
