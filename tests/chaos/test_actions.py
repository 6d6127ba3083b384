"""Each chaos action, delivered through etcd, has the effect its help text promises."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.timeout(300)


def _status(cluster, job: str) -> dict:
    r = cluster.hotspare("status", job, "--json", check=True)
    return json.loads(r.stdout)


def _pids_per_seat(events) -> dict[tuple[int, int], set[int]]:
    out: dict[tuple[int, int], set[int]] = {}
    for e in events:
        if e.kind == "rebuilt":
            out.setdefault((e.data["epoch"], e.data["rank"]), set()).add(e.data["pid"])
    return out


def test_slow_rank_is_reported_as_straggler_and_left_running(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="slow", steps=1_000_000, args={"step_sleep": 0.005})
    cluster.hotspare("submit", str(spec), check=True)
    js = cluster.job("slow")
    cluster.wait(lambda: any(p.step >= 20 for p in js.snapshot().progress.values()), what="step 20")
    r = cluster.hotspare("chaos", "slow", "--action", "slow-rank", "--rank", "1", "--seconds", "0.05", check=True)
    assert "node1" in r.stdout
    cluster.wait(lambda: [x["state"] for x in _status(cluster, "slow")["ranks"]] == ["running", "straggler", "running"],
                 timeout=60, what="rank 1 flagged as straggler")
    st = _status(cluster, "slow")
    assert st["ranks"][1]["straggler_score"] >= 2.0
    human = cluster.hotspare("status", "slow", check=True).stdout
    assert "straggler" in human and "score" in human
    # --seconds 0 clears the delay: the rank catches up and is no longer flagged
    cluster.hotspare("chaos", "slow", "--action", "slow-rank", "--rank", "1", "--seconds", "0", check=True)
    cluster.wait(lambda: [x["state"] for x in _status(cluster, "slow")["ranks"]] == ["running"] * 3,
                 timeout=60, what="rank 1 no longer flagged")
    cluster.hotspare("cancel", "slow", check=True)
    cluster.wait(lambda: js.snapshot().state.terminal, timeout=60, what="job end")
    snap = js.snapshot()
    assert snap.state.value == "cancelled" and snap.epoch == 1, "a straggler is not replaced by default"
    assert not [e for e in js.events() if e.kind == "swap"]
    assert any(e.kind == "chaos" and e.data.get("action") == "slow-rank" for e in js.events())


def test_straggler_is_replaced_when_the_spec_says_so(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="slowrep", steps=400, on_straggler="replace", straggler_threshold=3,
                             args={"step_sleep": 0.005},
                             chaos=[{"at_step": 30, "action": "slow-rank", "rank": 2, "seconds": 0.06}])
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-2000:]
    [rec] = summary["recoveries"]
    assert rec["kind"] == "straggler" and rec["failed_rank"] == 2 and rec["spare_node"] == "spare0"


def test_partitioned_node_is_fenced_out_and_rejoins_as_a_new_node(cluster):
    cluster.controller()
    # then rank 0 dies: the only spare left is node1 itself, back as a new incarnation, and
    # its warm worker (started before node1 re-registered) takes the rank without being fenced
    spec = cluster.spec_file(name="part", steps=400, lease_ttl=2,
                             chaos=[{"at_step": 40, "action": "partition-node", "rank": 1, "seconds": 5},
                                    {"at_step": 300, "action": "kill-rank", "rank": 0}])
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-2000:]
    rec, rec2 = summary["recoveries"]
    assert rec["failed_node"] == "node1" and rec["kind"] == "node-loss"
    assert rec2["failed_rank"] == 0 and rec2["spare_node"] == "node1", summary["recoveries"]
    events = cluster.job("part").events()
    joins = [e.data["incarnation"] for e in events if e.kind == "node-joined" and e.data["node"] == "node1"]
    assert len(joins) == 2 and joins[0] != joins[1], "node1 must come back as a new incarnation"
    for seat, pids in _pids_per_seat(events).items():
        assert len(pids) == 1, f"two workers held rank {seat[1]} in epoch {seat[0]}: {pids}"
    # the partitioned worker never joined a later epoch
    old = [e.data["pid"] for e in events if e.kind == "rebuilt" and e.data["epoch"] == 1 and e.data["rank"] == 1]
    assert not [e for e in events if e.kind == "rebuilt" and e.data["epoch"] > 1 and e.data["pid"] in old]


def test_kill_controller_hands_the_job_to_the_standby(cluster):
    cluster.controller()
    time.sleep(1.0)
    cluster.controller()
    spec = cluster.spec_file(name="killctl", steps=300,
                             chaos=[{"at_step": 40, "action": "kill-controller"},
                                    {"at_step": 200, "action": "kill-rank", "rank": 0}])
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-2000:]
    events = cluster.job("killctl").events()
    assert any(e.kind == "chaos" and e.data.get("action") == "kill-controller" and e.source != "rank0"
               for e in events), "the leader itself records that it is dying"
    leaders = [e.data["controller"] for e in events if e.kind == "leader"]
    assert len(leaders) == 2 and leaders[0] != leaders[1]
    assert [x["failed_rank"] for x in summary["recoveries"]] == [0]
    assert sum(p.poll() is None for p in cluster.procs) == 1, "exactly one controller was killed"
