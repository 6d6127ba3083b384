"""A rank and the node holding its only replica are lost together: no peer has the rank's
state any more, so every rank rolls back to the newest complete persisted checkpoint, and
the job still ends bit-identical to the undisturbed reference run."""

from __future__ import annotations

from recovery import persist

from .test_exact_recovery import assert_identical, run_ok


def test_rank_and_its_replica_holder_lost_together_restore_from_the_persistent_tier(cluster, reference):
    cluster.controller()
    # ring buddies: rank 1's node replicates to rank 2's node. Both die at step 35: rank 1's
    # state survives only in the checkpoint of step 20 (persist_every 20).
    s = run_ok(cluster, "persist", spares=2, persist_every=20, persist_local_dir=str(cluster.tmp / "ssd"),
               chaos=[{"at_step": 35, "action": "kill-node", "rank": 1},
                      {"at_step": 35, "action": "kill-node", "rank": 2}])
    assert s["recoveries"], s
    js = cluster.job("persist")
    events = js.events()
    persisted = [e for e in events if e.kind == "persisted"]
    assert persisted and persisted[0].data["step"] == 20
    after = {e.data["rank"]: e.data for e in events if e.kind == "restored" and e.data["epoch"] >= 2}
    assert set(after) == {0, 1, 2}, after
    for r, d in after.items():
        assert d["source"].startswith("persisted checkpoint"), (r, d)
        assert d["restore_step"] in (20, 40)
    assert_identical(reference, cluster.tmp / "out" / "persist")
    root = cluster.tmp / "out" / "persist" / "checkpoints"
    ck = persist.load_checkpoint(root)  # complete, verified, readable after the run
    assert ck.manifest["world_size"] == 3 and set(ck.ranks) == {0, 1, 2}
