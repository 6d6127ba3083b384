"""A rank and the node holding its only replica are lost together: no peer has the rank's
state any more, so every rank rolls back to the newest complete persisted checkpoint, and
the job still ends bit-identical to the undisturbed reference run."""

from __future__ import annotations

import json

from hotspare.recovery import persist
from hotspare.recovery.final import load_checkpoint

from .test_exact_recovery import assert_identical, gpt_spec, run_ok


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
    ck = load_checkpoint(root)  # complete, verified, readable after the run
    assert ck.manifest["world_size"] == 3 and set(ck.ranks) == {0, 1, 2}


def test_a_corrupt_newest_checkpoint_is_refused_and_every_rank_falls_back_to_an_older_one(cluster, reference):
    """Only rank 0's file of the newest checkpoint is damaged: rank 0 refuses it, says which
    file, and the others must not go on with theirs (they agree on an ok flag first); every
    rank restores the next older checkpoint and the result is still bit-identical."""
    cluster.controller()
    # steps >= 0.1 s (timing only): the checkpoint of step 20 is complete by step 28
    s = run_ok(cluster, "corrupt", spares=2, persist_every=10, persist_keep=4,
               env={"HOTSPARE_TEST_SNAPSHOT_DELAY": "0.1"},
               chaos=[{"at_step": 28, "action": "corrupt-checkpoint", "rank": 0},
                      {"at_step": 29, "action": "kill-node", "rank": 1},
                      {"at_step": 29, "action": "kill-node", "rank": 2}])
    assert s["recoveries"], s
    events = cluster.job("corrupt").events()
    [bad] = [e for e in events if e.kind == "corrupted"]
    damaged = bad.data["step"]
    refusals = [e for e in events if e.kind == "checkpoint-unusable"]
    assert refusals and {e.data["rank"] for e in refusals} == {0}, [e.message for e in refusals]
    assert bad.data["path"] in refusals[0].message and "CRC32 mismatch" in refusals[0].message
    after = {e.data["rank"]: e.data for e in events if e.kind == "restored" and e.data["epoch"] >= 2}
    assert set(after) == {0, 1, 2}, after
    for r, d in after.items():
        assert d["source"].startswith("persisted checkpoint"), (r, d)
        assert d["restore_step"] < damaged and f"{damaged} unusable" in d["source"], (r, d)
    assert_identical(reference, cluster.tmp / "out" / "corrupt")


def test_with_no_usable_copy_of_a_lost_rank_left_the_job_fails_saying_why(cluster):
    """The only checkpoint is damaged and a rank dies together with its replica holder: no
    spare can help, so the job fails at once with the reason instead of trying spare after
    spare."""
    cluster.controller()
    spec = gpt_spec(cluster, "hopeless", spares=3, persist_every=10, persist_keep=1,
                    env={"HOTSPARE_TEST_SNAPSHOT_DELAY": "0.1"},
                    chaos=[{"at_step": 18, "action": "corrupt-checkpoint", "rank": 2},
                           {"at_step": 19, "action": "kill-node", "rank": 1},
                           {"at_step": 19, "action": "kill-node", "rank": 2}])
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "failed", r.stdout + r.stderr[-3000:]
    snap = cluster.job("hopeless").snapshot()
    assert "no usable persisted checkpoint" in snap.state_message, snap.state_message
    assert "cannot continue from any copy of its state" in snap.state_message
    swaps = [e for e in cluster.job("hopeless").events() if e.kind == "swap"]
    # the two node losses (one swap, or two when their leases expire in different rounds),
    # and no churn: no rank is handed to a second spare
    lost = [r for e in swaps for r in e.data["lost"]]
    assert sorted(lost) in ([1, 2], [1], [2]) and len(lost) == len(set(lost)), [e.message for e in swaps]


def test_hotspare_checkpoint_persists_an_upcoming_point_of_a_running_job(cluster):
    """No scheduled persisting (persist_every 0): `hotspare checkpoint` picks a replication
    point ahead of every rank (progress is published only every few seconds, the job runs
    ~50 steps a second) and returns once that checkpoint is complete. With a replicate_interval
    no run reaches, only the request (each agent passes it on to its workers, whose vote makes
    that candidate a point) can make the step a point."""
    cluster.controller()
    cluster.hotspare("submit", str(gpt_spec(cluster, "ondemand", steps=1_000_000, spares=0, replicate_interval=1000)),
                     check=True)
    js = cluster.job("ondemand")
    cluster.wait(lambda: len(js.snapshot().progress) == 3, what="every rank training")
    root = js.snapshot().spec.persist_root  # this run's directory: <output_dir>/checkpoints/<run id>
    assert root.startswith(str(cluster.tmp / "out" / "ondemand" / "checkpoints"))
    assert persist.complete_steps(root) == []
    r = cluster.hotspare("checkpoint", "ondemand", "--timeout", "120", timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    [step] = persist.complete_steps(root)
    assert f"persisted: {persist.checkpoint_path(root, step)}" in r.stdout
    assert step > 0 and step % 10 == 0
    ck = load_checkpoint(root)
    assert ck.manifest["world_size"] == 3 and ck.manifest["step"] == step
    # one consistent step: every rank's data position is the same
    assert len({json.dumps(ck.meta[r]["data"], sort_keys=True) for r in range(3)}) == 1
    cluster.hotspare("cancel", "ondemand", check=True)
    cluster.wait(lambda: js.state()[0].terminal, what="the job to be cancelled")
