"""A user's project may hold modules called ``agents.py`` and ``recovery.py`` (common names):
they must neither break hotspare's processes nor be shadowed by hotspare's own packages.

The job is started from the user's directory (the current directory of ``hotspare run``, of
the agents and of their workers), its script imports the user's ``agents`` and ``recovery``
modules, one rank is killed, and the spare's worker must import the same user modules."""

from __future__ import annotations

import json

import yaml

TRAIN = '''
import json
import os
from pathlib import Path

import torch

import agents  # the user's own modules, next to this script
import recovery


def train(session, out: str, step_sleep: float = 0.02):
    import time

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session.track(model=model, optimizer=opt)
    x = torch.ones(8, 4) * (session.rank + 1)
    for step in session.steps():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        session.allreduce_grads(model)
        opt.step()
        time.sleep(step_sleep)
    Path(out, f"rank{session.rank}-pid{os.getpid()}.json").write_text(json.dumps({
        "agents": [agents.__file__, agents.WHO],
        "recovery": [recovery.__file__, recovery.WHO],
    }))
'''


def test_a_job_with_its_own_agents_and_recovery_modules_runs_and_recovers(cluster):
    user = cluster.tmp  # the user's project directory, and the current directory of every process
    (user / "agents.py").write_text('WHO = "the user\'s agents module"\n')
    (user / "recovery.py").write_text('WHO = "the user\'s recovery module"\n')
    (user / "train.py").write_text(TRAIN)
    seen = user / "seen"
    seen.mkdir()
    spec = user / "mine.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "mine", "entrypoint": str(user / "train.py") + ":train", "ranks": 2, "spares": 1,
        "steps": 60, "lease_ttl": 2, "hang_timeout": 10, "output_dir": str(user / "out" / "mine"),
        "args": {"out": str(seen)}, "chaos": [{"at_step": 20, "action": "kill-rank", "rank": 1}],
    }))
    cluster.controller()
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-4000:]
    [rec] = summary["recoveries"]
    assert rec["failed_rank"] == 1 and rec["spare_node"] == "spare0"
    records = [json.loads(f.read_text()) for f in sorted(seen.glob("rank*.json"))]
    assert len(records) == 2, f"each rank writes one record at the end: {sorted(seen.iterdir())}"
    for rec in records:  # every rank, the spare's new worker included, imported the user's modules
        assert rec["agents"] == [str(user / "agents.py"), "the user's agents module"]
        assert rec["recovery"] == [str(user / "recovery.py"), "the user's recovery module"]
