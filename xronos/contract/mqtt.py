"""One MQTT client for every Xronos process, bound to the wire contract (`xronos.contract.wire`).

paho-mqtt 2.x with callback API version 2, speaking MQTT 3.1.1 (the embedded
amqtt broker speaks nothing newer; Mosquitto speaks it too), over TLS for
`mqtts://` URLs (CA, client certificate and key from `BrokerSettings`). `Bus` publishes
and receives typed messages only: every payload passes `Topic.decode`, and a
message that breaks the contract (malformed, wrong schema or version, too
large, an id in the payload that is not the topic's) is logged, counted in
`Bus.invalid` and dropped. A handler that raises is logged and counted too;
neither ever stops the network thread. paho reconnects by itself, and every
(re)connect re-subscribes and re-runs the caller's `on_connect` (births).

A broker outage loses nothing at QoS 1: what a client publishes while it is
disconnected waits in paho's queue (`OUT_QUEUE` messages) and goes out after
the reconnect, and every subscription is QoS 1. A client with
`clean_session=False` (the controller) keeps its session on the broker under a
fixed client id: what is published to its subscriptions while it is away (a
train command) waits in the broker's queue for it (`max_queued_messages` in
deploy/mosquitto/mosquitto.conf) and arrives when it connects again.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

import paho.mqtt.client as paho
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from xronos.contract import wire
from xronos.contract.errors import XronosError

log = logging.getLogger("xronos.mqtt")


SECURE_SCHEMES = ("mqtts", "ssl")
PLAIN_SCHEMES = ("mqtt", "tcp")


class BrokerSettings(BaseSettings):
    """Where the broker is and who we are to it: flags win over `XRONOS_*` environment variables.

    The password never comes from the command line (it would show in `ps` and shell
    history): `XRONOS_PASSWORD`, or a file (`--password-file` / `XRONOS_PASSWORD_FILE`).
    """

    model_config = SettingsConfigDict(env_prefix="XRONOS_", extra="ignore")

    broker: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    """A file holding the password (`XRONOS_PASSWORD_FILE`), read when no password is given: a
    container's secret file (`xronos deploy` writes one) stays out of `docker inspect` and `ps`."""
    ca_file: Path | None = None
    """With `mqtts://`: the CA that signed the broker's certificate (default: the system's CAs)."""
    cert_file: Path | None = None
    """With `mqtts://`: this client's certificate (the shipped Mosquitto config requires one)."""
    key_file: Path | None = None
    """With `mqtts://`: the private key of `cert_file` (a path: the key itself is never in argv)."""


def redact(url: str) -> str:
    """`url` with any password in it replaced by `***`, fit for error messages and logs."""
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    try:
        secret = parts.password
    except ValueError:
        secret = None
    if secret is None and "@" not in parts.netloc:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return url.replace(parts.netloc, f"{user}:***@{host}" if secret is not None else f"{user}@{host}", 1)


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    username: str | None
    password: str | None = field(default=None, repr=False)
    tls: ssl.SSLContext | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def check_broker_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of `mqtt[s]://host[:port]` (a bare `host[:port]` is mqtt); errors never echo a secret.

    A password inside the URL is refused: URLs end up in argv, logs and error text.
    """
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    shown = redact(url)
    if parts.scheme not in SECURE_SCHEMES + PLAIN_SCHEMES or not parts.hostname:
        raise XronosError(f"bad broker URL {shown!r}: use mqtts://host:8883 (TLS) or mqtt://host:1883")
    if "@" in parts.netloc:
        raise XronosError(
            f"bad broker URL {shown!r}: credentials do not go in the URL; use --username and "
            "XRONOS_PASSWORD or --password-file"
        )
    try:
        port = parts.port or (8883 if parts.scheme in SECURE_SCHEMES else 1883)
    except ValueError:
        raise XronosError(f"bad broker URL {shown!r}: the port is not a number") from None
    return parts.scheme, parts.hostname, port


def _readable(path: Path, what: str) -> Path:
    if not path.is_file():
        raise XronosError(f"the {what} {str(path)!r} does not exist or is not a file")
    try:
        path.open("rb").close()
    except OSError as err:
        raise XronosError(f"cannot read the {what} {str(path)!r}: {err.strerror or err}") from None
    return path


def tls_context(settings: BrokerSettings) -> ssl.SSLContext:
    """A client context that verifies the broker (its CA, its host name) and presents our certificate."""
    if (settings.cert_file is None) != (settings.key_file is None):
        raise XronosError("give both a client certificate and its key (--cert-file and --key-file), or neither")
    ca = settings.ca_file and _readable(settings.ca_file, "CA file")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca) if ca else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.cert_file is not None and settings.key_file is not None:
        cert, key = _readable(settings.cert_file, "certificate file"), _readable(settings.key_file, "key file")
        try:
            context.load_cert_chain(str(cert), str(key))
        except ssl.SSLError as err:
            raise XronosError(f"the certificate {str(cert)!r} and key {str(key)!r} do not load: {err.reason}") from None
    return context


def broker_address(settings: BrokerSettings) -> BrokerAddress:
    """Parse the broker URL, read the password (environment or file) and build the TLS context for mqtts://."""
    scheme, host, port = check_broker_url(settings.broker)
    tls = tls_context(settings) if scheme in SECURE_SCHEMES else None
    if tls is None and (settings.ca_file or settings.cert_file or settings.key_file):
        raise XronosError(
            f"a CA, certificate or key file was given but the broker URL {redact(settings.broker)!r} is not "
            "mqtts://: use mqtts://host:8883"
        )
    return BrokerAddress(host, port, settings.username, read_password(settings), tls)


def read_password(settings: BrokerSettings) -> str | None:
    """`XRONOS_PASSWORD`, else the password file's first line (errors name the file, never its content)."""
    if settings.password is not None:
        return settings.password.get_secret_value()
    if settings.password_file is None:
        return None
    try:
        return settings.password_file.read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as err:
        why = getattr(err, "strerror", None) or ("not text" if isinstance(err, UnicodeDecodeError) else err)
        raise XronosError(f"cannot read the password file {str(settings.password_file)!r}: {why}") from None


OUT_QUEUE = 10_000
"""Messages paho keeps for the broker (in flight, or waiting for a connection); beyond it `publish` fails."""

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
        clean_session: bool = True,
    ):
        """`clean_session=False`: a persistent session under `client_id` (which must then be fixed, and be
        the only client with it): the broker queues this client's QoS 1 messages while it is away."""
        self.address = broker_address(settings)
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311, clean_session=clean_session
        )
        if self.address.username:
            self.client.username_pw_set(self.address.username, self.address.password)
        if self.address.tls is not None:
            self.client.tls_set_context(self.address.tls)
        if will is not None:
            topic, ident, message = will
            self.client.will_set(topic.name(ident), topic.encode(message), qos=topic.qos, retain=topic.retain)
        self.client.reconnect_delay_set(min_delay=1, max_delay=5)
        self.client.max_queued_messages_set(OUT_QUEUE)
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
                probe = socket.create_connection((self.address.host, self.address.port), timeout=wait)
            except OSError as err:
                raise XronosError(
                    f"cannot connect to the broker at {self.address.host}:{self.address.port}: {err.strerror or err}"
                ) from None
            self._check_tls(probe)
        self.client.connect_async(self.address.host, self.address.port, keepalive=10)
        self.client.loop_start()
        if wait is not None and not self.connected.wait(wait):
            self.stop()
            why = self.refused or (
                "no answer" if self.address.tls else "no answer (a TLS listener? use mqtts:// with --ca-file)"
            )
            raise XronosError(f"cannot connect to the broker at {self.address.host}:{self.address.port}: {why}")
        return self

    def _check_tls(self, sock: socket.socket) -> None:
        """Shake hands over `sock` (then close it) so that a TLS problem is one clear line, not a silent retry."""
        with sock:
            if self.address.tls is None:
                return
            where = f"{self.address.host}:{self.address.port}"
            try:
                with self.address.tls.wrap_socket(sock, server_hostname=self.address.host) as tls:
                    tls.settimeout(0.5)
                    try:  # a broker that refuses our certificate says so just after the handshake
                        closed = tls.recv(1) == b""
                    except TimeoutError:
                        closed = False
                    if closed:
                        raise XronosError(f"TLS to the broker at {where} failed: the broker closed the connection")
            except ssl.SSLCertVerificationError as err:
                raise XronosError(
                    f"TLS to the broker at {where} failed: certificate verify failed: {err.verify_message} "
                    "(is --ca-file the CA that signed the broker's certificate, for this host name?)"
                ) from None
            except ssl.SSLError as err:
                raise XronosError(f"TLS to the broker at {where} failed: {err.reason or err}") from None
            except OSError as err:
                if err.errno is None:  # ssl's own "EOF occurred": the broker hung up
                    raise XronosError(f"TLS to the broker at {where} failed: {err}") from None

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
        was = self.connected.is_set()
        self.connected.clear()
        if reason_code.value != 0 and was:  # a connection that never came up is reported by `start` or `refused`
            log.warning("lost the broker (%s); reconnecting", reason_code)

    # -- messages -------------------------------------------------------------------
    def subscribe(
        self, topic: wire.Topic[wire.M], handler: Callable[[str, wire.M | None], None], ident: str = "+"
    ) -> None:
        """Receive `topic`'s messages (all ids, or one) in `handler`; call before `start` or while connected."""
        self._subscriptions.append((topic, ident, cast(Handler, handler)))  # decode() gives it topic's model
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
