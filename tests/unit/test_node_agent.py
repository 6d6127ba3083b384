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
from hotspare.agents.node_workers import OomCounter, WorkerProc, WorkerState, classify_exit
from hotspare.agents.replica import Replicator
from hotspare.agents.worker_link import (
    EXIT_ERROR,
    EXIT_FENCED,
    EXIT_INFRA_ERROR,
    EXIT_STARTUP_ERROR,
    EXIT_UNRECOVERABLE,
    RUNNING,
    Assignment,
    Heartbeat,
    Raised,
    WorkerEnv,
    error_path,
)
from hotspare.orchestrator import chaos
from hotspare.orchestrator.store import Node, Seat, World

pytestmark = pytest.mark.timeout(60)


# -- exit classification ----------------------------------------------------------------------
BOOM = Raised('Traceback (most recent call last):\n  File "train.py", line 9, in train\nValueError: boom', step=5)


@pytest.mark.parametrize(
    ("code", "hang_killed", "fatal", "raised", "oom", "kind", "message"),
    [
        (EXIT_UNRECOVERABLE, False, "no copy of sid 3 anywhere", None, False, "fatal",
         "worker pid 7 cannot go on: no copy of sid 3 anywhere"),
        (EXIT_UNRECOVERABLE, False, None, None, False, "fatal",
         "worker pid 7 cannot go on: its state cannot be restored (see its rank log)"),
        (EXIT_UNRECOVERABLE, True, "gone", None, False, "fatal", "worker pid 7 cannot go on: gone"),
        (-9, True, None, None, True, "hang", "worker pid 7 hung (no heartbeat) and was killed"),
        (-9, False, None, None, False, "signal", "worker pid 7 killed by signal 9 (SIGKILL)"),
        (-15, False, None, None, True, "signal", "worker pid 7 killed by signal 15 (SIGTERM)"),
        (-9, False, None, None, True, "oom", "worker pid 7 was killed by the kernel's OOM killer (out of memory)"),
        (EXIT_ERROR, False, None, BOOM, False, "error", "worker pid 7 raised ValueError: boom"),
        (EXIT_ERROR, False, None, None, False, "exit", "worker pid 7 exited with code 1"),
        (EXIT_STARTUP_ERROR, False, None, BOOM, False, "error", "worker pid 7 could not start the job: ValueError: boom"),
        (EXIT_INFRA_ERROR, False, None, BOOM, False, "exit",
         "worker pid 7 stopped: its process group or hotspare's I/O failed under the training function "
         "(ValueError: boom)"),
        (EXIT_FENCED, False, None, None, False, "fenced", "worker pid 7 left: its seat had moved on (fenced)"),
        (17, False, None, None, False, "exit", "worker pid 7 exited with code 17"),
    ],
    ids=["fatal-with-reason", "fatal-without-reason", "fatal-beats-hang", "hang-beats-oom", "signal",
         "sigterm-is-no-oom", "oom", "code-error", "exit-1-without-traceback-is-a-crash", "startup-error",
         "not-the-code", "fenced", "other-code"],
)
def test_an_exit_is_classified_as_the_controller_must_act_on_it(code, hang_killed, fatal, raised, oom, kind, message):
    assert classify_exit(code, hang_killed, fatal, 7, raised=raised, oom=oom) == (kind, message)


def test_the_oom_counter_rises_only_when_the_kernel_killed_for_memory(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    oom = OomCounter(events)
    assert oom.read() == 1 and not oom.rose(), "kills before the agent started are not ours"
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert oom.rose(), "one more kill since the last look"
    assert not oom.rose(), "each rise is seen once"
    assert not OomCounter(tmp_path / "missing").rose(), "no cgroup file: never an OOM"


def test_what_a_worker_raised_comes_back_from_beside_its_heartbeat(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    w = WorkerProc(slot=0, proc=proc, hb=Heartbeat(tmp_path / "slot0.hb"))
    try:
        proc.wait(30)
        assert w.raised() is None and w.step() == -1, "nothing left, never ran a seat"
        assert BOOM.write(w.hb.path)
        assert w.raised() == BOOM
        error_path(w.hb.path).write_text("{not json")
        assert w.raised() is None, "a torn file is no traceback"
        w.hb.beat(4, RUNNING)
        assert w.step() == 5, "by its heartbeat it was computing the step after its last commit"
    finally:
        w.hb.close()


class _Reports:
    """A JobStore stand-in that keeps what the agent reports."""

    def __init__(self) -> None:
        self.reports: list = []
        self.events: list = []

    def report(self, rep) -> None:
        self.reports.append(rep)

    def event(self, kind, source, message, /, **data) -> None:
        self.events.append((kind, message, data))


def _exited_worker(tmp_path, slot: int, code: int, raised: Raised | None = None) -> WorkerProc:
    proc = subprocess.Popen([sys.executable, "-c", f"import os; os._exit({code})"], stdin=subprocess.PIPE)
    proc.wait(30)
    w = WorkerProc(slot=slot, proc=proc, hb=Heartbeat(tmp_path / f"slot{slot}.hb"))
    if raised is not None:
        raised.write(w.hb.path)
    return w


def _supervising_agent(monkeypatch, workers: list[WorkerProc]) -> tuple[Agent, _Reports, list[int]]:
    agent = Agent(store=None, job="j", node="node3")  # type: ignore[arg-type]
    agent.js = _Reports()  # type: ignore[assignment]
    agent.workers = {w.slot: w for w in workers}
    spawned: list[int] = []
    monkeypatch.setattr(agent, "_spawn", spawned.append)
    return agent, agent.js, spawned  # type: ignore[return-value]


def test_a_warm_worker_that_cannot_load_the_job_is_reported_once_and_not_respawned(tmp_path, monkeypatch):
    startup = Raised("Traceback (most recent call last):\nModuleNotFoundError: No module named 'nowhere'")
    agent, js, spawned = _supervising_agent(monkeypatch, [
        _exited_worker(tmp_path, 0, EXIT_STARTUP_ERROR, startup),
        _exited_worker(tmp_path, 1, 1),  # a warm worker that died otherwise: replaced as ever
    ])
    agent._supervise()
    assert spawned == [1], "no respawn loop for a slot whose worker cannot load the job's code"
    [rep] = js.reports
    assert (rep.node, rep.rank, rep.kind, rep.step, rep.traceback) == ("node3", -1, "error", -1, startup.traceback)
    assert rep.message.endswith("could not start the job: ModuleNotFoundError: No module named 'nowhere'")
    assert agent.workers == {}


def test_an_assigned_worker_that_raised_is_reported_with_its_traceback_and_step(tmp_path, monkeypatch):
    w = _exited_worker(tmp_path, 0, EXIT_ERROR, BOOM)
    w.assign(rank=2, sid=2, epoch=3)
    agent, js, spawned = _supervising_agent(monkeypatch, [w])
    agent._supervise()
    [rep] = js.reports
    assert (rep.rank, rep.epoch, rep.kind, rep.step, rep.traceback, rep.exit_code) == (2, 3, "error", 5, BOOM.traceback, 1)
    assert js.events[0][2]["step"] == 5
    assert spawned == [0], "its slot gets a new warm worker"


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
    monkeypatch.setattr(agent, "_follow_job", lambda full=True: False)
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



# -- the worker's environment ----------------------------------------------------------------
def test_worker_env_round_trips_through_the_environment_prewarm_included():
    link = WorkerEnv(job="j", node="n0", incarnation="i1", hb="/x/slot0.hb", log_dir="/x", snap_dir="/s",
                     agent_pid=7, threads=2, prewarm=False)
    env = link.to_env()
    assert env["HOTSPARE_PREWARM"] == "0" and env["HOTSPARE_THREADS"] == "2"
    assert WorkerEnv.from_env(env) == link
    assert WorkerEnv.from_env({**env, "HOTSPARE_PREWARM": "1"}).prewarm is True
    del env["HOTSPARE_PREWARM"]
    assert WorkerEnv.from_env(env).prewarm is True  # default: a worker that may wait prewarms
