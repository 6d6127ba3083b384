"""Security review findings on the node agent that need no etcd.

F7: the hang watchdog times heartbeats on a monotonic clock, so a wall-clock step (an NTP
step, a VM resumed after a pause) kills no busy worker, while a really silent one is still
killed. F10 (the parts without etcd): a record that does not parse is skipped, not fatal to
the whole snapshot; the agent's loop survives a job record it cannot use.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from hotspare.agents.agent import Agent
from hotspare.agents.node_chaos import NodeChaos
from hotspare.agents.node_view import NodeView
from hotspare.agents.node_workers import WorkerProc, WorkerState
from hotspare.agents.worker_link import RUNNING, Heartbeat
from hotspare.orchestrator.store import KV, JobKeys, parse_snapshot
from hotspare.orchestrator.store.records import BadRecord

pytestmark = pytest.mark.timeout(60)

WALL_STEP = 120.0  # what the review demonstrated: the wall clock moved 120 s forward at once
HANG = 1.0  # the agents' hang_timeout here


class _Reports:
    """A JobStore stand-in that keeps what the agent reports."""

    def __init__(self) -> None:
        self.reports: list = []
        self.events: list = []

    def report(self, rep) -> None:
        self.reports.append(rep)

    def event(self, kind, source, message, /, **data) -> None:
        self.events.append((kind, message, data))


@pytest.fixture
def busy(tmp_path, monkeypatch):
    """An agent watching one assigned, running worker (a live process that beats only when the
    test says so), with a hang timeout of ``HANG`` seconds."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    w = WorkerProc(slot=0, proc=proc, hb=Heartbeat(tmp_path / "slot0.hb"))
    agent = Agent(store=None, job="j", node="node3")  # type: ignore[arg-type]
    agent.js = _Reports()  # type: ignore[assignment]
    agent.hang_timeout = HANG
    agent.workers = {0: w}
    monkeypatch.setattr(agent, "_spawn", lambda slot, prewarm=True: None)
    w.assign(rank=1, sid=1, epoch=2)
    w.hb.beat(7, RUNNING)
    try:
        yield agent, w
    finally:
        w.kill()
        w.hb.close()


def _jump_wall_clock(monkeypatch, seconds: float) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_a_forward_wall_clock_step_does_not_kill_a_busy_worker(busy, monkeypatch):
    agent, w = busy
    agent._supervise()  # the watchdog sees the worker's heartbeat
    _jump_wall_clock(monkeypatch, WALL_STEP)  # NTP steps the clock; no real time passes
    agent._supervise()
    w.hb.beat(8)  # the worker goes on beating, on the new wall clock
    agent._supervise()
    assert w.state is WorkerState.ASSIGNED and w.alive, \
        "the watchdog killed a busy worker because the wall clock jumped"
    assert not agent.js.reports  # type: ignore[attr-defined]


def test_a_wall_clock_step_right_after_an_assignment_does_not_kill_the_worker(busy, monkeypatch):
    agent, w = busy
    _jump_wall_clock(monkeypatch, WALL_STEP)  # between the assignment and the first look
    agent._supervise()
    _jump_wall_clock(monkeypatch, 2 * WALL_STEP)
    agent._supervise()
    assert w.state is WorkerState.ASSIGNED and w.alive


def test_a_backward_wall_clock_step_does_not_blind_the_watchdog(busy, monkeypatch):
    agent, w = busy
    agent._supervise()
    _jump_wall_clock(monkeypatch, -3600.0)  # the clock goes back an hour: silence must still count
    deadline = time.monotonic() + 30
    while w.state is WorkerState.ASSIGNED and time.monotonic() < deadline:
        time.sleep(0.1)
        agent._supervise()
    assert w.state is WorkerState.HANG_KILLED, "a silent worker was never killed after the clock went back"


def test_a_really_silent_worker_is_still_killed_and_reported_as_a_hang(busy, monkeypatch):
    agent, w = busy
    agent._supervise()
    deadline = time.monotonic() + 30
    while w.state is WorkerState.ASSIGNED and time.monotonic() < deadline:
        time.sleep(0.1)  # real time passes; the worker never beats again
        agent._supervise()
    assert w.state is WorkerState.HANG_KILLED
    w.proc.wait(10)
    agent._supervise()  # its exit is reported as a hang, stamped with the wall clock
    [rep] = agent.js.reports  # type: ignore[attr-defined]
    assert (rep.rank, rep.kind) == (1, "hang")
    assert abs(rep.time - time.time()) < 60, "a report's time is a wall-clock timestamp (the timeline reads it)"


def test_a_healed_partition_restarts_the_watchdog_on_the_same_clock(busy, monkeypatch):
    agent, w = busy

    class _Services:
        def pause(self, paused: bool) -> None:
            pass

    class _Lease:
        def pause(self) -> None:
            pass

        def resume(self) -> None:
            pass

    chaos = NodeChaos(None, "node3", _Services(), lease_ttl=1.0)  # type: ignore[arg-type]
    agent._supervise()  # the watchdog has seen the heartbeat before the node is cut off
    chaos.partition(0.0, [w], _Lease())  # type: ignore[arg-type]
    assert chaos.heal_if_due(_Lease())  # type: ignore[arg-type]
    _jump_wall_clock(monkeypatch, WALL_STEP)
    agent._supervise()
    assert w.state is WorkerState.ASSIGNED and w.alive, "a wall-clock step after a healed partition killed a busy worker"
    deadline = time.monotonic() + 30
    while w.state is WorkerState.ASSIGNED and time.monotonic() < deadline:
        time.sleep(0.1)
        agent._supervise()
    assert w.state is WorkerState.HANG_KILLED, "after a heal a silent worker must still be killed"


# -- F10: records that do not parse ---------------------------------------------------------------
JOB = "a"


def _kv(key: str, value: object, mod: int = 5) -> KV:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return KV(key=key, value=raw, mod_revision=mod, create_revision=mod)


def _good_node(name: str) -> dict:
    return {"name": name, "incarnation": "i1", "role": "active", "slots": 1}


@pytest.mark.parametrize("bad", [
    {"name": "n9"},  # fields missing (what the review planted)
    {"name": "n9", "incarnation": "i", "role": "active", "slots": "many"},  # a field of the wrong type
    b"{not json",
    b"\xff\xfe",
    [1, 2, 3],  # JSON, but not an object
], ids=["missing-fields", "wrong-type", "not-json", "not-utf8", "not-an-object"])
def test_a_bad_node_record_is_skipped_and_the_rest_of_the_snapshot_is_read(bad):
    k = JobKeys(JOB)
    snap = parse_snapshot(JOB, [
        _kv(k.epoch, 1),
        _kv(k.world(1), {"epoch": 1, "seats": [{"node": "n1", "incarnation": "i1", "since": 1}]}),
        _kv(k.node("n1"), _good_node("n1")),
        _kv(k.node("n9"), bad),
        _kv(k.report("n1", 0), {"node": "n1", "rank": "zero", "epoch": 1, "kind": "signal"}),
        _kv(k.prefix + "done/x", {"epoch": 1, "step": 3}),
        _kv(k.progress(0), {"rank": 0}),
    ], revision=9)
    assert set(snap.nodes) == {"n1"} and snap.world is not None and snap.epoch == 1
    assert not snap.reports and not snap.done and not snap.progress
    assert set(snap.bad) == {k.node("n9"), k.report("n1", 0), k.prefix + "done/x", k.progress(0)}


@pytest.mark.parametrize("rel", ["epoch", "state", "spec", "world/00000001"])
def test_a_record_the_job_cannot_be_judged_without_raises_bad_record_naming_it(rel):
    k = JobKeys(JOB)
    kvs = [_kv(k.epoch, 1),
           _kv(k.world(1), {"epoch": 1, "seats": [{"node": "n1", "incarnation": "i1", "since": 1}]})]
    kvs = [kv for kv in kvs if kv.key != k.prefix + rel] + [_kv(k.prefix + rel, {"garbage": True})]
    with pytest.raises(BadRecord) as err:
        parse_snapshot(JOB, kvs, revision=9)
    assert err.value.key == k.prefix + rel and k.prefix + rel in str(err.value)


def test_the_agent_loop_survives_a_job_record_it_cannot_parse(monkeypatch):
    agent = Agent(store=None, job="j", node="n")  # type: ignore[arg-type]

    class _Chaos:
        partitioned = False

    class _Services:
        view = staticmethod(NodeView)

        def publish(self, view: NodeView) -> None:
            pass

    agent.chaos = _Chaos()  # type: ignore[assignment]
    agent.services = _Services()  # type: ignore[assignment]
    calls = []

    def follow(full: bool = True) -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise BadRecord("/hotspare/j/epoch", "ValueError: invalid literal for int()")
        agent.stop()
        return False

    monkeypatch.setattr(agent, "_follow_job", follow)
    monkeypatch.setattr("hotspare.agents.agent.SAFETY_READ", 0.05)  # the loop reads again after this
    monkeypatch.setattr(agent, "_publish", lambda force=False: None)
    monkeypatch.setattr(agent, "_supervise", lambda: None)
    agent._wake.set()
    assert agent._loop() == 0 and len(calls) >= 3


# --- F9: the /dev/shm start-up sweep must not delete another PID namespace's live run dir ---

def _dead_pid() -> int:
    """A PID nobody has here: what a live agent's PID looks like from another PID namespace."""
    from hotspare.orchestrator.util import pid_alive

    return next(p for p in range(4_000_000, 3_000_000, -7) if not pid_alive(p))


def _run_dir(base, pid: int, tag: str = "x"):
    d = base / f"hotspare-job-n0-{pid}-{tag}"
    d.mkdir()
    (d / "rank0.slot0").write_bytes(b"live snapshot")
    return d


def test_the_sweep_keeps_a_live_run_dir_whose_pid_means_nothing_in_this_namespace(tmp_path):
    from hotspare.agents.node_services import claim_run_dir, sweep_stale_run_dirs

    live = _run_dir(tmp_path, _dead_pid())
    fd = claim_run_dir(live)  # its agent, alive in another PID namespace, holds the lock
    try:
        sweep_stale_run_dirs(tmp_path)
        assert (live / "rank0.slot0").read_bytes() == b"live snapshot"
    finally:
        import os

        os.close(fd)
    sweep_stale_run_dirs(tmp_path)  # the agent died: the kernel dropped its lock
    assert not live.exists()


def test_the_sweep_removes_only_old_unclaimed_dirs_of_dead_pids_and_never_follows_links(tmp_path):
    import os

    from hotspare.agents import node_services
    from hotspare.agents.node_services import sweep_stale_run_dirs

    old = _run_dir(tmp_path, _dead_pid(), "old")  # an agent of a release without owner files
    fresh = _run_dir(tmp_path, _dead_pid(), "fresh")  # made a moment ago: its lock is coming
    alive = _run_dir(tmp_path, os.getpid(), "alive")
    past = time.time() - node_services.UNCLAIMED_GRACE_S - 5
    for d in (old, alive):
        os.utime(d, (past, past))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    (tmp_path / f"hotspare-job-n1-{_dead_pid()}-link").symlink_to(target)
    sweep_stale_run_dirs(tmp_path)
    assert not old.exists()
    assert fresh.exists() and alive.exists()
    assert (target / "keep").exists()


def test_a_run_dir_is_never_swept_while_its_agent_claims_it(tmp_path, monkeypatch):
    """Two agents starting at once: one sweeps while the other claims its new directory. The
    owner file existed a moment before its lock, and a sweep in that moment locked it and
    removed the directory ("No such file or directory" when the agent made its doorbell). A
    directory becomes visible to the sweep only once its lock is held."""
    import os

    from hotspare.agents import node_services
    from hotspare.agents.node_services import OWNER, make_run_dir, sweep_stale_run_dirs

    real_flock, swept = node_services.fcntl.flock, []

    def flock_after_a_sweep(fd, op):  # the other agent's sweep runs between owner file and lock
        if not swept:
            swept.append(True)
            sweep_stale_run_dirs(tmp_path)
        real_flock(fd, op)

    monkeypatch.setattr(node_services.fcntl, "flock", flock_after_a_sweep)
    d, fd = make_run_dir(tmp_path, f"hotspare-job-n0-{os.getpid()}-")
    try:
        assert swept and d.is_dir() and (d / OWNER).exists() and d.name.startswith("hotspare-job-n0-")
        monkeypatch.setattr(node_services.fcntl, "flock", real_flock)
        sweep_stale_run_dirs(tmp_path)
        assert d.is_dir(), "a live agent's directory is kept"
    finally:
        os.close(fd)
    sweep_stale_run_dirs(tmp_path)
    assert not d.exists() and not list(tmp_path.iterdir())


def test_a_run_dir_left_mid_claim_is_swept_once_it_is_old(tmp_path):
    import os

    from hotspare.agents import node_services
    from hotspare.agents.node_services import CLAIMING, sweep_stale_run_dirs

    left = tmp_path / f"{CLAIMING}hotspare-job-n0-{_dead_pid()}-abc"
    left.mkdir()
    (left / node_services.OWNER).write_text("")
    sweep_stale_run_dirs(tmp_path)
    assert left.exists(), "it may be an agent between its owner file and its lock"
    past = time.time() - node_services.UNCLAIMED_GRACE_S - 5
    os.utime(left, (past, past))
    sweep_stale_run_dirs(tmp_path)
    assert not left.exists()
