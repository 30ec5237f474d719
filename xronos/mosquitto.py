"""A local Mosquitto (Debian's package) with the deploy/ ACLs, for tests and benchmarks.

Two ways. Plain (`Mosquitto(users=...)`): a config of its own that listens on a
loopback port, a password file, and the ACL file of `deploy/mosquitto/acl`
verbatim. Shipped (`Mosquitto(users=..., certs=DIR)`): the production
`deploy/mosquitto/mosquitto.conf` and ACL verbatim with only paths and ports
substituted (TLS listeners for devices and operators, client ids bound to
usernames), DIR made by `deploy/mosquitto/make-certs.sh`. Passwords reach
`mosquitto_passwd` on its standard input, never its argv. Run as root,
Mosquitto drops to user `mosquitto`, so its files are handed to that user.

The plain config takes the shipped config's queue and persistence tuning
(TUNING) verbatim, so tests measure what ships; `persistence=True` keeps its
database in its directory. `stop(signal)` and `start()` take the broker down
(SIGTERM: a clean shutdown; SIGKILL: a crash) and bring it back on the same
ports with the same database, for the fault tests.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from edge_node.worker_process import free_port, stop_processes
from xronos.contract.errors import XronosError

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto"
ACL_FILE = DEPLOY / "acl"
CONF_FILE = DEPLOY / "mosquitto.conf"
DEVICE_PORT, OPERATOR_PORT = 8883, 8884
"""The shipped config's listeners: nodes and controller (client id := username), operators' tools."""
TUNING = ("max_queued_messages", "max_queued_bytes", "max_inflight_messages", "autosave_interval")
"""Settings the plain config copies from the shipped one."""


def shipped_tuning(conf: str) -> list[str]:
    """The shipped config's TUNING lines, as written."""
    return [line for line in conf.splitlines() if line.split(" ", 1)[0] in TUNING]


def add_password(passwd: Path, user: str, password: str) -> None:
    """Add `user` to a Mosquitto password file; the password goes through stdin, not the process list."""
    subprocess.run(
        ["mosquitto_passwd", str(passwd), user],
        input=f"{password}\n{password}\n",
        text=True,
        check=True,
        capture_output=True,
    )


def shipped_config(conf: str, *, directory: Path, ports: dict[int, int]) -> str:
    """The production config with its container paths moved under `directory` and its listeners'
    ports replaced (bound to loopback); fails if anything container-specific is left."""
    out = conf.replace("/mosquitto/config/", f"{directory}/").replace("/mosquitto/data/", f"{directory}/data/")
    for shipped, port in ports.items():
        out, n = re.subn(rf"^listener {shipped}$", f"listener {port} 127.0.0.1", out, flags=re.M)
        if n != 1:
            raise XronosError(f"the shipped mosquitto.conf has no single 'listener {shipped}' line")
    if "/mosquitto/" in out:
        raise XronosError("the shipped mosquitto.conf names a path this runner does not substitute")
    return out


class Mosquitto:
    """`with Mosquitto(users={...}) as m:` a broker at `m.url` (anonymous and ACL-free when `users` is None).

    Its files live in a fresh directory under the system temp dir (which user mosquitto
    can traverse, unlike a root-only test directory); removed on exit.
    """

    def __init__(
        self,
        users: dict[str, str] | None = None,
        acl: Path | None = ACL_FILE,
        certs: Path | None = None,
        persistence: bool = False,
    ):
        if shutil.which("mosquitto") is None:
            raise XronosError("mosquitto is not installed (apt-get install --no-install-recommends mosquitto)")
        if certs is not None and not users:
            raise XronosError("the shipped config needs users (it allows no anonymous client)")
        self.dir = Path(tempfile.mkdtemp(prefix="xronos-mosquitto-"))
        self.users, self.acl, self.certs = users, acl if users else None, certs
        self.port = free_port()
        self.operator_port = free_port() if certs else self.port
        scheme = "mqtts" if certs else "mqtt"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        """Nodes and the controller (with the shipped config: client id := username)."""
        self.operator_url = f"{scheme}://127.0.0.1:{self.operator_port}"
        """Operators' tools, several at once (the same as `url` without the shipped config)."""
        self.proc: subprocess.Popen | None = None
        self.persistence = persistence
        self.conf = self.dir / "mosquitto.conf"

    def __enter__(self) -> Mosquitto:
        self.dir.mkdir(parents=True, exist_ok=True)
        lines = [f"listener {self.port} 127.0.0.1", "log_dest stderr", *shipped_tuning(CONF_FILE.read_text())]
        if self.persistence:
            (self.dir / "data").mkdir(exist_ok=True)
            lines += ["persistence true", f"persistence_location {self.dir / 'data'}/"]
        else:
            lines.append("persistence false")
        if self.users:
            passwd = self.dir / "passwd"
            passwd.write_text("")
            passwd.chmod(0o600)
            for user, password in self.users.items():
                add_password(passwd, user, password)
            lines += ["allow_anonymous false", f"password_file {passwd}"]
            if self.acl is not None:
                shutil.copy(self.acl, self.dir / "acl")
                lines.append(f"acl_file {self.dir / 'acl'}")
        else:
            lines.append("allow_anonymous true")
        conf = self.conf
        if self.certs is not None:  # the production config, verbatim but for paths and ports
            (self.dir / "certs").mkdir()
            (self.dir / "data").mkdir()
            for name in ("ca.crt", "broker.crt", "broker.key"):
                shutil.copy(self.certs / name, self.dir / "certs" / name)
            ports = {DEVICE_PORT: self.port, OPERATOR_PORT: self.operator_port}
            conf.write_text(shipped_config(CONF_FILE.read_text(), directory=self.dir, ports=ports))
        else:
            conf.write_text("\n".join(lines) + "\n")
        if os.geteuid() == 0:  # mosquitto drops root to user mosquitto, which must read its files
            try:
                account = pwd.getpwnam("mosquitto")
                for path in [self.dir, *self.dir.rglob("*")]:
                    os.chown(path, account.pw_uid, account.pw_gid)
            except KeyError:
                pass
        self.log = (self.dir / "mosquitto.log").open("ab")
        return self.start()

    def start(self) -> Mosquitto:
        """Run the broker (again, after `stop`: the same ports, config and database); back once it listens."""
        self.proc = subprocess.Popen(["mosquitto", "-c", str(self.conf)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise XronosError(f"mosquitto exited: {(self.dir / 'mosquitto.log').read_text()[-500:]}")
            try:
                for port in {self.port, self.operator_port}:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise XronosError("mosquitto did not start listening within 10 s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Take the broker down with `sig` (SIGTERM: it saves its database and closes every connection;
        SIGKILL: a crash) and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_processes([self.proc])
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
