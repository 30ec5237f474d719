"""A real Docker engine for tests, and a tiny image to deploy on it.

The engine is the one DOCKER_HOST (or /var/run/docker.sock) reaches when that is
a unix socket; else, as root with Debian's docker.io installed, a dockerd of
the test's own (`--iptables=false --bridge=none`, its data in a temporary
directory), stopped at the end. Anything else fails with what to do.

The image is not the Xronos image (building that takes minutes; deploy/smoke.sh
does it): it is the base that deploy/make-base-image.sh makes and caches (an
import of the cached root filesystem, seconds) with the Xronos image's user,
its /run/secrets and /models /data /checkpoints, and an entrypoint that takes
the node's command and sleeps. What `xronos deploy` does to it is what it does
to the real image: the tests check the containers, not the node in them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from edge_node.worker_process import stop_processes

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XRONOS_CACHE", "/var/cache/xronos-smoke"))
BASE = "xronos-test/base:bookworm"
IMAGE = "xronos-test/node:tiny"
TINY_DOCKERFILE = f"""FROM {BASE}
RUN groupadd --system --gid 10001 xronos \\
 && useradd --system --no-log-init --create-home --uid 10001 --gid 10001 xronos \\
 && mkdir -p /models /data /checkpoints /run/secrets
USER 10001:10001
ENTRYPOINT ["/bin/sh", "-c", "exec sleep infinity", "xronos"]
"""


class Engine:
    """`url` (unix://...) and a docker SDK `client`; `close()` stops a dockerd it started."""

    def __init__(self):
        import docker

        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None
        given = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        if given.startswith("unix://") and self._answers(given):
            self.url = given
        else:
            self.url = self._start()
        self.client = docker.DockerClient(base_url=self.url, timeout=120)

    @staticmethod
    def _answers(url: str) -> bool:
        import docker

        try:
            docker.DockerClient(base_url=url, timeout=5).ping()
            return True
        except docker.errors.DockerException:
            return False

    def _start(self) -> str:
        if os.geteuid() != 0 or shutil.which("dockerd") is None:
            raise RuntimeError(
                "no Docker engine answers on a unix socket (DOCKER_HOST or /var/run/docker.sock), and "
                "this test can start one only as root with dockerd installed "
                "(apt-get install --no-install-recommends docker.io)"
            )
        self.dir = Path(tempfile.mkdtemp(prefix="xronos-test-engine-"))
        url = f"unix://{self.dir}/docker.sock"
        for driver in ("overlay2", "vfs"):
            log = (self.dir / f"dockerd-{driver}.log").open("wb")
            self.proc = subprocess.Popen(
                [
                    "dockerd",
                    "--storage-driver",
                    driver,
                    "--iptables=false",
                    "--bridge=none",
                    "--data-root",
                    str(self.dir / f"data-{driver}"),
                    "--exec-root",
                    str(self.dir / "exec"),
                    "--pidfile",
                    str(self.dir / "dockerd.pid"),
                    "-H",
                    url,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._answers(url):
                    return url
                time.sleep(0.3)
            self._stop()
        raise RuntimeError(f"dockerd did not start: {(self.dir / 'dockerd-vfs.log').read_text()[-500:]}")

    def _stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], grace=30)
        self.proc = None

    def tiny_image(self) -> str:
        """IMAGE, made from the cached base (deploy/make-base-image.sh makes the cache the first time)."""
        import docker

        try:
            self.client.images.get(IMAGE)
            return IMAGE
        except docker.errors.ImageNotFound:
            pass
        env = {**os.environ, "DOCKER_HOST": self.url, "XRONOS_CACHE": str(CACHE)}
        done = subprocess.run(
            [str(REPO / "deploy" / "make-base-image.sh"), BASE], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"could not make the base image: {done.stderr.strip()[-500:]}")
        with tempfile.TemporaryDirectory() as context:
            (Path(context) / "Dockerfile").write_text(TINY_DOCKERFILE)
            self.client.images.build(path=context, tag=IMAGE, rm=True)
        return IMAGE

    def close(self) -> None:
        self.client.close()
        if self.dir is None:
            return
        self._stop()
        # dockerd leaves its network namespace mounted in its exec root
        for line in reversed(Path("/proc/mounts").read_text().splitlines()):
            target = line.split()[1]
            if target.startswith(f"{self.dir}/"):
                subprocess.run(["umount", target], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
