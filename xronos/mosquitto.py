"""A local Mosquitto (Debian's package) with the deploy/ ACLs, for tests and benchmarks.

Writes a config that listens on a loopback port, a password file made with
`mosquitto_passwd`, and the ACL file of `deploy/mosquitto/acl` verbatim, then
runs `mosquitto -c`. Run as root, Mosquitto drops to user `mosquitto`, so its
files are handed to that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from edge_node.worker_process import free_port, stop_processes
from xronos.contract.errors import XronosError

ACL_FILE = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto" / "acl"


class Mosquitto:
    """`with Mosquitto(users={...}) as m:` a broker at `m.url` (anonymous and ACL-free when `users` is None).

    Its files live in a fresh directory under the system temp dir (which user mosquitto
    can traverse, unlike a root-only test directory); removed on exit.
    """

    def __init__(self, users: dict[str, str] | None = None, acl: Path | None = ACL_FILE):
        if shutil.which("mosquitto") is None:
            raise XronosError("mosquitto is not installed (apt-get install --no-install-recommends mosquitto)")
        self.dir = Path(tempfile.mkdtemp(prefix="xronos-mosquitto-"))
        self.users, self.acl = users, acl if users else None
        self.port = free_port()
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Mosquitto:
        self.dir.mkdir(parents=True, exist_ok=True)
        lines = [
            f"listener {self.port} 127.0.0.1",
            "persistence false",
            "log_dest stderr",
            "max_queued_messages 100000",
        ]
        if self.users:
            passwd = self.dir / "passwd"
            passwd.write_text("")
            for user, password in self.users.items():
                subprocess.run(["mosquitto_passwd", "-b", str(passwd), user, password], check=True, capture_output=True)
            passwd.chmod(0o600)
            lines += ["allow_anonymous false", f"password_file {passwd}"]
            if self.acl is not None:
                shutil.copy(self.acl, self.dir / "acl")
                lines.append(f"acl_file {self.dir / 'acl'}")
        else:
            lines.append("allow_anonymous true")
        conf = self.dir / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        if os.geteuid() == 0:  # mosquitto drops root to user mosquitto, which must read its files
            try:
                user = pwd.getpwnam("mosquitto")
                for path in [self.dir, *self.dir.iterdir()]:
                    os.chown(path, user.pw_uid, user.pw_gid)
            except KeyError:
                pass
        self.log = (self.dir / "mosquitto.log").open("wb")
        self.proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise XronosError(f"mosquitto exited: {(self.dir / 'mosquitto.log').read_text()[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise XronosError("mosquitto did not start listening within 10 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_processes([self.proc])
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
