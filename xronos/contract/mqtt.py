"""One MQTT client for every Xronos process, bound to the wire contract (`xronos.contract.wire`).

paho-mqtt 2.x with callback API version 2, speaking MQTT 3.1.1 (the embedded
amqtt broker speaks nothing newer; Mosquitto speaks it too). `Bus` publishes
and receives typed messages only: every payload passes `Topic.decode`, and a
message that breaks the contract (malformed, wrong schema or version, too
large, an id in the payload that is not the topic's) is logged, counted in
`Bus.invalid` and dropped. A handler that raises is logged and counted too;
neither ever stops the network thread. paho reconnects by itself, and every
(re)connect re-subscribes and re-runs the caller's `on_connect` (births).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import paho.mqtt.client as paho
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from xronos.contract import wire
from xronos.contract.errors import XronosError

log = logging.getLogger("xronos.mqtt")


class BrokerSettings(BaseSettings):
    """Where the broker is and who we are to it: flags win over `XRONOS_*` environment variables."""

    model_config = SettingsConfigDict(env_prefix="XRONOS_", extra="ignore")

    broker: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    """A file holding the password (`XRONOS_PASSWORD_FILE`), read when no password is given: a
    container's secret file (`xronos deploy` writes one) stays out of `docker inspect` and `ps`."""


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    username: str | None
    password: str | None


def broker_address(settings: BrokerSettings) -> BrokerAddress:
    """Parse `mqtt://[user:password@]host[:port]` (a bare `host[:port]` works too)."""
    url = settings.broker if "://" in settings.broker else f"mqtt://{settings.broker}"
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "tcp") or not parts.hostname:
        raise XronosError(f"bad broker URL {settings.broker!r}: use mqtt://host:port")
    try:
        port = parts.port or 1883
    except ValueError:
        raise XronosError(f"bad broker URL {settings.broker!r}: the port is not a number") from None
    password = settings.password.get_secret_value() if settings.password else None
    if password is None and settings.password_file is not None:
        try:
            password = settings.password_file.read_text().rstrip("\r\n")
        except OSError as err:
            raise XronosError(
                f"cannot read the password file {str(settings.password_file)!r}: {err.strerror or err}"
            ) from None
    password = password if password is not None else parts.password
    return BrokerAddress(parts.hostname, port, settings.username or parts.username, password)


Handler = Callable[[str, "wire._Message | None"], None]
"""Called with the topic's id (node or job, '' for commands) and the message (None: a retained message was cleared)."""


class Bus:
    """A connected paho client that speaks only the wire contract's messages."""

    def __init__(
        self,
        settings: BrokerSettings,
        client_id: str,
        will: tuple[wire.Topic, str, object] | None = None,
        on_connect: Callable[[], None] | None = None,
        on_invalid: Callable[[str, str], None] | None = None,
    ):
        self.address = broker_address(settings)
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311, clean_session=True
        )
        if self.address.username:
            self.client.username_pw_set(self.address.username, self.address.password)
        if will is not None:
            topic, ident, message = will
            self.client.will_set(topic.name(ident), topic.encode(message), qos=topic.qos, retain=topic.retain)
        self.client.reconnect_delay_set(min_delay=1, max_delay=5)
        self.client.max_queued_messages_set(10_000)
        self.client.on_connect = self._connected
        self.client.on_disconnect = self._disconnected
        self.client.on_message = self._received
        self._subscriptions: list[tuple[wire.Topic, str, Handler]] = []
        self._user_on_connect = on_connect
        self._user_on_invalid = on_invalid
        self.connected = threading.Event()
        self.refused: str | None = None
        self.invalid: collections.Counter[str] = collections.Counter()
        """Dropped messages by topic family (and 'handler' for handlers that raised)."""

    # -- lifecycle ------------------------------------------------------------------
    def start(self, wait: float | None = 10.0) -> Bus:
        """Connect in the background; with `wait`, fail with a clear error if the broker does not answer in time.

        Without `wait` (long-running processes) a missing broker is retried until it comes.
        """
        if wait is not None:  # a command-line client: say at once that nothing listens there
            try:
                socket.create_connection((self.address.host, self.address.port), timeout=wait).close()
            except OSError as err:
                raise XronosError(
                    f"cannot connect to the broker at {self.address.host}:{self.address.port}: {err.strerror or err}"
                ) from None
        self.client.connect_async(self.address.host, self.address.port, keepalive=10)
        self.client.loop_start()
        if wait is not None and not self.connected.wait(wait):
            self.stop()
            why = self.refused or "no answer"
            raise XronosError(f"cannot connect to the broker at {self.address.host}:{self.address.port}: {why}")
        return self

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _connected(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self.refused = str(reason_code)
            log.warning("broker refused the connection: %s", reason_code)
            return
        for topic, ident, _ in self._subscriptions:
            client.subscribe(topic.subscription() if ident == "+" else topic.name(ident), qos=max(topic.qos, 1))
        if self._user_on_connect is not None:
            self._user_on_connect()
        self.connected.set()

    def _disconnected(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if reason_code.value != 0:
            log.warning("lost the broker (%s); reconnecting", reason_code)

    # -- messages -------------------------------------------------------------------
    def subscribe(self, topic: wire.Topic, handler: Handler, ident: str = "+") -> None:
        """Receive `topic`'s messages (all ids, or one) in `handler`; call before `start` or while connected."""
        self._subscriptions.append((topic, ident, handler))
        if self.connected.is_set():
            self.client.subscribe(topic.subscription() if ident == "+" else topic.name(ident), qos=max(topic.qos, 1))

    def publish(self, topic: wire.Topic, ident: str, message) -> paho.MQTTMessageInfo:
        """Publish `message` on the topic for `ident`; None clears a retained topic."""
        payload = b"" if message is None else topic.encode(message)
        return self.client.publish(topic.name(ident), payload, qos=topic.qos, retain=topic.retain)

    def drop(self, family: str, why: str) -> None:
        self.invalid[family] += 1
        log.warning("dropped a message on %s: %s", family, why)
        if self._user_on_invalid is not None:
            self._user_on_invalid(family, why)

    def _received(self, client, userdata, msg) -> None:
        for topic, ident, handler in self._subscriptions:
            found = topic.ident(msg.topic)
            if found is None or (ident != "+" and found != ident):
                continue
            family = topic.family
            try:
                message = None if not msg.payload else topic.decode(msg.payload)
                if found and not wire.valid_id(found):
                    raise wire.WireError(f"bad id in topic {msg.topic!r}")
                own = (
                    getattr(message, "node_id", None) if "nodes/" in topic.pattern else getattr(message, "job_id", None)
                )
                if message is not None and "{}" in topic.pattern and own != found:
                    raise wire.WireError(f"payload names {own!r} but was sent on {msg.topic!r}")
            except wire.WireError as err:
                self.drop(family, str(err))
                return
            try:
                handler(found, message)
            except Exception:  # a bug in one handler must not stop the network thread
                log.exception("handler for %s failed", msg.topic)
                self.invalid["handler"] += 1
            return
