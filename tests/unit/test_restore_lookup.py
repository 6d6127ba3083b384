"""A spare asks the likely holders of its sid's replicas, not every agent (issue 15): the
node that ran the sid before and its next ring successors in that world; every agent only
when none of those holds anything."""

from __future__ import annotations

import pytest

from hotspare.orchestrator.store import Node
from hotspare.orchestrator.store.records import Seat, World
from hotspare.recovery import restore as restore_mod
from hotspare.recovery.restore import PeerReplicas


def world(epoch: int, nodes: list[str]) -> World:
    return World(epoch=epoch, seats=tuple(Seat(node=n, incarnation="i", since=1, sid=r) for r, n in enumerate(nodes)))


class FakeJobStore:
    def __init__(self, worlds: dict[int, World], live: list[str]) -> None:
        self.worlds, self.live = worlds, live
        self.nodes_read: list[list[str]] = []
        self.full_reads = 0

    def epoch(self) -> int:
        return max(self.worlds)

    def world(self, epoch: int) -> World | None:
        return self.worlds.get(epoch)

    def secret(self) -> bytes:
        return b"s" * 32

    def nodes(self, names):
        names = list(names)
        self.nodes_read.append(names)
        return {n: Node(name=n, incarnation="i", role="active", slots=1, replica_port=1000 + i)
                for i, n in enumerate(names) if n in self.live}

    def snapshot(self, progress: bool = True):
        self.full_reads += 1
        return type("Snap", (), {"nodes": {n: Node(name=n, incarnation="i", role="active", slots=1, replica_port=1)
                                           for n in self.live}})()


def cluster(n: int) -> tuple[dict[int, World], list[str]]:
    names = [f"node{i}" for i in range(n)]
    before = world(4, names)
    after = world(5, [("spare0" if x == "node3" else x) for x in names])  # node3 lost, its sid 3 -> spare0
    return {4: before, 5: after}, [x for x in names if x != "node3"] + ["spare0"]


@pytest.mark.parametrize("n", [10, 1000, 10_000])
def test_the_spare_asks_the_lost_nodes_ring_successors_only(monkeypatch, n):
    """The same few agents asked and node records read whatever the number of nodes."""
    worlds, live = cluster(n)
    js = FakeJobStore(worlds, live)
    asked: list[str] = []

    def list_points(host, port, secret, sid):
        asked.append(port)
        return {40: 1, 50: 1} if port == 1001 else {}  # node4, the first successor, holds sid 3's points

    monkeypatch.setattr(restore_mod, "list_points", list_points)
    peers = PeerReplicas(js, sid=3, engine=None, replicas=1)
    assert peers.likely_holders() == ["node3", "node4", "node5", "node6", "node7"]
    assert peers.offer() == {40, 50}
    assert js.full_reads == 0 and len(asked) == 4  # node3 is gone; 4 of n agents asked
    assert sum(len(names) for names in js.nodes_read) <= 8  # node records read: O(replicas), not O(n)
    assert [h[0] for h in peers._holders[50]] == ["node4"]


def test_when_no_likely_holder_has_anything_every_agent_is_asked(monkeypatch):
    worlds, live = cluster(20)
    js = FakeJobStore(worlds, live)
    monkeypatch.setattr(restore_mod, "list_points", lambda host, port, secret, sid: {7: 1} if port == 1 else {})
    peers = PeerReplicas(js, sid=3, engine=None, replicas=1)
    assert peers.offer() == {7}
    assert js.full_reads == 1 and peers.asked == 4 + len(live)


def test_a_fresh_job_has_no_likely_holders():
    js = FakeJobStore({1: world(1, ["a", "b"])}, ["a", "b"])
    assert PeerReplicas(js, sid=0, engine=None).likely_holders() == []


def test_the_nodes_that_ran_the_sid_earlier_are_asked_too_newest_first():
    """sid 3 ran on node3, whose worker crashed (epoch 5: spare0 took the seat), then another
    node was lost (epoch 6). spare0 replicated no point of sid 3 yet: its older points are on
    node3 (the crashed worker's slots) and node3's successors, so they are asked as well."""
    names = [f"node{i}" for i in range(8)]
    seated = [("spare0" if x == "node3" else x) for x in names]
    worlds = {4: world(4, names), 5: world(5, seated), 6: world(6, [("spare1" if x == "node5" else x) for x in seated])}
    js = FakeJobStore(worlds, names + ["spare0", "spare1"])
    holders = PeerReplicas(js, sid=3, engine=None, replicas=1).likely_holders()
    assert holders == ["spare0", "node4", "node5", "node6", "node7", "node3"]
