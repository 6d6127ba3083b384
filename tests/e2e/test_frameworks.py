"""Users' own DDP and FSDP2 scripts under hot swap, end to end.

examples/ddp_train.py (DDP with ``no_sync`` gradient accumulation, AdamW, a cosine
schedule, clipping, ``session.data_loader``) and examples/fsdp_train.py (FSDP2
``fully_shard`` on ``session.device_mesh``, parameters and AdamW moments as DTensor shards)
run once undisturbed and once under each failure; every tensor of every rank's final
state and every component's JSON state must be equal. The scripts seed torch only, as a
torchrun script does: Python's and numpy's global generators start from OS entropy in
every process, so their states differ between *any* two runs and are left out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hotspare.recovery import load_final

from ..conftest import EXAMPLES, Cluster, start_etcd
from .test_exact_recovery import assert_identical

# one worker runs this module (pytest-xdist --dist loadgroup): its module-scoped fixture is made once
pytestmark = [pytest.mark.xdist_group("frameworks"), pytest.mark.timeout(400)]

STEPS = 24
UNSEEDED = {"rng/numpy", "rng/python"}  # the examples never seed them (see the module docstring)


JOBS = Path(__file__).parent / "jobs"


def spec(cluster, script: str, name: str, **fields):
    base = {
        "name": name,
        "entrypoint": str((JOBS if script == "ddp_variants.py" else EXAMPLES) / script) + ":train",
        "ranks": 2 if script == "fsdp_train.py" else 3,
        "spares": 1,
        "steps": STEPS,
        "lease_ttl": 2,
        "hang_timeout": 10,
        "args": {"batch_size": 8} if script == "ddp_variants.py" else {"batch_size": 8, "accum": 2},
        "output_dir": str(cluster.tmp / "out" / name),
    }
    base.update(fields)
    return cluster.spec_file(**base)


def run(cluster, script: str, name: str, **fields) -> tuple[dict, object]:
    summary, r = cluster.run_json(str(spec(cluster, script, name, **fields)), "--no-check")
    return summary, r


def run_ok(cluster, script: str, name: str, **fields) -> dict:
    summary, r = run(cluster, script, name, **fields)
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-3000:]
    return summary


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The undisturbed runs of both examples (an etcd and controller of their own)."""
    tmp = tmp_path_factory.mktemp("framework-refs")
    srv = start_etcd(tmp / "etcd")
    c = Cluster(srv, tmp)
    try:
        c.controller()
        run_ok(c, "ddp_train.py", "ddp-ref")
        run_ok(c, "fsdp_train.py", "fsdp-ref")
        run_ok(c, "ddp_variants.py", "variants-ref")
        yield {name: load_final(tmp / "out" / f"{name}-ref") for name in ("ddp", "fsdp", "variants")}
    finally:
        c.close()
        srv.stop()


def test_ddp_replicas_agree_and_the_shards_are_real(references):
    """The reference runs trained what they claim: DDP kept 3 identical replicas; FSDP2
    left each of 2 ranks a different half of every sharded parameter."""
    ddp, fsdp = references["ddp"], references["fsdp"]
    w = "model.params/module.0.weight"
    assert torch.equal(ddp.ranks[0][w], ddp.ranks[1][w]) and torch.equal(ddp.ranks[0][w], ddp.ranks[2][w])
    s = "model.params/0.0.weight"  # Linear(16, 64): 32 rows per rank
    assert fsdp.ranks[0][s].shape == (32, 16) and not torch.equal(fsdp.ranks[0][s], fsdp.ranks[1][s])
    assert fsdp.ranks[0]["optimizer/state.#0.exp_avg"].shape == (32, 16)


def test_ddp_with_no_sync_accumulation_ends_bit_identical_after_a_kill_rank(cluster, references):
    cluster.controller()
    s = run_ok(cluster, "ddp_train.py", "ddp-kill", chaos=[{"at_step": 12, "action": "kill-rank", "rank": 1}])
    [rec] = s["recoveries"]
    assert rec["spare_node"] == "spare0"
    assert_identical(references["ddp"], cluster.tmp / "out" / "ddp-kill", skip=UNSEEDED)
    restored = [e for e in cluster.job("ddp-kill").events() if e.kind == "restored" and e.data["epoch"] == 2]
    assert {e.data["rank"]: e.data["source"] for e in restored}[1].startswith("replica on")


def test_ddp_with_unused_parameters_bucket_views_and_buffers_ends_bit_identical(cluster, references):
    """find_unused_parameters (DDP never rebuilds its buckets then), gradient_as_bucket_view
    and BatchNorm buffers broadcast before each forward, through a kill-rank."""
    cluster.controller()
    run_ok(cluster, "ddp_variants.py", "variants-kill", chaos=[{"at_step": 11, "action": "kill-rank", "rank": 0}])
    assert_identical(references["variants"], cluster.tmp / "out" / "variants-kill", skip=UNSEEDED)  # BatchNorm buffers included
    assert any(k.startswith("model.buffers/module.norm.running_mean") for k in references["variants"].ranks[0])


def test_ddp_ends_bit_identical_after_a_node_loss(cluster, references):
    cluster.controller()
    s = run_ok(cluster, "ddp_train.py", "ddp-node", chaos=[{"at_step": 9, "action": "kill-node", "rank": 0}])
    assert [r["kind"] for r in s["recoveries"]] == ["node-loss"]
    assert_identical(references["ddp"], cluster.tmp / "out" / "ddp-node", skip=UNSEEDED)


def test_offloaded_adamw_ends_bit_identical_to_adamw_through_a_kill_rank_and_a_node_loss(cluster, references):
    """examples/ddp_train.py with ``offload_dir``: AdamW's moments in files on disk
    (OffloadedAdamW, overlapped with the next forward), through a kill-rank and then a node
    loss, whose spare restores the moments from a replica into files of its own. Every
    parameter and moment of every rank equals the plain torch.optim.AdamW run's, bit for bit."""
    cluster.controller()
    off = cluster.tmp / "offload"
    s = run_ok(cluster, "ddp_train.py", "ddp-offload", spares=2,
               args={"batch_size": 8, "accum": 2, "offload_dir": str(off)},
               chaos=[{"at_step": 8, "action": "kill-rank", "rank": 1},
                      {"at_step": 16, "action": "kill-node", "rank": 0}])
    assert len(s["recoveries"]) == 2 and s["recoveries"][1]["kind"] == "node-loss", s["recoveries"]
    got, ref = load_final(cluster.tmp / "out" / "ddp-offload"), references["ddp"]
    names = ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]  # ddp_train.make_model
    for r in range(3):
        for i, n in enumerate(names):
            assert torch.equal(got.ranks[r][f"model.params/{n}"], ref.ranks[r][f"model.params/{n}"]), (r, n)
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got.ranks[r][f"optimizer/{n}:{k}"], ref.ranks[r][f"optimizer/state.#{i}.{k}"]), (r, n, k)
    spare = s["recoveries"][1]["spare_node"]  # took rank 0: its moments are files of its own
    assert json.loads((off / f"{spare}-rank0" / "manifest.json").read_text())["step"] == STEPS
    restored = [e for e in cluster.job("ddp-offload").events() if e.kind == "restored" and e.data["rank"] == 0]
    assert restored[-1].data["source"].startswith("replica on"), [e.data for e in restored]


def test_fsdp2_shards_end_bit_identical_after_a_kill_rank(cluster, references):
    cluster.controller()
    s = run_ok(cluster, "fsdp_train.py", "fsdp-kill", chaos=[{"at_step": 12, "action": "kill-rank", "rank": 1}])
    assert len(s["recoveries"]) == 1
    assert_identical(references["fsdp"], cluster.tmp / "out" / "fsdp-kill", skip=UNSEEDED)


def test_ddp_shrinks_when_the_spares_run_out_and_its_replicas_stay_equal(cluster):
    """With no spare and ``on_no_spare: shrink`` the DDP job goes on with 2 ranks: the
    survivors' DDP follows the smaller group (gradients averaged over 2, one bucket layout)
    and their replicas stay bit-identical to each other."""
    cluster.controller()
    s = run_ok(cluster, "ddp_train.py", "ddp-shrink", spares=0, on_no_spare="shrink", min_ranks=2,
               chaos=[{"at_step": 10, "action": "kill-node", "rank": 2}])
    assert [r["kind"] for r in s["recoveries"]] == ["node-loss"], s["recoveries"]
    got = load_final(cluster.tmp / "out" / "ddp-shrink")
    assert got.manifest["world_size"] == 2 and sorted(got.ranks) == [0, 1]
    for k, t in got.ranks[0].items():
        if k.startswith(("model.", "optimizer/")):
            assert torch.equal(t, got.ranks[1][k]), k


def test_fsdp2_refuses_to_shrink_with_a_sentence(cluster):
    """Re-sharding is out of scope: a shrink of an FSDP2 job fails the job with the reason
    and the way out, instead of training on shards cut for another world size."""
    cluster.controller()
    s, r = run(cluster, "fsdp_train.py", "fsdp-shrink", spares=0, ranks=3, on_no_spare="shrink", min_ranks=2,
               chaos=[{"at_step": 6, "action": "kill-node", "rank": 2}])
    assert s["state"] == "failed", r.stdout
    text = r.stdout + r.stderr
    assert "sharded with FSDP2 over 3 ranks" in text and "cannot shrink or grow an FSDP2 job" in text, text[-3000:]
