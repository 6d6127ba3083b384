"""The node agent's pieces that need no etcd: exit classification, worker states, the chaos
handler table, the published view, ring buddies, the replicator's thread ownership, and
:meth:`Agent.stop` from a signal handler."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from hotspare.agents.agent import Agent
from hotspare.agents.node_chaos import NodeChaos
from hotspare.agents.node_services import ring_buddies
from hotspare.agents.node_view import NodeView
from hotspare.agents.node_workers import WorkerProc, WorkerState, classify_exit
from hotspare.agents.replica import Replicator
from hotspare.agents.worker_link import EXIT_FENCED, EXIT_UNRECOVERABLE, Assignment, Heartbeat
from hotspare.orchestrator import chaos
from hotspare.orchestrator.store import Node, Seat, World

pytestmark = pytest.mark.timeout(60)


# -- exit classification ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "hang_killed", "fatal", "kind", "message"),
    [
        (EXIT_UNRECOVERABLE, False, "no copy of sid 3 anywhere", "fatal",
         "worker pid 7 cannot go on: no copy of sid 3 anywhere"),
        (EXIT_UNRECOVERABLE, False, None, "fatal",
         "worker pid 7 cannot go on: its state cannot be restored (see its rank log)"),
        (EXIT_UNRECOVERABLE, True, "gone", "fatal", "worker pid 7 cannot go on: gone"),
        (-9, True, None, "hang", "worker pid 7 hung (no heartbeat) and was killed"),
        (-9, False, None, "exit", "worker pid 7 killed by signal 9"),
        (1, False, None, "exit", "worker pid 7 exited with code 1"),
        (EXIT_FENCED, False, None, "exit", "worker pid 7 exited with code 3"),
    ],
    ids=["fatal-with-reason", "fatal-without-reason", "fatal-beats-hang", "hang", "signal", "error", "fenced"],
)
def test_an_exit_is_classified_as_the_controller_must_act_on_it(code, hang_killed, fatal, kind, message):
    assert classify_exit(code, hang_killed, fatal, 7) == (kind, message)


# -- worker states ----------------------------------------------------------------------------
def test_a_worker_holds_a_seat_from_its_assignment_until_it_is_gone(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print(sys.stdin.readline(), end='')"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    w = WorkerProc(slot=0, proc=proc, hb=Heartbeat(tmp_path / "hb"))
    try:
        assert w.state is WorkerState.WARM and not w.holds_seat and w.alive
        w.assign(rank=2, sid=5, epoch=4)
        assert w.state is WorkerState.ASSIGNED and w.holds_seat
        assert (w.rank, w.sid, w.epoch) == (2, 5, 4) and w.assigned_at > 0
        assert w.send(Assignment(rank=2, epoch=4, sid=5, incarnation="abc"))
        out, _ = proc.communicate(timeout=30)
        assert Assignment.from_line(out) == Assignment(rank=2, epoch=4, sid=5, incarnation="abc")
        assert not w.alive
        w.state = WorkerState.HANG_KILLED
        assert w.holds_seat, "a hang-killed worker keeps its seat until its exit is reported"
    finally:
        w.kill()
        w.hb.close()


def test_an_assignment_to_a_worker_that_just_died_is_not_sent(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE)
    w = WorkerProc(slot=0, proc=proc, hb=Heartbeat(tmp_path / "hb"))
    try:
        proc.wait(30)
        assert not w.send(Assignment(rank=0, epoch=1, sid=0)), "supervision reports it, not the assignment"
    finally:
        w.hb.close()


def test_fatal_text_is_what_the_worker_left_beside_its_heartbeat(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    w = WorkerProc(slot=0, proc=proc, hb=Heartbeat(tmp_path / "slot0.hb"))
    try:
        assert w.fatal_text() is None
        (tmp_path / "slot0.hb.fatal").write_text("no usable checkpoint\n")
        assert w.fatal_text() == "no usable checkpoint"
    finally:
        proc.wait(30)
        w.hb.close()


# -- chaos --------------------------------------------------------------------------------------
def test_every_agent_chaos_action_has_a_handler_and_no_other_action_does():
    assert set(NodeChaos.HANDLERS) == set(chaos.AGENT_ACTIONS)
    for name, method in NodeChaos.HANDLERS.items():
        assert callable(getattr(NodeChaos, method, None)), name


# -- the published view and the ring ------------------------------------------------------------
def test_view_sids_are_its_seats_state_ids():
    assert NodeView(seats={5: 0, 2: 1}).sids == frozenset({2, 5})
    assert NodeView().sids == frozenset()


def _world(nodes: list[str]) -> World:
    return World(epoch=3, seats=tuple(Seat(node=n, incarnation="i", since=1) for n in nodes))


def test_ring_buddies_follow_the_world_seat_order_and_skip_nodes_without_a_server():
    nodes = {n: Node(name=n, incarnation="i", role="active", slots=1, host=f"h-{n}", replica_port=p)
             for n, p in (("a", 1), ("b", 2), ("c", 0), ("d", 4))}
    world = _world(["a", "a", "b", "c", "d"])
    assert ring_buddies(world, nodes, "a", 1) == [("b", "h-b", 2)]
    assert ring_buddies(world, nodes, "b", 2) == [("d", "h-d", 4), ("a", "h-a", 1)]  # c serves nothing
    assert ring_buddies(world, nodes, "d", 5) == [("a", "h-a", 1), ("b", "h-b", 2)]  # never itself
    assert ring_buddies(world, nodes, "spare", 1) == []
    assert ring_buddies(world, nodes, "a", 0) == []


# -- the replicator's bookkeeping belongs to its thread ---------------------------------------
class _Points:
    """A ReplicaStore stand-in: one new point per sid every round, loads and confirms."""

    def __init__(self, old: dict[int, list[tuple[int, int]]] | None = None) -> None:
        self.old = old or {}
        self.round = 0
        self.confirmed: list[tuple[int, int, int]] = []

    def points(self, sid: int) -> list[tuple[int, int]]:
        return list(self.old.get(sid, []))

    def newest_point(self, sid: int, ignore=()) -> tuple[int, int] | None:
        mine = [p for p in self.points(sid) + [(self.round, 1000 + self.round)] if p[1] not in ignore]
        return max(mine) if mine else None

    def load(self, sid: int, step: int, seq: int | None = None) -> tuple[dict, bytes]:
        return {"step": step}, b""

    def confirm(self, sid: int, step: int, seq: int | None = None) -> None:
        self.confirmed.append((sid, step, seq))


class _Loopback(Replicator):
    def _send(self, name, host, port, sid, header, body) -> bool:
        return True


def test_forget_from_the_agent_thread_while_a_push_round_runs_never_fails():
    """The agent calls forget() on its thread while the replicator thread pushes. forget()
    used to walk ``sent`` while the push re-inserted the keys it had just dropped: a
    "dictionary changed size during iteration" there ended the agent."""
    store = _Points()
    sids = {sid: sid for sid in range(100)}
    buddies = tuple((f"n{i}", "127.0.0.1", 1) for i in range(8))
    rep = _Loopback(store, b"s" * 32, view=lambda: NodeView(buddies=buddies, seats=sids))  # type: ignore[arg-type]
    rep.push_once()  # 800 keys in ``sent``
    errors: list[BaseException] = []
    done = threading.Event()

    def pusher() -> None:
        try:
            while not done.is_set():
                store.round += 1
                rep.push_once()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    t = threading.Thread(target=pusher, daemon=True)
    t.start()
    try:
        for i in range(3000):
            rep.forget(i % 100)
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
    finally:
        done.set()
        t.join(30)
        sys.setswitchinterval(old)
    assert not errors, f"{errors[0]!r}"


def test_a_forgotten_seat_is_reset_by_the_replicators_next_round_with_the_points_seen_at_forget():
    store = _Points(old={0: [(15, 7)]})  # the dead worker's point 15 (seq 7) is still on disk
    rep = _Loopback(store, b"s" * 32, view=lambda: NodeView(buddies=(("b", "h", 1),), seats={0: 0}))  # type: ignore[arg-type]
    rep.push_once()
    assert rep.sent[(0, "b")] == (15, 7) and rep.confirmed[0] == (15, 7)

    rep.forget(0)
    assert rep.sent[(0, "b")] == (15, 7), "forget() itself must leave the replicator's bookkeeping alone"
    store.old[0].append((20, 8))  # written after forget(): the new worker's own point, never stale
    store.round = 5
    rep.push_once()
    assert rep.stale[0] == {7}
    assert rep.confirmed[0] == (20, 8) and store.confirmed[-1] == (0, 20, 8)
    assert (0, 15, 7) not in store.confirmed[1:], "the dead worker's point was confirmed to the new one"


# -- stopping -----------------------------------------------------------------------------------
def test_stop_from_a_signal_handler_ends_the_main_loop(monkeypatch):
    agent = Agent(store=None, job="j", node="n")  # type: ignore[arg-type]

    class _Chaos:
        partitioned = False

    class _Services:
        view = staticmethod(NodeView)

        def publish(self, view: NodeView) -> None:
            pass

    agent.chaos = _Chaos()  # type: ignore[assignment]
    agent.services = _Services()  # type: ignore[assignment]
    monkeypatch.setattr(agent, "_follow_job", lambda: False)
    monkeypatch.setattr(agent, "_publish", lambda force=False: None)
    previous = signal.signal(signal.SIGALRM, lambda *_: agent.stop())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        assert agent._loop() == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_node_view_is_frozen():
    with pytest.raises(AttributeError):
        NodeView().epoch = 3  # type: ignore[misc]

