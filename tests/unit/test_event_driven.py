"""The steady path waits on events, not on timers (issue 15): doorbells, the self-pipe waker,
kicked periodic workers, the agent's sleep plan. No timing
assertions: a wait that should return at once is given a long timeout and must return
True (rung), one that should not is given a short one and must return False."""

from __future__ import annotations

import os
import threading
import types

import pytest

from hotspare.agents import agent as agent_mod
from hotspare.agents.node_workers import WorkerState
from hotspare.orchestrator.util import PeriodicWorker, Waker
from hotspare.recovery.bell import Bell, Ringer


def test_a_ring_wakes_the_bell_and_is_consumed(tmp_path):
    bell = Bell(tmp_path / "b.bell")
    ringer = Ringer(tmp_path / "b.bell")
    assert not bell.wait(0.01)  # nothing rung yet
    for _ in range(3):
        assert ringer.ring()
    assert bell.wait(60)  # rung: returns at once
    assert not bell.wait(0.01)  # the three rings woke one wait, not three
    assert oct(os.stat(tmp_path / "b.bell").st_mode & 0o777) == "0o600"
    bell.close(unlink=True)
    ringer.close()


def test_ringing_nobody_neither_blocks_nor_fails(tmp_path):
    assert Ringer(tmp_path / "missing.bell").ring() is False  # no FIFO at all
    os.mkfifo(tmp_path / "orphan.bell", 0o600)
    assert Ringer(tmp_path / "orphan.bell").ring() is False  # a FIFO nobody reads
    bell = Bell(tmp_path / "full.bell")
    ringer = Ringer(tmp_path / "full.bell")
    for _ in range(100_000):  # far past a pipe's 64 KiB: a full pipe means "already rung"
        assert ringer.ring()
    assert bell.wait(60)
    bell.close()
    assert ringer.ring() is False  # the reader went away: EPIPE is nobody listening, not an error
    ringer.close()


def test_a_bell_refuses_a_path_that_is_not_a_fifo(tmp_path):
    (tmp_path / "x.bell").write_text("not a pipe")
    with pytest.raises(RuntimeError, match="not a FIFO"):
        Bell(tmp_path / "x.bell")


def test_the_waker_is_set_from_another_thread_and_from_a_signal_handler():
    import signal

    w = Waker()
    assert not w.wait(0.01)
    threading.Thread(target=w.set).start()
    assert w.wait(60)
    old = signal.signal(signal.SIGUSR1, lambda *_: w.set())
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert w.wait(60)
    finally:
        signal.signal(signal.SIGUSR1, old)
    w.close()


def test_a_kicked_periodic_worker_runs_at_once_despite_a_long_interval():
    ran = threading.Event()
    pw = PeriodicWorker("kicked", 3600.0, ran.set).start()
    try:
        assert not ran.wait(0.05)  # an hour-long interval: nothing by itself
        pw.kick()
        assert ran.wait(60)
    finally:
        pw.stop()


def _agent_for_sleep(workers, retry=False, partitioned_until=0.0, changed=False):
    a = agent_mod.Agent.__new__(agent_mod.Agent)
    a.workers = workers
    a._retry = retry
    a.follow = types.SimpleNamespace(pending=changed)
    a.hang_timeout = 40.0
    a.chaos = types.SimpleNamespace(partitioned=bool(partitioned_until), partitioned_until=partitioned_until)
    return a


def test_the_agent_sleeps_until_its_next_deadline_not_a_poll_period(monkeypatch):
    monkeypatch.setattr(agent_mod.time, "monotonic", lambda: 1000.0)
    idle = _agent_for_sleep({})
    assert idle._sleep_for(last_read=1000.0) == agent_mod.SAFETY_READ  # nothing to watch: the safety read
    assert idle._sleep_for(last_read=0.0) == 0.0  # the safety read is overdue
    busy = _agent_for_sleep({0: types.SimpleNamespace(state=WorkerState.ASSIGNED)})
    assert busy._sleep_for(last_read=1000.0) == 10.0  # the watchdog looks every hang_timeout / 4
    warm = _agent_for_sleep({0: types.SimpleNamespace(state=WorkerState.WARM)})
    assert warm._sleep_for(last_read=1000.0) == agent_mod.SAFETY_READ  # a warm worker has no watchdog
    assert _agent_for_sleep({}, retry=True)._sleep_for(1000.0) == agent_mod.POLL  # a report to retry
    # a read etcd refused (the loop marked the job changed again): retried soon, not at the next safety read --
    # else an idle agent whose etcd died noticed only after SAFETY_READ (test_reruns.py's orphan agent)
    assert _agent_for_sleep({}, changed=True)._sleep_for(1000.0) == agent_mod.POLL
    assert _agent_for_sleep({}, partitioned_until=1003.0)._sleep_for(1000.0) == 3.0  # heal on time



def test_a_long_lived_etcd_ticks_slowly_unless_the_environment_says_otherwise(monkeypatch, tmp_path):
    """`hotspare up`'s etcd runs a 500 ms raft heartbeat (an idle one-member etcd's CPU is
    mostly its ticks); throwaway ones and $HOTSPARE_ETCD_HEARTBEAT_MS tick every 50 ms."""
    from hotspare.orchestrator import embedded, etcd_server

    monkeypatch.delenv(etcd_server.HEARTBEAT_ENV, raising=False)
    assert etcd_server.tick_args(etcd_server.LONG_LIVED_HEARTBEAT_MS) == [
        "--heartbeat-interval", "500", "--election-timeout", "2500"]
    assert etcd_server.tick_args(etcd_server.QUICK_HEARTBEAT_MS) == [
        "--heartbeat-interval", "50", "--election-timeout", "500"]
    monkeypatch.setenv(etcd_server.HEARTBEAT_ENV, "50")
    assert etcd_server.tick_args(etcd_server.LONG_LIVED_HEARTBEAT_MS)[:2] == ["--heartbeat-interval", "50"]
    seen = {}

    def fake_start(*args, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(embedded, "start_etcd", fake_start)
    with pytest.raises(RuntimeError, match="stop here"):
        embedded._start(tmp_path, None, log=lambda m: None)
    assert seen["heartbeat_ms"] == etcd_server.LONG_LIVED_HEARTBEAT_MS  # what `hotspare up` starts


class _LinkStore:
    """What a ControlLink uses of a JobStore: no etcd; progress records are kept in a list."""

    def __init__(self) -> None:
        self.keys = types.SimpleNamespace(epoch="/e")
        self.store = types.SimpleNamespace(watch_prefix=lambda prefix, cb: (lambda: None))
        self.records: list = []
        self.put = threading.Event()

    def epoch(self) -> int:
        return 1

    def put_progress(self, pr) -> None:
        self.records.append(pr)
        self.put.set()

    def put_event(self, ev) -> None:
        pass


def test_the_first_step_of_a_world_is_published_at_once_not_at_the_next_interval():
    """Progress records come every progress_interval (10 s); the first step trained in a new
    world is published at the next wake-up, so `hotspare status` shows a (re)started job."""
    from hotspare.recovery.control import ControlLink

    js = _LinkStore()
    member = types.SimpleNamespace(rank=0, epoch=0, committed=-1, step_time=0.0, compute_time=0.0, metrics={})
    link = ControlLink(js, member, "n0", on_epoch=lambda e: None, progress_interval=3600, poll_interval=3600)
    link.start()
    try:
        assert not js.put.wait(0.2)  # not joined: nothing to publish
        member.epoch, member.committed = 2, 41
        assert not js.put.wait(0.2), "no record before it is asked for, with a 1-hour interval"
        link.progress_now()
        assert js.put.wait(60)
        assert [(r.epoch, r.step) for r in js.records] == [(2, 41)]
    finally:
        link.stop()
