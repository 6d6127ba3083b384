"""The epoch rendezvous store (``orchestrator/store/c10d.py``) against a real etcd, with real gloo
groups: correct, O(N) etcd requests per rendezvous (issue 15), abortable, and never stale
where it must not be (counters, rewritten keys)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hotspare.orchestrator.store import Store, c10d
from hotspare.orchestrator.store.c10d import EtcdC10dStore, RendezvousAborted

pytestmark = pytest.mark.timeout(120)

#: etcd requests one rank may cost a rendezvous: its put, one read of the directory, a watch
#: created and cancelled (whatever N is, and whatever the order in which ranks arrive)
PER_RANK = 4


@pytest.fixture
def unhurried(monkeypatch):
    """Counting requests, not timing them: a rank slowed down by a busy machine must not make a
    safety read (one per 2 s of waiting) or outlive its watch's linger (another watch) and so
    fail a bound that is about N."""
    monkeypatch.setattr(c10d, "SAFETY_READ_S", 60.0)
    monkeypatch.setattr(c10d, "WATCH_LINGER_S", 60.0)


class CountingStore(Store):
    """A Store whose every etcd request (they all go through ``Store._call``) is counted by verb."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def _call(self, what, fn):
        with self._count_lock:
            self.counts[what.split(" ", 1)[0]] += 1
        return super()._call(what, fn)


def build_group(endpoint: str, prefix: str, n: int, stagger: float = 0.0):
    """N ranks (threads, each with its own etcd connection, as processes have) build one gloo
    group through EtcdC10dStore on ``prefix`` and allreduce rank+1; rank r starts after
    ``r * stagger`` s. Returns (results by rank, etcd requests by verb, summed over the ranks)."""
    conns = [CountingStore([endpoint]) for _ in range(n)]
    stores = [EtcdC10dStore(conns[r], prefix, timeout=timedelta(seconds=30)) for r in range(n)]
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            time.sleep(r * stagger)
            pg = dist.ProcessGroupGloo(stores[r], r, n, timedelta(seconds=30))
            t = torch.full((3,), float(r + 1))
            pg.allreduce([t]).wait()
            results[r] = t.tolist()
        except Exception as e:  # noqa: BLE001 - checked by the caller
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in stores:
        s.close()  # the watches' cancels are counted too (they also end by themselves, after a linger)
    counts: Counter[str] = Counter()
    for c in conns:
        counts.update(c.counts)
        c.close()
    return results, counts


@pytest.mark.parametrize("stagger", [0.0, 0.05], ids=["together", "one-after-another"])
def test_a_gloo_group_of_4_allreduces_through_etcd_at_a_cost_linear_in_n(etcd, unhurried, stagger):
    n = 4
    results, counts = build_group(etcd.endpoint, f"/t/rdzv/{stagger}/epoch/1", n, stagger)
    assert results == {r: [n * (n + 1) / 2] * 3 for r in range(n)}, results
    assert counts["put"] == n
    total = sum(counts.values())
    assert total <= PER_RANK * n, f"{total} etcd requests for a rendezvous of {n}: {dict(counts)}"


def test_the_cost_per_rank_does_not_grow_with_n(etcd, unhurried):
    """8 ranks arriving one after another (each finds keys missing and waits for them): still at
    most PER_RANK requests each (the store before issue 15 made 3N + 1 per rank, plus polls)."""
    n = 8
    results, counts = build_group(etcd.endpoint, "/t/rdzv8/epoch/1", n, stagger=0.03)
    assert all(results[r] == [n * (n + 1) / 2] * 3 for r in range(n)), results
    total = sum(counts.values())
    assert total <= PER_RANK * n, f"{total} etcd requests for a rendezvous of {n}: {dict(counts)}"
    assert counts["get"] == 0, "no key is read on its own: a directory is read in one request"


def test_a_superseded_rendezvous_aborts_promptly_and_beats_while_it_waits(etcd):
    st = Store([etcd.endpoint])
    superseded = threading.Event()
    beats: list[float] = []
    store = EtcdC10dStore(st, "/t/abort/epoch/1", timeout=timedelta(seconds=30),
                          should_abort=superseded.is_set, on_wait=lambda: beats.append(time.monotonic()))
    store.set("0/0", b"addr0")
    threading.Timer(0.5, superseded.set).start()
    t0 = time.monotonic()
    with pytest.raises(RendezvousAborted, match="superseded"):
        store.get("0/1")  # rank 1 never comes; a newer epoch does
    took = time.monotonic() - t0
    assert 0.45 < took < 1.5, took
    assert len(beats) >= 5, "on_wait (the heartbeat) must be called all along the wait"
    store.close()
    st.close()


def test_a_superseded_gloo_construction_ends_with_the_abort(etcd):
    """Through gloo's constructor (the C++ side calls the store): the abort comes out of it."""
    st = Store([etcd.endpoint])
    superseded = threading.Event()
    store = EtcdC10dStore(st, "/t/abort-gloo/epoch/1", timeout=timedelta(seconds=30), should_abort=superseded.is_set)
    threading.Timer(0.3, superseded.set).start()
    t0 = time.monotonic()
    with pytest.raises(Exception, match="superseded"):
        dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=30))
    assert time.monotonic() - t0 < 2
    store.close()
    st.close()


def test_a_wait_that_times_out_says_what_it_waited_for(etcd):
    st = Store([etcd.endpoint])
    store = EtcdC10dStore(st, "/t/timeout/epoch/3")
    with pytest.raises(TimeoutError, match=r"rendezvous timed out after 0s waiting for \['k'\] under /t/timeout/epoch/3/"):
        store.wait(["k"], timedelta(milliseconds=300))
    store.close()
    st.close()


def test_add_counters_are_never_stale(etcd):
    """Two stores add concurrently (each its own connection); a third only reads. Every read of
    the counter, before and after, is etcd's value: a counter is never served from a cache."""
    conns = [Store([etcd.endpoint]) for _ in range(3)]
    a, b, reader = (EtcdC10dStore(c, "/t/add/epoch/1") for c in conns)
    assert a.add("count", 1) == 1
    assert reader.get("count") == b"1"  # written once so far: it would be cached if counters were
    assert reader.check(["count"])

    def adder(s: EtcdC10dStore) -> None:
        for _ in range(40):
            s.add("count", 1)

    threads = [threading.Thread(target=adder, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert a.add("count", 0) == b.add("count", 0) == 81
    assert reader.get("count") == a.get("count") == b"81"
    reader.wait(["count"])
    assert b.add("count", -1) == 80 and reader.get("count") == b"80"
    for c in conns:
        c.close()


def test_a_key_written_more_than_once_is_always_read_from_etcd(etcd):
    conns = [Store([etcd.endpoint]) for _ in range(2)]
    writer, reader = (EtcdC10dStore(c, "/t/rewrite/epoch/1") for c in conns)
    writer.set("k", b"first")
    writer.set("k", b"second")  # rewritten before the reader's first read: never cached
    assert reader.get("k") == b"second"
    writer.set("k", b"third")
    assert reader.get("k") == b"third"
    writer.set("once", b"x")
    assert reader.get("once") == b"x"
    reader.set("once", b"y")  # this store rewrites a key it had cached: etcd's from now on
    assert reader.get("once") == b"y"
    writer.set("once", b"z")
    assert reader.get("once") == b"z"
    for c in conns:
        c.close()


def test_write_once_values_are_read_once(etcd, unhurried):
    conn = CountingStore([etcd.endpoint])
    writer = EtcdC10dStore(Store([etcd.endpoint]), "/t/once/epoch/1")
    for r in range(6):
        writer.set(f"0/{r}", f"addr{r}".encode())
    store = EtcdC10dStore(conn, "/t/once/epoch/1")
    for _ in range(3):
        for r in range(6):
            store.wait([f"0/{r}"])
            assert store.get(f"0/{r}") == f"addr{r}".encode()
    assert store.check([f"0/{r}" for r in range(6)])
    assert dict(conn.counts) == {"get_prefix": 1}


def test_a_watch_lost_with_etcd_costs_time_not_the_rendezvous(etcd, tmp_path):
    """etcd restarts while a rank waits on its watch: the stream breaks, the store reads again
    (polling while etcd is away), watches again, and the key written afterwards ends the wait."""
    st = Store([etcd.endpoint])
    store = EtcdC10dStore(st, "/t/restart/epoch/1", timeout=timedelta(seconds=60))
    box: dict[str, object] = {}

    def waiter() -> None:
        try:
            box["value"] = store.get("0/1")
        except Exception as e:  # noqa: BLE001 - checked below
            box["error"] = e

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)  # the waiter has read and is watching
    etcd.stop()
    etcd.start(log_path=tmp_path / "etcd2.log")
    etcd.wait_ready()
    other = Store([etcd.endpoint])
    EtcdC10dStore(other, "/t/restart/epoch/1").set("0/1", b"late")
    t.join(30)
    assert box == {"value": b"late"}
    store.close()
    st.close()
    other.close()


def test_watches_end_by_themselves_after_the_linger(etcd, monkeypatch):
    monkeypatch.setattr(c10d, "WATCH_LINGER_S", 0.3)
    conn = CountingStore([etcd.endpoint])
    store = EtcdC10dStore(conn, "/t/linger/epoch/1")
    threading.Timer(0.3, lambda: EtcdC10dStore(Store([etcd.endpoint]), "/t/linger/epoch/1").set("k", b"v")).start()
    assert store.get("k") == b"v"  # waited on a watch
    assert conn.counts["watch"] == 1
    deadline = time.monotonic() + 5
    while conn.counts["cancel_watch"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert conn.counts["cancel_watch"] == 1
    conn.close()
