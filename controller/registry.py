"""The node registry: what the controller knows of each node, and who is alive.

A node is known from its retained `online` status; it is alive while its
heartbeats keep coming (a node that vanished without its last will, say on a
network cut, is declared lost after `timeout` seconds of silence). Its last
will (`offline`) is not taken at its word: a broker shutting down publishes
every client's will, so `offline` starts a grace period of `timeout` seconds
(the node is not offered to new jobs meanwhile) that a heartbeat or a birth
cancels; a node still silent at its end is lost ("went offline"). While the
controller is itself cut off from the broker nobody is heard, so it expires
no one then, and `refresh` gives every node a full `timeout` from its
reconnect. Pure state and arithmetic on a clock passed in, so the rules are
testable without a broker.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from xronos.contract.profiles import DeviceProfile


@dataclass
class NodeRecord:
    node_id: str
    online: bool = False
    last_seen: float = 0.0
    """Monotonic time of the last status or heartbeat."""
    last_heartbeat_ts: float | None = None
    """The node's own clock in its last heartbeat."""
    state: str = "idle"
    job_id: str | None = None
    step: int | None = None
    loss: float | None = None
    profile: DeviceProfile | None = None
    """The start-up profile (reference shape)."""
    lost_reason: str | None = None
    said_offline: bool = False
    """Its `offline` status came and nothing since: lost when the grace (`last_seen` + timeout) ends."""


@dataclass
class Registry:
    timeout: float
    nodes: dict[str, NodeRecord] = field(default_factory=dict)

    def online(self, node_id: str, now: float) -> NodeRecord:
        node = self.nodes.setdefault(node_id, NodeRecord(node_id))
        node.online, node.last_seen, node.lost_reason, node.said_offline = True, now, None, False
        return node

    def heard(self, node_id: str, now: float) -> NodeRecord | None:
        """A heartbeat: the node is alive (back online if it was not); None for an unknown node."""
        node = self.nodes.get(node_id)
        if node is None:
            return None
        if not node.online:
            return self.online(node_id, now)
        node.last_seen, node.said_offline = now, False
        return node

    def said_offline(self, node_id: str, now: float) -> NodeRecord | None:
        """Its `offline` status (its will, or a clean stop): lost in `timeout` seconds unless heard from again."""
        node = self.nodes.get(node_id)
        if node is None or not node.online or node.said_offline:
            return None
        node.said_offline, node.last_seen = True, now
        return node

    def offline(self, node_id: str, reason: str) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        if node is not None and node.online:
            node.online, node.lost_reason, node.state, node.job_id = False, reason, "idle", None
            node.said_offline = False
            return node
        return None

    def refresh(self, now: float) -> None:
        """The controller (re)connected: nobody could be heard before, so every node gets a full timeout."""
        for node in self.nodes.values():
            if node.online:
                node.last_seen = now

    def alive(self, node_id: str) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        return node if node is not None and node.online else None

    def expire(self, now: float) -> list[NodeRecord]:
        """Nodes whose heartbeats stopped: marked offline and returned."""
        lost = [n for n in self.nodes.values() if n.online and now - n.last_seen > self.timeout]
        for node in lost:
            said = node.said_offline
            self.offline(node.node_id, "went offline" if said else f"no heartbeat for {self.timeout:g} s")
        return lost

    def forget_offline(self, limit: int, keep: AbstractSet[str] = frozenset()) -> list[str]:
        """Forget the offline nodes seen longest ago beyond `limit` (not those in `keep`); their ids.

        Births on an open broker can name any id: a registry that kept every node ever seen would grow
        without bound. A forgotten node that comes back is known again from its next birth.
        """
        offline = sorted(
            (n for n in self.nodes.values() if not n.online and n.node_id not in keep), key=lambda n: n.last_seen
        )
        gone = [n.node_id for n in offline[: max(0, len(offline) - limit)]]
        for node_id in gone:
            del self.nodes[node_id]
        return gone

    def available(self, busy: set[str]) -> list[str]:
        """Online nodes in none of this controller's jobs (a start-up profile in progress gives way to a job)."""
        return sorted(
            n.node_id for n in self.nodes.values() if n.online and not n.said_offline and n.node_id not in busy
        )

    @property
    def online_count(self) -> int:
        return sum(n.online for n in self.nodes.values())
