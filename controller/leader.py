"""One live controller per broker: a starting controller asks the broker whether another is live.

The live controller beats a retained `online` on `xronos/controller/status` every
CONTROLLER_BEAT seconds (with a last will `offline`); a starting one probes for it
under a client id of its own before it connects under the controller's, and
refuses to start beside it (`refusal`). Refusing rather than standing by: a
standby that took over when the live one's will fired would also take over when
a broker restart fires it, and on the shipped 8883 listener (client id = username)
the two would then throw each other off.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from xronos.contract import wire
from xronos.contract.mqtt import SECURE_SCHEMES, BrokerSettings, Bus, check_broker_url

log = logging.getLogger("xronos.controller")

CONTROLLER_BEAT = 2.0
"""Seconds between the live controller's `online` statuses (retained): a starting one tells it from a stale one."""
PROBE_SECONDS = 2 * CONTROLLER_BEAT + 1.0
"""How long a starting controller that finds a retained `online` waits for a fresh one before calling it stale."""
PROBE_CONNECT_SECONDS = 10.0
"""How long a starting controller's probe waits for the broker."""
DEVICE_PORT, OPERATOR_PORT = 8883, 8884
"""The shipped Mosquitto's listeners: client ids bound to usernames on the first, free on the second."""


def probe_url(broker: str) -> str:
    """Where a starting controller looks for a live one: on TLS, the shipped operator listener (8884) of the
    same host, since on 8883 the broker binds the client id to the username and any connection as
    `controller` would take over the live controller's session; elsewhere the broker URL itself."""
    scheme, host, _ = check_broker_url(broker)
    return f"{scheme}://{host}:{OPERATOR_PORT}" if scheme in SECURE_SCHEMES else broker


def live_controller(settings: BrokerSettings, url: str, wait: float) -> wire.ControllerStatus | None:
    """The controller live on the broker, if any: asked at `url` under a client id of its own, before this
    process connects under the controller's. Live means its retained `online` is followed by a fresh one
    within PROBE_SECONDS (a live controller says it every CONTROLLER_BEAT): a retained `online` with nothing
    after it is stale (its holder died where no will could be published, say while the broker was down)."""
    seen: list[wire.ControllerStatus | None] = []
    arrived = threading.Condition()

    def on_status(_: str, msg: wire.ControllerStatus | None) -> None:
        with arrived:
            seen.append(msg)
            arrived.notify_all()

    probe = Bus(settings.model_copy(update={"broker": url}), client_id=f"xronos-controller-probe-{uuid.uuid4().hex}")
    probe.subscribe(wire.CONTROLLER_STATUS, on_status)
    probe.start(wait=wait)
    try:
        deadline = time.monotonic() + PROBE_SECONDS
        with arrived:
            arrived.wait_for(lambda: seen, timeout=1.0)  # the retained status comes right after subscribing
            while True:
                latest = seen[-1] if seen else None
                if latest is None or latest.state == "offline":
                    return None
                if len({m.ts for m in seen if m is not None and m.state == "online"}) >= 2:
                    return latest
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "a stale `online` of controller %s (pid %s on %s) is retained: taking over",
                        latest.instance,
                        latest.pid,
                        latest.host,
                    )
                    return None
                arrived.wait(left)
    finally:
        probe.stop()


def refusal(other: wire.ControllerStatus) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other.started))
    return (
        f"another controller is live on this broker (instance {other.instance}, pid {other.pid} on "
        f"{other.host}, up since {since}): not starting a second one; stop that one first "
        f"(a controller restarted after a crash starts once the broker has published the old one's last will)"
    )
