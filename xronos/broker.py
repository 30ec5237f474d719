"""`xronos broker`: an embedded MQTT broker for one machine with nothing installed (amqtt).

Production uses Mosquitto (`deploy/mosquitto/`). amqtt speaks MQTT 3.1.1 only
(so every Xronos client does) and binds 0.0.0.0 by default, so this binds
loopback unless told otherwise. With a username (`--username` or
`XRONOS_USERNAME`) and a password (`XRONOS_PASSWORD` or `--password-file` /
`XRONOS_PASSWORD_FILE`: never a flag, which `ps` would show), clients must
present them; the credentials stay in memory and are never logged. No TLS:
it is for one machine's loopback. It has no topic ACLs: on a shared network, use
Mosquitto with the deploy/ ACLs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from dataclasses import dataclass, field

from amqtt.plugins.base import BaseAuthPlugin

from xronos.contract.errors import XronosError


class CredentialAuthPlugin(BaseAuthPlugin):
    """Accept exactly the configured users, each with its password (compared in constant time)."""

    @dataclass
    class Config:
        users: dict[str, str] = field(default_factory=dict)

    async def authenticate(self, *, session) -> bool:
        expected = self.config.users.get(session.username or "")
        return expected is not None and hmac.compare_digest(expected.encode(), (session.password or "").encode())


def broker_config(host: str, port: int, users: dict[str, str] | None) -> dict:
    auth = (
        {"xronos.broker.CredentialAuthPlugin": {"users": users}}
        if users
        else {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
    )
    return {"listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}}, "plugins": auth}


def _not_a_probe(record: logging.LogRecord) -> bool:
    """Drop amqtt's warning for a connection that closed before sending a packet: that is how
    every Xronos command-line client checks first that something listens (`Bus.start`)."""
    return "No data to decode MQTT packet" not in record.getMessage()


class EmbeddedBroker:
    """amqtt on its own event loop in a background thread; `start()` returns once it listens."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1883, users: dict[str, str] | None = None):
        self.host, self.port, self.users = host, port, users
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="xronos-broker")
        self._broker = None

    def start(self) -> EmbeddedBroker:
        from amqtt.broker import Broker

        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.WARNING)
        if _not_a_probe not in logging.getLogger("amqtt.broker").filters:
            logging.getLogger("amqtt.broker").addFilter(_not_a_probe)
        self._thread.start()

        async def start():
            broker = Broker(broker_config(self.host, self.port, self.users), loop=self._loop)
            self._broker = broker
            await broker.start()

        try:
            asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=30)
        except Exception as err:
            self.stop()
            raise XronosError(f"cannot start the embedded broker on {self.host}:{self.port}: {err}") from None
        return self

    def stop(self) -> None:
        if self._broker is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(timeout=10)
            except Exception:  # shutting down anyway
                pass
            self._broker = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
