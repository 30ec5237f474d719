"""The Prometheus endpoint every long-running Xronos process serves on `--metrics-port`.

Each process keeps its metrics in its own registry (not the global default),
so tests can run a controller and node agents in one process. Every registry
carries what any Prometheus user expects of an exporter: `xronos_build_info`
(which version runs where) and the process collector (`process_resident_memory_bytes`,
`process_cpu_seconds_total`, ...) of the serving process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Info, ProcessCollector, start_http_server

from xronos import __version__


class MetricsEndpoint:
    def __init__(self):
        self.registry = CollectorRegistry()
        Info("xronos_build", "The running Xronos version.", registry=self.registry).info({"version": __version__})
        ProcessCollector(registry=self.registry)
        self._server = None
        self.port: int | None = None

    def serve(self, port: int, address: str = "0.0.0.0") -> int:
        """Serve on `port` (0: any free one); returns the port, also kept in `self.port`."""
        self._server, _ = start_http_server(port, addr=address, registry=self.registry)
        self.port = self._server.server_port
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
