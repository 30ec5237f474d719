"""`xronos deploy`: node containers rolled out to devices through each device's Docker Engine API.

One node container per device (`xronos-node-<node id>`), made with the
`docker` SDK against the device's `base_url` from the inventory
(`xronos.inventory`): host networking (the collectives connect on ports
picked at run time), the device's CPU and memory limits, its restart policy,
the broker's address and the node's MQTT identity. The password (and, for
an mqtts:// broker, the CA, the node's certificate and its key) is written
into the created container as files (/run/secrets, read through
XRONOS_PASSWORD_FILE, XRONOS_CA_FILE, XRONOS_CERT_FILE, XRONOS_KEY_FILE)
before it starts: it is on no command line, in no environment value that
`docker inspect` shows, and in no log line.

`up` replaces each device's container (a rollout is repeatable), `status`
shows them, `remove` stops and removes them (volumes stay). A device that
cannot be reached or refuses is reported and the others are still done; the
command then exits non-zero. `up` and `remove` rewrite the Prometheus file_sd
target list of the inventory's nodes (read by deploy/prometheus/prometheus.yml).
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically
from xronos.inventory import Device, Inventory, load_inventory, password_variable

CONTAINER_PREFIX = "xronos-node-"
LABELS = {"role": "io.xronos.role", "node": "io.xronos.node-id", "device": "io.xronos.device"}
SECRET_DIR = "/run/secrets"
SECRET_NAME = "xronos-mqtt-password"
DEFAULT_TARGETS = Path("deploy/prometheus/targets/xronos-deploy.json")
CONNECT_SECONDS = 5.0
"""How long to wait for a device's engine port before calling it unreachable (the SDK's own
timeout also bounds pulls, so it cannot be this short)."""
HANDSHAKE_SECONDS = 30
"""Connecting to the engine (TLS or SSH handshake) and its first answer."""
API_SECONDS = 300


@dataclass(frozen=True)
class Outcome:
    device: str
    ok: bool
    detail: str


def container_name(device: Device) -> str:
    return CONTAINER_PREFIX + device.node


def node_command(device: Device) -> list[str]:
    """The container's command (the image's entrypoint is `xronos`): no secret on it."""
    command = [
        "node",
        "--node-id",
        device.node,
        "--metrics-port",
        str(device.metrics_port),
        "--threads",
        str(device.threads),
    ]
    return command + (["--address", device.address] if device.address else [])


def node_environment(inventory: Inventory, device: Device) -> dict[str, str]:
    env = {
        "XRONOS_BROKER": inventory.broker,
        "XRONOS_USERNAME": device.username or device.node,
        "XRONOS_PASSWORD_FILE": f"{SECRET_DIR}/{SECRET_NAME}",
    }
    names = dict(zip(("XRONOS_CA_FILE", "XRONOS_CERT_FILE", "XRONOS_KEY_FILE"), inventory.tls_files(device)))
    env |= {variable: f"{SECRET_DIR}/{name}" for variable, name in names.items()}
    return env | ({"GLOO_SOCKET_IFNAME": device.gloo_interface} if device.gloo_interface else {})


def password_source(device: Device) -> str:
    if device.password_file is not None:
        return f"file {device.password_file}"
    return f"${device.password_env or password_variable(device.node)}"


def read_password(device: Device) -> str:
    """The node's MQTT password from its variable or file (never printed)."""
    if device.password_file is not None:
        try:
            password = device.password_file.read_text().rstrip("\r\n")
        except OSError as err:
            raise XronosError(
                f"cannot read password_file {str(device.password_file)!r}: {err.strerror or err}"
            ) from None
    else:
        variable = device.password_env or password_variable(device.node)
        password = os.environ.get(variable, "")
        if not password:
            raise XronosError(f"no MQTT password: set {variable} (or password_env / password_file in the inventory)")
    if not password:
        raise XronosError(f"the MQTT password in {password_source(device)} is empty")
    return password


# -- talking to a device's engine ------------------------------------------------------
def _reachable(device: Device) -> None:
    """Fail fast (CONNECT_SECONDS) on a device that is off or unrouted, before the SDK's longer timeouts."""
    parts = urlsplit(device.base_url)
    if parts.scheme == "unix":
        try:
            if not stat.S_ISSOCK(os.stat(parts.path).st_mode):
                raise XronosError(f"unreachable: {parts.path} is not a socket")
        except FileNotFoundError:
            raise XronosError(f"unreachable: no socket at {parts.path}") from None
        return
    port = parts.port or (22 if parts.scheme == "ssh" else 2376)
    try:
        with socket.create_connection((parts.hostname, port), timeout=CONNECT_SECONDS) as sock:
            # an SSH server speaks first; a port that accepts and stays silent (a firewall, a proxy) would
            # otherwise hold the ssh client, which the SDK starts without a connect timeout
            if parts.scheme == "ssh" and not sock.recv(64).startswith(b"SSH-"):
                raise XronosError(f"unreachable: {parts.hostname}:{port} does not answer as an SSH server")
    except OSError as err:
        raise XronosError(f"unreachable: {parts.hostname}:{port}: {err.strerror or err}") from None


def connect(device: Device):
    """A DockerClient for the device's engine (ssh:// through the system's ssh client and its config)."""
    import docker
    from docker.tls import TLSConfig

    _reachable(device)
    tls = False
    if device.tls is not None:
        tls = TLSConfig(
            client_cert=(str(device.tls.client_cert), str(device.tls.client_key)),
            ca_cert=str(device.tls.ca_cert),
            verify=True,
        )
    try:
        client = docker.DockerClient(
            base_url=device.base_url, tls=tls, use_ssh_client=device.scheme == "ssh", timeout=HANDSHAKE_SECONDS
        )
        client.ping()
        client.api.timeout = API_SECONDS  # pulls and stops may take longer than the handshake
    except docker.errors.DockerException as err:
        raise XronosError(f"unreachable: {_one_line(err)}") from None
    return client


def _one_line(err: Exception) -> str:
    text = getattr(err, "explanation", None) or str(err)
    return " ".join(str(text).split())[:300]


def _find(client, device: Device):
    import docker

    try:
        return client.containers.get(container_name(device))
    except docker.errors.NotFound:
        return None


def _ensure_image(client, inventory: Inventory):
    import docker

    try:
        image = client.images.get(inventory.image)
        if inventory.pull != "always":
            return image
    except docker.errors.ImageNotFound:
        if inventory.pull == "never":
            raise XronosError(
                f"image {inventory.image} is not on the device (pull: never): load it there first, "
                f"e.g. docker save {inventory.image} | ssh DEVICE docker load"
            ) from None
    return client.images.pull(inventory.image)


def read_tls_files(inventory: Inventory, device: Device) -> dict[str, bytes]:
    """The CA, certificate and key a node container gets (mqtts://), read before anything changes."""
    out = {}
    for name, path in inventory.tls_files(device).items():
        try:
            out[name] = path.read_bytes()
        except OSError as err:
            raise XronosError(
                f"cannot read {str(path)!r} (make it with deploy/mosquitto/make-certs.sh): {err.strerror or err}"
            ) from None
    return out


def _secret_tar(password: str, user: str, extra: dict[str, bytes] | None = None) -> bytes:
    """A tar of the password file (and TLS files), owned by the image's user and readable by it alone."""
    uid, _, gid = user.partition(":")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in {SECRET_NAME: password.encode(), **(extra or {})}.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            if uid.isdigit():
                info.uid, info.gid, info.mode = int(uid), int(gid) if gid.isdigit() else int(uid), 0o400
            else:  # a user by name or root: the uid is unknown here, so the file is readable in the container
                info.mode = 0o444
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# -- the three actions, one device each --------------------------------------------------
def _on_engine(device: Device, work) -> Outcome:
    """Connect to the device's engine, run `work(client) -> (ok, detail)`; any failure becomes the device's line."""
    import docker

    try:
        client = connect(device)
        try:
            ok, detail = work(client)
        finally:
            client.close()
    except XronosError as err:
        return Outcome(device.name, False, str(err))
    except docker.errors.DockerException as err:
        return Outcome(device.name, False, _one_line(err))
    return Outcome(device.name, ok, detail)


def _stop(container) -> None:
    container.stop(timeout=15)  # the node publishes `offline` and stops its worker
    container.remove(force=True)


def deploy_device(inventory: Inventory, device: Device) -> Outcome:
    """Replace the device's node container with a fresh one from the inventory."""
    try:
        password = read_password(device)  # checked before anything on the device changes
        tls = read_tls_files(inventory, device)
    except XronosError as err:
        return Outcome(device.name, False, str(err))

    def work(client):
        image = _ensure_image(client, inventory)
        old = _find(client, device)
        if old is not None:
            _stop(old)
        restart = {"Name": device.restart} | ({"MaximumRetryCount": device.max_retries} if device.max_retries else {})
        container = client.containers.create(
            inventory.image,
            command=node_command(device),
            name=container_name(device),
            environment=node_environment(inventory, device),
            network_mode="host",
            init=True,
            nano_cpus=int(device.cpus * 1e9) if device.cpus else None,
            mem_limit=device.memory,
            restart_policy=restart,
            volumes=list(inventory.mounts),
            labels={LABELS["role"]: "node", LABELS["node"]: device.node, LABELS["device"]: device.name},
        )
        if not container.put_archive(SECRET_DIR, _secret_tar(password, image.attrs["Config"].get("User") or "", tls)):
            raise XronosError(f"could not write the password and TLS files into {SECRET_DIR}")
        container.start()
        container.reload()
        if container.status != "running":
            raise XronosError(f"the container {container.status} at once: {_last_log_line(container)}")
        limits = (
            ", ".join(
                x for x in (device.cpus and f"cpus {device.cpus:g}", device.memory and f"memory {device.memory}") if x
            )
            or "no limits"
        )
        return True, f"running {container.name} ({container.short_id}), {limits}"

    return _on_engine(device, work)


def _last_log_line(container) -> str:
    lines = container.logs(tail=5).decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


def status_device(inventory: Inventory, device: Device) -> Outcome:
    def work(client):
        container = _find(client, device)
        if container is None:
            return False, "no node container"
        health = (container.attrs["State"].get("Health") or {}).get("Status", "no healthcheck")
        host = container.attrs["HostConfig"]
        return container.status == "running", (
            f"{container.name} {container.status} ({health}), image {container.attrs['Config']['Image']}, "
            f"cpus {(host.get('NanoCpus') or 0) / 1e9:g}, memory {(host.get('Memory') or 0) // 2**20} MiB, "
            f"restarts {container.attrs.get('RestartCount', 0)}"
        )

    return _on_engine(device, work)


def remove_device(inventory: Inventory, device: Device) -> Outcome:
    def work(client):
        container = _find(client, device)
        if container is None:
            return True, "no node container (nothing to remove)"
        _stop(container)
        return True, f"removed {container.name}"

    return _on_engine(device, work)


# -- the whole inventory ---------------------------------------------------------------
def for_each(inventory: Inventory, action) -> list[Outcome]:
    """`action` on every device at once (a slow or dead device does not hold up the rest), in inventory order."""
    with ThreadPoolExecutor(max_workers=min(8, len(inventory.devices))) as pool:
        return list(pool.map(lambda d: action(inventory, d), inventory.devices))


def targets(devices: list[Device]) -> list[dict]:
    """Prometheus file_sd entries: each node's metrics endpoint, labelled by role and device."""
    return [{"targets": [f"{d.host}:{d.metrics_port}"], "labels": {"role": "node", "device": d.name}} for d in devices]


def write_targets(path: Path, devices: list[Device]) -> None:
    """Written whole and renamed into place: Prometheus never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(targets(devices), indent=2) + "\n")


def describe(inventory: Inventory, device: Device) -> list[str]:
    """What `up` would do on one device (the dry run), with where the password comes from, never what it is."""
    try:
        read_password(device)
        found = "set"
    except XronosError:
        found = "MISSING"
    env = node_environment(inventory, device)
    limits = [
        f"cpus {device.cpus:g}" if device.cpus else "all cpus",
        f"memory {device.memory or 'unlimited'}",
        f"restart {device.restart}" + (f" (max {device.max_retries})" if device.max_retries else ""),
        "network host" + (f" (collectives on {device.gloo_interface})" if device.gloo_interface else ""),
    ]
    return [
        f"{device.name}  {device.base_url}",
        f"  container {container_name(device)}  image {inventory.image} (pull: {inventory.pull})",
        f"  command   xronos {' '.join(node_command(device))}",
        f"  limits    {', '.join(limits)}",
        f"  mounts    {', '.join(inventory.mounts)}",
        f"  broker    {env['XRONOS_BROKER']} as {env['XRONOS_USERNAME']}; password from {password_source(device)} "
        f"({found}) into {env['XRONOS_PASSWORD_FILE']}",
        *(
            [f"  tls       CA, certificate and key from {inventory.mqtt_certs} into {SECRET_DIR}"]
            if inventory.mqtt_certs
            else []
        ),
        f"  metrics   {device.host}:{device.metrics_port}",
    ]


def _targets_path(given: str | None) -> Path | None:
    """--targets, else the repository's file_sd folder when run from the repository root (else none)."""
    if given:
        return Path(given)
    return DEFAULT_TARGETS if DEFAULT_TARGETS.parent.is_dir() else None


def run_deploy(action: str, inventory_file: str, dry_run: bool = False, targets_file: str | None = None) -> int:
    inventory = load_inventory(inventory_file)
    path = _targets_path(targets_file)
    if dry_run:
        print("dry run: nothing is changed")
        if action == "up":
            for device in inventory.devices:
                print("\n".join(describe(inventory, device)))
        else:
            for device in inventory.devices:
                print(
                    f"{device.name}  {device.base_url}: would {action} {container_name(device)}"
                    if action == "remove"
                    else f"{device.name}  {device.base_url}: would show {container_name(device)}"
                )
        if path is not None and action != "status":
            kept = inventory.devices if action == "up" else []
            print(f"targets: would write {len(kept)} Prometheus target(s) to {path}")
        return 0
    action_of = {"up": deploy_device, "status": status_device, "remove": remove_device}[action]
    outcomes = for_each(inventory, action_of)
    width = max(len(d.name) for d in inventory.devices)
    for outcome in outcomes:
        print(f"{outcome.device:<{width}}  {'ok    ' if outcome.ok else 'FAILED'}  {outcome.detail}")
    if path is not None and action != "status":
        # up: every device of the inventory (one that failed shows as down in Prometheus, as it should);
        # remove: the devices whose container could not be removed are still there
        failed = {o.device for o in outcomes if not o.ok}
        kept = inventory.devices if action == "up" else [d for d in inventory.devices if d.name in failed]
        write_targets(path, kept)
        print(f"targets: {len(kept)} Prometheus target(s) in {path}")
    bad = [o for o in outcomes if not o.ok]
    if bad:
        verb = {"up": "deployed", "status": "running", "remove": "removed"}[action]
        raise XronosError(
            f"{len(bad)} of {len(outcomes)} devices not {verb}: " + "; ".join(f"{o.device} ({o.detail})" for o in bad)
        )
    return 0
