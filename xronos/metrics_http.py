"""The Prometheus endpoint every long-running Xronos process serves on `--metrics-port`.

Each process keeps its metrics in its own registry (not the global default),
so tests can run a controller and node agents in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._server = None

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        self._server, _ = start_http_server(port, addr=address, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
