"""Two jobs on one etcd and one controller stay apart: keys, failures, cancellation.

The job names are prefixes of each other (``a`` and ``a-b``) on purpose: every key prefix a
job reads ends in '/', so a prefix read of ``a`` never returns ``a-b``'s keys.
"""

from __future__ import annotations

import re

import pytest

from hotspare.orchestrator.store import JobKeys

pytestmark = pytest.mark.timeout(240)

JOBS = ("a", "a-b")
KEY = re.compile(r"^/hotspare(?:-events|-progress|-rdzv)?/([a-z0-9-]+)/")


def _owner_of_every_key(store) -> dict[str, str]:
    """Every key in the etcd -> the job its prefix names (fails on a key outside a job)."""
    kvs, _ = store.get_prefix("/")
    owners = {}
    for kv in kvs:
        m = KEY.match(kv.key)
        assert m and m.group(1) in JOBS, f"key outside a job's prefixes: {kv.key}"
        owners[kv.key] = m.group(1)
    return owners


def _assert_prefix_reads_stay_in_their_job(store) -> None:
    for job in JOBS:
        k = JobKeys(job)
        for prefix in (k.prefix, k.events_prefix, k.progress_prefix, k.rdzv_prefix):
            assert prefix.endswith(f"/{job}/"), prefix
            kvs, _ = store.get_prefix(prefix)
            assert all(KEY.match(kv.key).group(1) == job for kv in kvs), [kv.key for kv in kvs]


def _wait(cluster, pred, what: str, *jobs) -> None:
    """cluster.wait, but a timeout shows the jobs' recent events (what was going on)."""
    try:
        cluster.wait(pred, what=what)
    except AssertionError as e:
        tails = [f"{js.job}: " + "; ".join(f"{ev.kind} {ev.message}" for ev in js.events()[-12:]) for js in jobs]
        raise AssertionError(f"{e}\n" + "\n".join(tails)) from None


def test_two_jobs_on_one_etcd_never_see_each_others_keys_failures_or_cancellation(cluster):
    cluster.controller()
    a = cluster.spec_file(name="a", ranks=2, steps=400, args={"step_sleep": 0.03})
    b = cluster.spec_file(name="a-b", ranks=2, steps=250, args={"step_sleep": 0.05})
    cluster.hotspare("submit", str(a), check=True)
    cluster.hotspare("submit", str(b), check=True)
    ja, jb = cluster.job("a"), cluster.job("a-b")

    def running(js, step: int) -> bool:
        snap = js.snapshot()
        return len(snap.progress) == 2 and min(p.step for p in snap.progress.values()) >= step

    _wait(cluster, lambda: running(ja, 3) and running(jb, 3), "both jobs training", ja, jb)
    cluster.hotspare("chaos", "a", "--action", "kill-rank", "--rank", "1", check=True)
    _wait(cluster, lambda: any(e.kind == "resumed" and e.data.get("epoch") == 2 for e in ja.events()),
          "job a resumed at epoch 2", ja, jb)

    owners = _owner_of_every_key(cluster.store)
    assert set(owners.values()) == set(JOBS)
    _assert_prefix_reads_stay_in_their_job(cluster.store)
    snap_a, snap_b = ja.snapshot(), jb.snapshot()
    assert (snap_a.epoch, snap_b.epoch) == (2, 1)
    # same node names in both jobs, but each job sees only its own agents
    assert {n.incarnation for n in snap_a.nodes.values()}.isdisjoint(n.incarnation for n in snap_b.nodes.values())
    assert {"chaos", "failure", "swap", "worker-exit"} <= {e.kind for e in ja.events()}
    assert not [e for e in jb.events() if e.kind in ("chaos", "failure", "swap", "worker-exit")]

    cluster.hotspare("cancel", "a", check=True)
    _wait(cluster, lambda: ja.state()[0].value == "cancelled", "job a cancelled", ja, jb)
    assert not jb.state()[0].terminal, "job a-b ended with job a"
    r = cluster.hotspare("wait", "a-b", "--timeout", "180")
    assert r.returncode == 0 and "succeeded" in r.stdout, r.stdout + r.stderr
    assert jb.epoch() == 1 and len(jb.snapshot().done) >= 1
    assert [e.message for e in jb.events() if e.kind == "submitted"] == [
        "job a-b: 2 ranks + 1 spare node(s), 250 steps on local"]
    assert not [e for e in jb.events() if e.kind in ("chaos", "failure", "swap", "cancelled")]
    _assert_prefix_reads_stay_in_their_job(cluster.store)
    # re-using the finished job a's name deletes a's old records, and only a's. First let
    # a-b's agents finish leaving: their node keys live under their leases and go with them
    cluster.wait(lambda: not jb.snapshot().nodes, timeout=60, what="job a-b's agents gone")
    keys_b = {k for k, job in _owner_of_every_key(cluster.store).items() if job == "a-b"}
    ja.submit(ja.spec(), b"\0" * 32)
    assert {k for k, job in _owner_of_every_key(cluster.store).items() if job == "a-b"} == keys_b
    assert not cluster.store.get_prefix(ja.keys.progress_prefix)[0]
