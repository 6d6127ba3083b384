"""The store against a real etcd: CAS fencing, leases, watches, error translation, and the
JobStore verbs that hold every compare-and-set of a job's keys."""

from __future__ import annotations

import threading
import time

import pytest

from hotspare.orchestrator.controller import Controller
from hotspare.orchestrator.decide import decide
from hotspare.orchestrator.store import (
    Compare,
    JobState,
    JobStore,
    Lease,
    Node,
    Progress,
    Report,
    Seat,
    Store,
    StoreUnavailable,
    World,
    wait_until,
)


def test_create_only_succeeds_once(etcd):
    st = Store([etcd.endpoint])
    assert st.create("/x/a", "1")
    assert not st.create("/x/a", "2")
    assert st.get("/x/a").value == b"1"


def test_fenced_txn_loses_after_a_concurrent_change(etcd):
    st = Store([etcd.endpoint])
    st.put("/x/epoch", "1")
    seen = st.get("/x/epoch")
    st.put("/x/epoch", "2")  # someone else decided first
    ok = st.txn([Compare("/x/epoch", "mod", "==", seen.mod_revision)], puts={"/x/epoch": "3", "/x/w": "w"})
    assert not ok
    assert st.get("/x/epoch").value == b"2" and st.get("/x/w") is None


def test_key_under_a_lease_disappears_when_keepalive_stops_and_watchers_hear_it(etcd):
    st = Store([etcd.endpoint])
    lease = st.lease(1)
    st.put("/x/node", "n", lease=lease)
    heard = threading.Event()
    cancel = st.watch_prefix("/x/node", heard.set)
    time.sleep(2.5)
    assert st.get("/x/node") is not None, "keepalive should hold the key"
    lease.pause()
    deadline = time.monotonic() + 10
    while st.get("/x/node") is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert st.get("/x/node") is None
    assert heard.wait(5)
    cancel()


def test_unreachable_etcd_raises_store_unavailable(etcd):
    st = Store([etcd.endpoint], timeout=1)
    etcd.suspend()
    try:
        with pytest.raises(StoreUnavailable):
            st.get("/x")
    finally:
        etcd.resume()
    # and the same client recovers by itself within a few seconds
    assert wait_until(lambda: st.get("/x") is None, timeout=10), "client did not reconnect"


def _spec(name: str) -> dict:
    return {"name": name, "entrypoint": "train.py:train", "ranks": 2, "steps": 10, "spares": 0, "ranks_per_node": 1,
            "on_no_spare": "wait", "min_ranks": 1, "output_dir": "/tmp", "lease_ttl": 2}


def test_a_controller_that_is_not_leader_cannot_write_a_world(etcd):
    st = Store([etcd.endpoint])
    js = JobStore(st, "fence")
    js.submit(_spec("fence"), b"s")
    lease = st.lease(5)
    for i in range(2):
        js.register_node(Node(f"node{i}", f"inc{i}", "active", 1), lease)
    leader, stale = Controller(st, ident="A"), Controller(st, ident="B")
    assert leader.lead(js)
    assert not stale.lead(js)
    snap = js.snapshot()
    d = decide(snap)
    assert d.action == "place"
    assert not stale.apply(js, snap, d), "a non-leader's decision must be refused"
    assert js.epoch() == 0
    assert leader.apply(js, snap, d)
    assert js.epoch() == 1
    # the same decision applied again is fenced by the epoch revision it was based on
    assert not leader.apply(js, snap, d)


# -- the JobStore verbs: every compare-and-set of the job's keys lives in the store layer --
def _placed_job(st: Store, name: str) -> tuple[JobStore, Lease]:
    """A submitted job with two live nodes; returns it and the nodes' lease."""
    js = JobStore(st, name)
    js.submit(_spec(name), b"s")
    lease = st.lease(5)
    for i in range(2):
        js.register_node(Node(f"node{i}", f"inc{i}", "active", 1), lease)
    return js, lease


def test_fire_once_is_true_for_exactly_one_caller_even_when_they_race(etcd):
    st = Store([etcd.endpoint])
    js = JobStore(st, "fire")
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(js.fire_once(3))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    assert not js.fire_once(3), "a step recomputed after a rollback must not fire again"
    assert js.fire_once(4), "each entry is claimed on its own"


def test_try_lead_takes_a_free_key_once_and_a_standby_leads_after_the_lease_is_revoked(etcd):
    st = Store([etcd.endpoint])
    js = JobStore(st, "lead")
    a_lease, b_lease = st.lease(5), st.lease(5)
    assert js.try_lead("A", a_lease) == (True, True)
    assert js.try_lead("A", a_lease) == (True, False), "holding is not taking again"
    assert js.try_lead("B", b_lease) == (False, False)
    a_lease.revoke()  # the leader dies: its key goes with its lease
    assert js.try_lead("B", b_lease) == (True, True)
    assert js.snapshot().leader == "B"


def test_set_state_is_refused_for_a_non_leader_and_clears_reports_for_the_leader(etcd):
    st = Store([etcd.endpoint])
    js, _ = _placed_job(st, "final")
    assert js.try_lead("A", st.lease(5))[0]
    js.report(Report("node1", 1, 1, "exit", exit_code=1))
    assert not js.set_state(JobState.FAILED, "not mine", leader="B", clear_reports=[("node1", 1)])
    snap = js.snapshot()
    assert (snap.state, len(snap.reports)) == (JobState.PENDING, 1)
    assert js.set_state(JobState.FAILED, "rank 1 died", leader="A", clear_reports=[("node1", 1)])
    snap = js.snapshot()
    assert (snap.state, snap.state_message, snap.reports) == (JobState.FAILED, "rank 1 died", [])


def test_commit_decision_is_refused_for_a_non_leader_and_on_a_stale_epoch(etcd):
    st = Store([etcd.endpoint])
    js, _ = _placed_job(st, "commit")
    assert js.try_lead("A", st.lease(5))[0]
    snap = js.snapshot()
    first = World(1, (Seat("node0", "inc0", 1), Seat("node1", "inc1", 1)), reason="initial placement")
    assert not js.commit_decision(snap, first, leader="B", state=JobState.RUNNING)
    assert (js.epoch(), js.state()[0]) == (0, JobState.PENDING)
    assert js.commit_decision(snap, first, leader="A", state=JobState.RUNNING)
    assert (js.epoch(), js.world(1), js.state()[0]) == (1, first, JobState.RUNNING)
    # a second decision based on the same (now stale) snapshot is refused
    assert not js.commit_decision(snap, first, leader="A")
    running = js.snapshot()
    js.report(Report("node1", 1, 1, "exit", exit_code=1))
    swapped = World(2, (first.seats[0], Seat("node0", "inc0", 2)), reason="rank 1 died", lost=(1,))
    assert js.commit_decision(running, swapped, leader="A", clear_reports=[("node1", 1)])
    snap = js.snapshot()
    assert (snap.epoch, snap.world, snap.reports) == (2, swapped, [])
    assert snap.state is JobState.RUNNING, "only the first world sets the state"


def test_an_agent_learns_each_new_world_from_its_change_and_reads_it_whole_only_when_it_must(etcd):
    """agent_snapshot(previous) gives the world a full read gives, at every kind of decision,
    and reads the world record only for the first world, a shrink (most seats renumbered), a
    missed epoch, and an epoch key rewritten since (a resubmitted name counts epochs again)."""
    st = Store([etcd.endpoint])
    js, _ = _placed_job(st, "change")
    assert js.try_lead("A", st.lease(5))[0]
    read: list[str] = []
    get = st.get
    st.get = lambda key: (read.append(key), get(key))[1]  # type: ignore[method-assign]
    seats = tuple(Seat(f"node{i % 2}", f"inc{i % 2}", 1) for i in range(8))

    def decide_and_follow(world: World, previous) -> tuple:
        assert js.commit_decision(js.snapshot(), world, leader="A", state=JobState.RUNNING)
        assert js.snapshot().world == world
        read.clear()
        snap = js.agent_snapshot("node0", previous)
        assert snap.world == world
        return snap, [k for k in read if "/world/" in k]

    snap, whole = decide_and_follow(World(1, seats, reason="initial placement"), None)
    assert whole == [js.keys.world(1)], "the first world is read whole"
    swapped = World(2, seats[:3] + (Seat("spare", "incS", 2, sid=3),) + seats[4:], reason="rank 3", lost=(3,))
    snap2, whole = decide_and_follow(swapped, snap)
    assert whole == [] and snap2.world_change.seats == {3: swapped.seats[3]}, "a swap: one seat's change"
    moved = get(js.keys.world_change)  # what the agent's watch on it delivers
    read.clear()
    followed = js.follow_change(snap, moved)
    assert followed.world == swapped and followed.epoch_mod == snap2.epoch_mod and read == []
    assert js.follow_change(snap2, moved) is None, "a change already applied is not applied again"
    again = js.agent_snapshot("node0", snap2)
    assert again.world is snap2.world and not [k for k in read if "/world/" in k], "same epoch: reused"
    grown = World(3, swapped.seats + (Seat("node1", "inc1", 3, sid=8),), reason="grow", grown_from=8)
    snap3, whole = decide_and_follow(grown, snap2)
    assert whole == [] and snap3.world.size == 9
    shrunk = World(4, tuple(Seat("node0", "inc0", 4, sid=s.sid if s.sid >= 0 else r)
                            for r, s in enumerate(grown.seats[:6])), reason="shrink", shrunk_from=9)
    snap4, whole = decide_and_follow(shrunk, snap3)
    assert whole == [js.keys.world(4)] and snap4.world_change.base == 0, "most seats changed: read whole"
    five = World(5, shrunk.seats[:5] + (Seat("node1", "inc1", 5, sid=5),), reason="rank 5")
    assert js.commit_decision(js.snapshot(), five, leader="A")
    six = World(6, five.seats[:4] + (Seat("node1", "inc1", 6, sid=4),) + five.seats[5:], reason="rank 4")
    snap6, whole = decide_and_follow(six, snap4)
    assert whole == [js.keys.world(6)], "epoch 5 was missed: its change does not apply to epoch 4"
    assert js.follow_change(snap4, get(js.keys.world_change)) is None
    st.put(js.keys.epoch, "6")  # same number, written again: not the world this agent holds
    read.clear()
    assert js.agent_snapshot("node0", snap6).world == six and read == [js.keys.world(6)]


def test_clear_reports_is_fenced_like_a_decision(etcd):
    st = Store([etcd.endpoint])
    js, _ = _placed_job(st, "clear")
    assert js.try_lead("A", st.lease(5))[0]
    js.report(Report("node1", 1, 0, "exit", exit_code=1))
    snap = js.snapshot()
    assert js.clear_reports(snap, [], leader="B"), "nothing to delete is no refusal"
    assert not js.clear_reports(snap, [("node1", 1)], leader="B")
    assert len(js.snapshot().reports) == 1
    st.put(js.keys.epoch, "1")  # the world moved on since the snapshot
    assert not js.clear_reports(snap, [("node1", 1)], leader="A")
    assert len(js.snapshot().reports) == 1
    assert js.clear_reports(js.snapshot(), [("node1", 1)], leader="A")
    assert js.snapshot().reports == []


def test_request_checkpoint_is_visible_in_the_snapshot(etcd):
    st = Store([etcd.endpoint])
    js, _ = _placed_job(st, "ckpt")
    assert js.snapshot().checkpoint is None
    js.request_checkpoint(40)
    assert js.snapshot().checkpoint == 40
    js.request_checkpoint(50)
    assert js.snapshot().checkpoint == 50


def test_the_controller_writes_the_timeline_through_the_event_constructors(etcd):
    """A place then a swap: the events carry the data keys the recovery timeline reads."""
    st = Store([etcd.endpoint])
    js, _ = _placed_job(st, "events")
    ctl = Controller(st, ident="A")
    assert ctl.reconcile_once("events").action == "place"
    st.put(js.keys.node("spare0"), Node("spare0", "inc-s", "spare", 1).to_json())
    js.report(Report("node1", 1, 1, "exit", exit_code=9, time=123.0))
    d = ctl.reconcile_once("events")
    assert d.action == "swap" and d.spares == ("spare0",)
    evs = {e.kind: e for e in js.events()}
    assert evs["leader"].data == {"controller": "A"} and evs["leader"].source == "A"
    assert evs["placed"].data == {"epoch": 1, "seats": ["node0", "node1"]}
    fail = evs["failure"]
    assert fail.source == "controller" and fail.message == "rank 1 on node1: worker died (exit code 9)"
    assert fail.data == {"rank": 1, "node": "node1", "kind": "exit", "epoch": 2, "spare": "spare0",
                         "detected": 123.0, "step": -1, "error": ""}
    swap = evs["swap"]
    assert (swap.message, swap.data["epoch"], swap.data["lost"], swap.data["spares"]) == (
        d.reason, 2, [1], ["spare0"])
    assert set(swap.data) == {"epoch", "lost", "spares", "decided"}


def test_the_controller_records_each_handled_failure_with_its_decision(etcd):
    """A swap writes the failure history with the new world; a code error fails the job and
    keeps its traceback as the state's evidence, with the history, in the same transaction."""
    st = Store([etcd.endpoint])
    js, _ = _placed_job(st, "history")
    ctl = Controller(st, ident="A")
    assert ctl.reconcile_once("history").action == "place"
    st.put(js.keys.node("spare0"), Node("spare0", "inc-s", "spare", 1).to_json())
    js.report(Report("node1", 1, 1, "signal", signal=9, time=100.0, step=4))
    assert ctl.reconcile_once("history").action == "swap"
    snap = js.snapshot()
    assert [(f.rank, f.sid, f.node, f.kind, f.step, f.epoch, f.time) for f in snap.failures] == [
        (1, 1, "node1", "signal", 4, 1, 100.0)]
    tb = "Traceback (most recent call last):\n  File \"train.py\", line 3, in train\nValueError: boom"
    js.report(Report("spare0", 1, 2, "error", exit_code=1, time=200.0, step=7, traceback=tb,
                     message="worker pid 5 raised ValueError: boom"))
    d = ctl.reconcile_once("history")
    assert d.action == "fail" and d.error == tb
    snap = js.snapshot()
    assert snap.state is JobState.FAILED and snap.state_error == tb
    assert snap.state_message == d.reason and "rank 1 on spare0 raised at step 7: ValueError: boom" in d.reason
    assert [(f.node, f.kind, f.step, f.epoch) for f in snap.failures] == [("node1", "signal", 4, 1),
                                                                          ("spare0", "error", 7, 2)]
    assert snap.reports == [], "the handled report went with the decision"
    [last] = [e for e in js.events() if e.kind == "failure" and e.data.get("ended_job")]
    assert (last.data["step"], last.data["error"], last.data["spare"]) == (7, "ValueError: boom", None)



def test_a_missing_or_short_job_secret_fails_closed(etcd):
    """Security review F15: a missing secret used to come back as b"" -- an HMAC key anyone
    can compute -- and the replica wire ran with it. Now it is an error that says why."""
    from hotspare.orchestrator.store.job import MissingSecret

    st = Store([etcd.endpoint])
    js = JobStore(st, "nosecret")
    with pytest.raises(MissingSecret, match="no usable secret in etcd .none"):
        js.secret()
    st.put(js.keys.secret, b"short")
    with pytest.raises(MissingSecret, match="5 bytes"):
        js.secret()
    st.put(js.keys.secret, b"k" * 32)
    assert js.secret() == b"k" * 32


def test_events_are_read_by_revision_so_a_late_event_with_an_older_time_is_not_missed(etcd):
    """`hotspare run` reads only new events (issue 15): by etcd revision, not by key."""
    from hotspare.orchestrator.store import Event, JobStore, Store

    js = JobStore(Store([etcd.endpoint]), "follow")
    js.put_event(Event(time=2000.0, kind="a", source="x", message="first", data={}))
    first, rev = js.events_since(0)
    assert [e.message for e in first] == ["first"]
    assert js.events_since(rev)[0] == []
    # queued through an outage: written now, stamped with an older time (sorts before "first")
    js.put_event(Event(time=1000.0, kind="a", source="x", message="late", data={}))
    late, _ = js.events_since(rev)
    assert [e.message for e in late] == ["late"]


def _counting(st: Store) -> list[str]:
    """The requests ``st`` makes from now on, by name."""
    made: list[str] = []
    call = st._call

    def counted(what, fn):
        made.append(what)
        return call(what, fn)

    st._call = counted  # type: ignore[method-assign]
    return made


def test_a_snapshot_is_two_requests_and_its_leader_needs_no_third(etcd):
    """The controller's round: the job's keys and the progress records in one transaction,
    then the current world; whether it leads is answered from that snapshot."""
    st = Store([etcd.endpoint])
    js = JobStore(st, "two")
    js.put_progress(Progress(rank=0, step=7, epoch=1, node="n0", time=1.0))
    lease, other = st.lease(5), st.lease(5)
    assert js.try_lead("A", lease) == (True, True)
    made = _counting(st)
    snap = js.snapshot()
    assert snap.progress[0].step == 7 and snap.leader == "A"
    assert js.try_lead("A", lease, snap) == (True, False)
    assert js.try_lead("B", other, snap) == (False, False)
    assert made == ["get_many"], "a job without an epoch has no world to read; the leader came with it"


def test_hotspare_run_follows_progress_from_its_watch_without_reading_it(etcd):
    from hotspare.orchestrator.commands.jobs import _Feed

    st = Store([etcd.endpoint])
    js = JobStore(st, "feed")
    feed = _Feed(js)
    try:
        snap, _ = feed.read()
        assert snap.progress == {}
        made = _counting(st)
        js.put_progress(Progress(rank=1, step=41, epoch=1, node="n1", time=2.0))
        assert wait_until(lambda: feed.read()[0].progress.get(1) is not None, timeout=10)
        assert feed.read()[0].progress[1].step == 41
        assert [m.split()[0] for m in made] == ["put"], f"progress came from the watch, no read: {made}"
    finally:
        feed.close()
