"""Training through failures ends bit-identical to training without them.

The demo workload (examples/gpt.py: a small GPT with AdamW, an LR schedule, dropout and a
stateful data stream) runs once undisturbed, then under each failure; every tensor of
every rank's final state (parameters, optimizer moments, RNG states) and every
component's JSON state (data position, scheduler, RNG) must be equal.
"""

from __future__ import annotations

import pytest
import torch

from hotspare.recovery import load_final

from ..conftest import EXAMPLES

pytestmark = pytest.mark.timeout(400)

STEPS = 60


def gpt_spec(cluster, name: str, **fields):
    """The demo workload, small: 3 ranks + 1 spare, STEPS steps."""
    base = {
        "name": name,
        "entrypoint": str(EXAMPLES / "gpt.py") + ":train",
        "ranks": 3,
        "spares": 1,
        "steps": STEPS,
        "lease_ttl": 2,
        "hang_timeout": 10,
        "args": {"n_layer": 1, "n_embd": 32, "block_size": 32},
        "output_dir": str(cluster.tmp / "out" / name),
    }
    base.update(fields)
    return cluster.spec_file(**base)


def run_ok(cluster, name: str, **fields) -> dict:
    summary, r = cluster.run_json(str(gpt_spec(cluster, name, **fields)))
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-3000:]
    return summary


def assert_identical(reference, output_dir, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """The final state in ``output_dir`` equals ``reference`` tensor for tensor (the names in
    ``skip`` must exist on both sides but may differ) and in its JSON state."""
    got = load_final(output_dir)
    assert got.manifest["world_size"] == reference.manifest["world_size"]
    for r, tensors in reference.ranks.items():
        assert set(got.ranks[r]) == set(tensors), f"rank {r}: different tensors"
        diff = [k for k, t in tensors.items() if k not in skip and not torch.equal(t, got.ranks[r][k])]
        assert not diff, f"rank {r}: {len(diff)} tensors differ, e.g. {diff[:4]}"
        assert got.meta[r] == reference.meta[r], f"rank {r}: JSON state differs"
    # the run really trained: Adam moments exist and parameters moved from init
    assert any(k.startswith("optimizer/") for k in reference.ranks[0])


def test_worker_kill_mid_run_ends_bit_identical(cluster, reference):
    cluster.controller()
    s = run_ok(cluster, "kill", chaos=[{"at_step": 30, "action": "kill-rank", "rank": 1}])
    [rec] = s["recoveries"]
    assert rec["spare_node"] == "spare0"
    assert_identical(reference, cluster.tmp / "out" / "kill")
    restored = [e for e in cluster.job("kill").events() if e.kind == "restored" and e.data["epoch"] == 2]
    by_rank = {e.data["rank"]: e.data for e in restored}
    assert by_rank[1]["source"].startswith("replica on") and by_rank[1]["bytes"] > 0
    assert by_rank[0]["source"].startswith("own snapshot") and by_rank[0]["bytes"] == 0


def test_node_loss_ends_bit_identical_from_the_buddy_replica(cluster, reference):
    cluster.controller()
    s = run_ok(cluster, "node", chaos=[{"at_step": 25, "action": "kill-node", "rank": 0}])
    assert [r["kind"] for r in s["recoveries"]] == ["node-loss"]
    assert_identical(reference, cluster.tmp / "out" / "node")
    [r0] = [e for e in cluster.job("node").events()
            if e.kind == "restored" and e.data["epoch"] == 2 and e.data["rank"] == 0]
    assert r0.data["source"] == "replica on node1"  # node0's ring buddy; node0 itself is gone


def test_only_the_candidates_the_ranks_agree_on_become_points(cluster, reference):
    """With a replicate_interval no run reaches, the ranks' vote makes a point of the
    persist_every steps only (and the initial state): a node lost at step 45 rolls every
    rank back to step 40, the newest such point -- not 44, the newest candidate -- and the
    result is still bit-identical."""
    cluster.controller()
    run_ok(cluster, "agreed", replicate_every=2, replicate_interval=1000, persist_every=20,
           chaos=[{"at_step": 45, "action": "kill-node", "rank": 0}])
    assert_identical(reference, cluster.tmp / "out" / "agreed")
    restored = [e for e in cluster.job("agreed").events() if e.kind == "restored" and e.data["epoch"] == 2]
    assert {e.data["restore_step"] for e in restored} == {40}, [e.data for e in restored]
    [r0] = [e for e in restored if e.data["rank"] == 0]
    assert r0.data["source"] == "replica on node1"


def test_kill_while_a_snapshot_copy_is_in_flight_ends_bit_identical(cluster, reference):
    cluster.controller()
    # every background copy takes >= 0.2 s, so the kill at the start of step 30 lands
    # while step 29's copy is still being written
    run_ok(cluster, "inflight", env={"HOTSPARE_TEST_SNAPSHOT_DELAY": "0.2"},
           chaos=[{"at_step": 30, "action": "kill-rank", "rank": 2}])
    assert_identical(reference, cluster.tmp / "out" / "inflight")
    restored = [e for e in cluster.job("inflight").events() if e.kind == "restored" and e.data["epoch"] == 2]
    # the dead worker's half-written step 29 is never offered: everyone resumes after 28,
    # rank 2 from the complete slot its dead worker left in shared memory on node2
    assert {e.data["restore_step"] for e in restored} == {28}
    [r2] = [e for e in restored if e.data["rank"] == 2]
    assert r2.data["source"] == "replica on node2"


def test_two_failures_at_different_steps_end_bit_identical(cluster, reference):
    cluster.controller()
    s = run_ok(cluster, "twice", chaos=[{"at_step": 20, "action": "kill-rank", "rank": 0},
                                         {"at_step": 45, "action": "kill-rank", "rank": 2}])
    assert [r["failed_rank"] for r in s["recoveries"]] == [0, 2]
    assert_identical(reference, cluster.tmp / "out" / "twice")


def test_replica_holder_dying_first_then_its_ward_ends_bit_identical(cluster, reference):
    # ring: node0 -> node1 -> node2 -> node0. node2 holds node1's replicas and dies first;
    # replication must move to the new ring before node1 itself dies.
    cluster.controller()
    s = run_ok(cluster, "holder", spares=2,
               chaos=[{"at_step": 15, "action": "kill-node", "rank": 2},
                      {"at_step": 45, "action": "kill-node", "rank": 1}])
    assert [(r["failed_node"], r["kind"]) for r in s["recoveries"]] == [
        ("node2", "node-loss"), ("node1", "node-loss")]
    assert_identical(reference, cluster.tmp / "out" / "holder")
