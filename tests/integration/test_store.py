"""The store against a real etcd: CAS fencing, leases, watches, error translation."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.controller import Controller
from orchestrator.decide import decide
from orchestrator.store import (
    Compare,
    JobStore,
    Node,
    Store,
    StoreUnavailable,
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
