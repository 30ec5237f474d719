"""The device inventory of `xronos deploy`: which devices run a node container, and how.

A YAML file, checked by strict pydantic models (a misspelt key is an error,
not a silently ignored default):

    image: xronos:latest               # on every device (see `pull`)
    broker: mqtts://192.168.1.10:8883  # as the devices reach it (TLS: the shipped Mosquitto's devices port)
    mqtt_certs: certs/                 # with mqtts://: what make-certs.sh made (ca.crt, NODE_ID.crt/.key)
    devices:
      - name: gw-kitchen
        base_url: ssh://pi@192.168.1.21          # the device's Docker Engine API
        cpus: 2
        memory: 1g
      - name: hub-living
        base_url: tcp://192.168.1.22:2376        # TLS required on tcp://
        tls: {ca_cert: certs/ca.pem, client_cert: certs/cert.pem, client_key: certs/key.pem}
        cpus: 1.5
        memory: 768m
        restart: on-failure

No secret sits in the inventory. A node's MQTT password comes from an
environment variable of the machine running `xronos deploy` (`password_env`,
by default XRONOS_PASSWORD_<NODE_ID>, the name make-passwords.sh reads) or
from a file (`password_file`), and reaches the container as a file
(XRONOS_PASSWORD_FILE), never as a flag, an environment value or a log line;
with `mqtts://`, the CA and the node's certificate and key from `mqtt_certs`
reach it the same way. Relative paths are taken against the inventory file's
directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    ValidationError,
    model_validator,
)

from xronos.contract.errors import XronosError
from xronos.contract.mqtt import SECURE_SCHEMES, check_broker_url
from xronos.contract.wire import Id

Memory = Annotated[str, StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)?[bkmgBKMG]?$")]
"""Docker's memory notation: bytes, or a number with b, k, m or g (`768m`, `2g`)."""

Mount = Annotated[str, StringConstraints(pattern=r"^[^:]+:/[^:]*(:(ro|rw))?$")]
"""`SOURCE:/container/path[:ro|rw]`, SOURCE a named volume or an absolute path on the device."""

DEFAULT_MOUNTS = ["xronos-models:/models:ro", "xronos-data:/data:ro", "xronos-checkpoints:/checkpoints"]
"""The volumes compose.yaml names: paths in a train command are the nodes' paths, the same everywhere."""

ENGINE_SCHEMES = ("unix", "tcp", "ssh")


def password_variable(node_id: str) -> str:
    """XRONOS_PASSWORD_<ID>, upper case with '-' as '_': the name deploy/mosquitto/make-passwords.sh reads."""
    return "XRONOS_PASSWORD_" + node_id.upper().replace("-", "_")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Tls(_Strict):
    """Client certificate and CA of a `tcp://` engine (dockerd --tlsverify): the API is root on the device."""

    ca_cert: Path
    client_cert: Path
    client_key: Path


class Device(_Strict):
    name: Id = Field(description="What the device is called here (reports, target labels).")
    base_url: str = Field(
        description="Its Docker Engine API: ssh://user@host, tcp://host:2376 (with tls), or unix:///path/docker.sock."
    )
    node_id: Id | None = Field(None, description="The node's id and MQTT username (default: name).")
    cpus: PositiveFloat | None = Field(None, description="CPU limit in cores (docker --cpus); none: all.")
    memory: Memory | None = Field(None, description="Memory limit (docker --memory), e.g. 768m; none: all.")
    restart: Literal["no", "always", "unless-stopped", "on-failure"] = "unless-stopped"
    max_retries: PositiveInt | None = Field(None, description="With restart on-failure: give up after this many.")
    metrics_port: int = Field(9101, ge=1, le=65535, description="The node's --metrics-port (host network).")
    address: str | None = Field(
        None,
        description="How other devices and Prometheus reach this one (the node's "
        "--address); default: the host of base_url for the targets, "
        "and the address facing the broker for the collectives.",
    )
    threads: PositiveInt = Field(1, description="Torch threads of the node's training worker.")
    gloo_interface: str | None = Field(
        None,
        description="The network interface the collectives use (GLOO_SOCKET_IFNAME, "
        "e.g. eth0): needed where the host name resolves to a "
        "loopback address, as Debian's 127.0.1.1 does.",
    )
    username: str | None = Field(None, description="MQTT username (default: the node id, as the ACLs expect).")
    password_env: str | None = Field(
        None, description="Environment variable holding the MQTT password (default XRONOS_PASSWORD_<NODE_ID>)."
    )
    password_file: Path | None = Field(None, description="Or a file holding it.")
    tls: Tls | None = None

    @property
    def node(self) -> str:
        return self.node_id or self.name

    @property
    def scheme(self) -> str:
        return urlsplit(self.base_url).scheme

    @property
    def host(self) -> str:
        """Where Prometheus scrapes this device: `address`, else base_url's host (a local socket: 127.0.0.1)."""
        if self.address:
            return self.address
        return urlsplit(self.base_url).hostname or "127.0.0.1"

    @model_validator(mode="after")
    def _consistent(self) -> Device:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ENGINE_SCHEMES:
            raise ValueError(f"base_url {self.base_url!r}: use ssh://user@host, tcp://host:2376 or unix:///path")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError(f"base_url {self.base_url!r}: a unix socket needs its path (unix:///run/docker.sock)")
        if parts.scheme in ("tcp", "ssh") and not parts.hostname:
            raise ValueError(f"base_url {self.base_url!r} names no host")
        if parts.scheme == "tcp" and self.tls is None:
            raise ValueError(
                "a tcp:// engine needs tls (ca_cert, client_cert, client_key): without it anyone who "
                "reaches the port is root on the device; or use ssh://"
            )
        if parts.scheme != "tcp" and self.tls is not None:
            raise ValueError("tls is for tcp:// engines only (ssh:// and unix sockets are secured by their transport)")
        if self.password_env is not None and self.password_file is not None:
            raise ValueError("give password_env or password_file, not both")
        if self.max_retries is not None and self.restart != "on-failure":
            raise ValueError("max_retries goes with restart: on-failure")
        return self


class Inventory(_Strict):
    image: str = Field("xronos:latest", description="The node image on every device.")
    pull: Literal["missing", "always", "never"] = Field(
        "missing",
        description="Pull the image on a device: when it is missing there, always, or never "
        "(no registry: load it first, deploy/README.md).",
    )
    broker: str = Field(description="mqtts://host:8883 (or mqtt://host:port) as the devices reach the broker.")
    mqtt_certs: Path | None = Field(
        None,
        description="With mqtts://: the folder make-certs.sh wrote: ca.crt and, per node, NODE_ID.crt and NODE_ID.key.",
    )
    mounts: list[Mount] = Field(
        default_factory=lambda: list(DEFAULT_MOUNTS),
        description="Volumes of every node container (models and data where train "
        "commands name them, checkpoints for the output).",
    )
    devices: list[Device] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Inventory:
        try:
            scheme, _, _ = check_broker_url(self.broker)
        except XronosError as err:
            raise ValueError(str(err)) from None
        if scheme in SECURE_SCHEMES and self.mqtt_certs is None:
            raise ValueError("an mqtts:// broker needs mqtt_certs (the folder deploy/mosquitto/make-certs.sh wrote)")
        if scheme not in SECURE_SCHEMES and self.mqtt_certs is not None:
            raise ValueError("mqtt_certs goes with an mqtts:// broker")
        for what, key in (("name", lambda d: d.name), ("node id", lambda d: d.node)):
            seen: set[str] = set()
            for d in self.devices:
                if key(d) in seen:
                    raise ValueError(f"two devices have the {what} {key(d)!r}")
                seen.add(key(d))
        ports: set[tuple[str, int]] = set()
        for d in self.devices:  # host networking: two nodes on one engine need two metrics ports
            if (d.base_url, d.metrics_port) in ports:
                raise ValueError(f"device {d.name!r}: another device on {d.base_url} has metrics_port {d.metrics_port}")
            ports.add((d.base_url, d.metrics_port))
        return self

    def resolved(self, base: Path) -> Inventory:
        """Relative certificate and password file paths taken against `base` (the inventory's directory)."""

        def at(path: Path | None) -> Path | None:
            return None if path is None else (path if path.is_absolute() else base / path)

        devices = []
        for d in self.devices:
            tls = d.tls and d.tls.model_copy(update={k: at(getattr(d.tls, k)) for k in Tls.model_fields})
            devices.append(d.model_copy(update={"password_file": at(d.password_file), "tls": tls}))
        return self.model_copy(update={"devices": devices, "mqtt_certs": at(self.mqtt_certs)})

    def tls_files(self, device: Device) -> dict[str, Path]:
        """With mqtts://: the files a node container gets, by their name there (empty for mqtt://)."""
        if self.mqtt_certs is None:
            return {}
        return {
            "xronos-mqtt-ca.crt": self.mqtt_certs / "ca.crt",
            "xronos-mqtt-client.crt": self.mqtt_certs / f"{device.node}.crt",
            "xronos-mqtt-client.key": self.mqtt_certs / f"{device.node}.key",
        }


def _where(loc: tuple, raw) -> str:
    """('devices', 1, 'cpus') -> 'devices[1] (hub-living).cpus': the index and the device's name."""
    out, node = "", raw
    for part in loc:
        if isinstance(part, int):
            name = (
                node[part].get("name")
                if isinstance(node, list) and part < len(node) and isinstance(node[part], dict)
                else None
            )
            out += f"[{part}]" + (f" ({name})" if name else "")
        else:
            out += f".{part}" if out else str(part)
        node = node[part] if isinstance(node, (list, dict)) and (isinstance(part, int) or part in node) else None
    return out


def load_inventory(path: str | Path) -> Inventory:
    """Read and check an inventory; every problem is one XronosError line naming the file and the field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise XronosError(f"cannot read the inventory {str(path)!r}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise XronosError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(raw, dict):
        raise XronosError(f"{path}: expected a mapping with broker and devices, got {type(raw).__name__}")
    try:
        inventory = Inventory.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = _where(first["loc"], raw)
        message = first["msg"].removeprefix("Value error, ")
        raise XronosError(f"{path}: {where + ': ' if where else ''}{message}") from None
    return inventory.resolved(path.resolve().parent)
