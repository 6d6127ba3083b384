"""An ordinary shuffled DataLoader workload through ``session.data_loader`` ends bit-identical
after a killed rank and a lost node; a plain DataLoader read across steps gets one warning.

The job: a real ``TensorDataset``, ``session.data_loader(..., shuffle=True, num_workers=2)``
with a random augmentation in ``collate_fn`` (it runs in the loader's worker processes), a
small MLP with dropout, AdamW. 96 samples at 2 ranks x 4 is 12 steps an epoch: the failures
land mid-epoch and the run crosses three epochs.
"""

from __future__ import annotations

import pytest

from hotspare.recovery import load_final

from .test_exact_recovery import assert_identical

pytestmark = pytest.mark.timeout(400)

STEPS = 40
WARNING = "session.data_loader(dataset"

JOB = '''
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


def dataset(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


def augment(items):  # random, in the loader's workers
    x = torch.stack([i[0] for i in items])
    y = torch.stack([i[1] for i in items])
    return x + 0.05 * torch.randn_like(x), y


def train(session, persistent: bool = True, trap: bool = False):
    torch.manual_seed(0)  # seeding is the script's job, as with torchrun: all three generators
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session.track(model=model, optimizer=opt)
    if trap:  # the torchrun habit: a plain DataLoader and an iterator kept across steps
        plain = DataLoader(dataset(), batch_size=4, shuffle=True)
        batches = iter(plain)
    else:
        batches = session.data_loader(dataset(), batch_size=4, shuffle=True, num_workers=2,
                                      collate_fn=augment, persistent_workers=persistent)
    for step, (x, y) in zip(session.steps(), batches):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        session.allreduce_grads(model)
        opt.step()
        session.log(loss=loss.item())
'''


def run(cluster, name: str, **fields) -> dict:
    job = cluster.tmp / "dljob.py"
    if not job.exists():
        job.write_text(JOB)
    spec = {"name": name, "entrypoint": f"{job}:train", "ranks": 2, "spares": 1, "steps": STEPS,
            "lease_ttl": 2, "hang_timeout": 10, "replicate_every": 5, "output_dir": str(cluster.tmp / "out" / name), "args": {}}
    spec.update(fields)
    summary, r = cluster.run_json(str(cluster.spec_file(**spec)))
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-3000:]
    return summary


def worker_logs(cluster, name: str) -> str:
    """Every worker's output: before (worker-*) and after (rank*) it had a rank."""
    logs = sorted((cluster.tmp / "out" / name / "logs").glob("*.log"))
    return "".join(f.read_text(errors="replace") for f in logs if not f.name.startswith("agent"))


def test_shuffled_loader_with_workers_ends_bit_identical_after_a_kill_rank_and_a_kill_node(cluster):
    cluster.controller()
    run(cluster, "dlref")
    reference = load_final(cluster.tmp / "out" / "dlref")
    assert reference.meta[0]["data_loader"] == {"__dict__": {"epoch": 3, "pos": 32}}  # 40 steps x 8

    # one run, two recoveries: a killed worker (its spare restores from the dead worker's
    # agent), then a lost node (from the buddy replica, rolling back to a replication
    # point); non-persistent workers this time, which must not change a single batch
    s = run(cluster, "dlchaos", spares=2, args={"persistent": False},
            chaos=[{"at_step": 13, "action": "kill-rank", "rank": 1},
                   {"at_step": 27, "action": "kill-node", "rank": 0}])
    assert [r["failed_rank"] for r in s["recoveries"]] == [1, 0]
    assert s["recoveries"][1]["kind"] == "node-loss"
    assert_identical(reference, cluster.tmp / "out" / "dlchaos")
    for name in ("dlref", "dlchaos"):
        assert WARNING not in worker_logs(cluster, name), "the supported path must not warn"


def test_a_plain_dataloader_read_across_steps_warns_once_naming_the_fix(cluster):
    cluster.controller()
    run(cluster, "trap", spares=0, steps=6, args={"trap": True})
    logs = worker_logs(cluster, "trap")
    assert logs.count(WARNING) == 2, logs[-3000:]  # once in each rank's log
    assert "UntrackedDataLoaderWarning" in logs
