"""The chaos suite: one job, a seeded random schedule of mixed failures, nothing lost.

Two of the failures fire inside a recovery (``during:``: in the rendezvous of a new epoch, and
while the members restore), so one recovery is interrupted by the next failure.

Invariants, checked from the events and the final state:
* the job completes;
* its final state is bit-identical to the undisturbed run;
* no two workers ever held the same rank in the same epoch;
* no step was skipped or applied twice (the optimizer's step count and the data position
  equal what `steps` undisturbed steps produce — and bit-identity covers the rest).

Killed nodes are revived as spares by a small supervisor thread here (what a cluster
manager rebooting a machine would do); partitioned nodes rejoin by themselves.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from hotspare.agents.node_services import sweep_stale_run_dirs
from hotspare.orchestrator.etcd_server import pid_alive
from hotspare.recovery import load_final

from ..e2e.test_exact_recovery import assert_identical, gpt_spec

pytestmark = pytest.mark.timeout(600)

SEED = 20261202
STEPS = 60  # same as the reference run
ACTIONS = ["kill-rank", "kill-node", "hang-rank", "partition-node", "kill-rank", "kill-node",
           "kill-controller", "slow-rank", "kill-rank", "partition-node", "kill-node", "hang-rank"]
#: failures inside a recovery: each fires in the first recovery that reaches its phase after its
#: step (every member passes both phases of every recovery, so each one fires)
DURING = [("kill-rank", "rendezvous"), ("hang-rank", "restore")]


def seeded_schedule(seed: int, steps: int) -> list[dict]:
    rng = random.Random(seed)
    actions = ACTIONS[:]
    rng.shuffle(actions)
    at = sorted(rng.sample(range(4, steps - 2), len(actions)))
    out = []
    for step, action in zip(at, actions, strict=True):
        entry = {"at_step": step, "action": action}
        if action != "kill-controller":
            entry["rank"] = rng.randrange(3)
        if action in ("partition-node",):
            entry["seconds"] = 3
        if action == "slow-rank":
            entry["seconds"] = 0.01
        out.append(entry)
    for action, phase in DURING:  # due by mid-run: later failures are sure to come after them
        out.append({"at_step": rng.randrange(4, steps // 2), "action": action, "rank": rng.randrange(3),
                    "during": phase})
    return out


class Reviver(threading.Thread):
    """Restart dead agents of the job as spares after a short 'reboot'."""

    def __init__(self, cluster, job: str, out_dir) -> None:
        super().__init__(daemon=True)
        self.cluster, self.job, self.out = cluster, job, out_dir
        self.stop = threading.Event()
        self.revived: list[str] = []
        self.pids: dict[str, int] = {}  # node -> its agent's pid, the revived ones included

    def run(self) -> None:
        pids = self.pids
        while not self.stop.wait(0.5):
            f = self.out / "agents.json"
            if not pids and f.exists():
                pids.update(json.loads(f.read_text()))
            for node, pid in list(pids.items()):
                if not pid_alive(pid) and not self.stop.wait(1.0):  # a short "reboot"
                    pids[node] = self.cluster.agent(self.job, node, spare=True).pid
                    self.revived.append(node)


def test_seeded_random_failures_leave_no_trace_in_the_result(cluster, reference):
    schedule = seeded_schedule(SEED, STEPS)
    assert len(schedule) >= 10 and len({c["action"] for c in schedule}) >= 6
    cluster.controller()
    time.sleep(0.5)
    cluster.controller()  # a standby for kill-controller
    out = cluster.tmp / "out" / "chaos"
    reviver = Reviver(cluster, "chaos", out)
    reviver.start()
    try:
        spec = gpt_spec(cluster, "chaos", spares=2, hang_timeout=3, lease_ttl=2, replicate_every=5,
                        chaos=schedule)
        summary, r = cluster.run_json(str(spec), timeout=500)
    finally:
        reviver.stop.set()
        reviver.join(30)  # before the cluster's teardown: it starts agents through the cluster
    # the agents stop their workers and remove their shared memory; the killed nodes' is swept
    cluster.wait(lambda: not any(pid_alive(p) for p in reviver.pids.values()), timeout=60, what="agents to leave")
    sweep_stale_run_dirs(Path("/dev/shm"))
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-3000:]

    events = cluster.job("chaos").events()
    fired = [e for e in events if e.kind == "chaos"]
    assert len({(e.data.get("action"), e.data.get("step"), e.data.get("during")) for e in fired
                if e.data.get("step") is not None}) == len(schedule)
    assert {e.data.get("during") for e in fired} >= {phase for _, phase in DURING}, "a failure inside a recovery"
    assert len(summary["recoveries"]) >= 6, summary["recoveries"]

    seats: dict[tuple[int, int], set[int]] = {}
    for e in events:
        if e.kind == "rebuilt":
            seats.setdefault((e.data["epoch"], e.data["rank"]), set()).add(e.data["pid"])
    doubled = {k: v for k, v in seats.items() if len(v) > 1}
    assert not doubled, f"two workers held one rank in one epoch: {doubled}"

    # no worker was ever held at its replication gate until the timeout (a new worker of a
    # rank once waited for a confirmation its dead predecessor's point had taken)
    stuck = [line for f in (out / "logs").glob("rank*.log") for line in f.read_text(errors="replace").splitlines()
             if "not replicated after" in line]
    assert not stuck, stuck

    final = load_final(out)
    for rank, tensors in final.ranks.items():
        steps_taken = {k: t for k, t in tensors.items() if k.startswith("optimizer/") and k.endswith(".step")}
        assert steps_taken and all(torch.equal(t, torch.tensor(float(STEPS))) for t in steps_taken.values()), \
            f"rank {rank}: optimizer stepped {set(t.item() for t in steps_taken.values())} times, not {STEPS}"
        assert final.meta[rank]["data"] == reference.meta[rank]["data"], "data position differs"
    assert_identical(reference, out)
    if any(c["action"] == "kill-node" for c in schedule):
        assert reviver.revived, "killed nodes should have come back as spares"
