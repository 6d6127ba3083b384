"""Shrink when the spares run out, grow back when a spare joins, end to end.

The demo workload (examples/gpt.py, data-parallel) runs with ``on_no_spare: shrink``: the
first node loss is swapped to the spare, the second shrinks the world to 2 ranks (the
survivor behind the lost rank is renumbered), and a spare agent started later grows it
back to 3. Every rank logs the samples it trained on (``record_samples``); within each
data epoch every sample must have been read exactly once, across all world sizes.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hotspare.recovery import load_final

from .test_exact_recovery import gpt_spec

pytestmark = pytest.mark.timeout(300)

STEPS = 70
SAMPLES = 200  # windows per data epoch: 24 per step at 3 ranks, 16 at 2 -> ~7 epochs


def committed_steps(out_dir) -> dict[int, list[dict]]:
    """step -> the records of the attempt that stuck (the newest session epoch): a step
    rolled back by a failure is redone in a later epoch."""
    by_step: dict[int, list[dict]] = {}
    for f in (out_dir / "samples").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed node
            by_step.setdefault(rec["step"], []).append(rec)
    out = {}
    for step, recs in by_step.items():
        newest = max(r["epoch"] for r in recs)
        out[step] = sorted((r for r in recs if r["epoch"] == newest), key=lambda r: r["rank"])
    return out


def test_shrink_then_grow_back_reads_every_sample_exactly_once(cluster):
    cluster.controller()
    args = {"n_layer": 1, "n_embd": 32, "block_size": 32, "num_samples": SAMPLES, "record_samples": True}
    spec = gpt_spec(cluster, "elastic", steps=STEPS, on_no_spare="shrink", min_ranks=2, args=args,
                    chaos=[{"at_step": 10, "action": "kill-node", "rank": 1},   # node1: swapped to spare0
                           {"at_step": 25, "action": "kill-node", "rank": 1}])  # spare0: no spare left
    cluster.hotspare("submit", str(spec), check=True)
    js = cluster.job("elastic")

    def decided(kind: str) -> bool:
        return any(e.kind == kind for e in js.events())

    cluster.wait(lambda: decided("shrink") or js.snapshot().state.terminal, what="the shrink")
    # hold the job back (rank 0 sleeps 1 s after each step) until the late spare's worker,
    # which imports torch first, is warm and the world has grown
    js.send_chaos("node0", {"action": "slow-rank", "rank": 0, "seconds": 1.0})
    # both ranks of the shrunk world must commit a step before the grow (on a loaded machine
    # its rebuild could otherwise outlast the late spare's start, and the grow would roll the
    # uncommitted step back: no step at size 2 to check)
    [shrunk] = [e.data["epoch"] for e in js.events() if e.kind == "shrink"]
    cluster.wait(lambda: len({e.source for e in js.events() if e.kind == "resumed" and e.data.get("epoch") == shrunk}) == 2
                 or js.snapshot().state.terminal, what="a step of the shrunk world on both ranks")
    cluster.agent("elastic", "late0", spare=True)
    cluster.wait(lambda: decided("grow") or js.snapshot().state.terminal, what="the grow")
    js.send_chaos("node0", {"action": "slow-rank", "rank": 0, "seconds": 0})
    cluster.wait(lambda: js.snapshot().state.terminal, timeout=180, what="job end")

    snap = js.snapshot()
    assert snap.state.value == "succeeded", snap.state_message
    events = js.events()
    worlds = [e for e in events if e.kind in ("swap", "shrink", "grow")]
    assert [(e.kind, e.data["epoch"]) for e in worlds] == [("swap", 2), ("shrink", 3), ("grow", 4)]
    assert [s.node for s in snap.world.seats] == ["node0", "node2", "late0"]
    # node2's worker lived through it all: renumbered 2 -> 1 by the shrink, never restarted
    node2 = {e.data["pid"] for e in events if e.kind == "rebuilt" and e.data["node"] == "node2"}
    assert len(node2) == 1
    [grown] = [e for e in events if e.kind == "restored" and e.data["epoch"] == 4 and e.data["rank"] == 2]
    assert grown.data["source"] == "peer rank 0 (grown seat)" and grown.data["bytes"] > 0
    out = cluster.tmp / "out" / "elastic"
    final = load_final(out)
    assert final.manifest["world_size"] == 3
    # data-parallel replicas end identical; the grown rank's data position is the shared one
    for r in (1, 2):
        assert final.meta[r]["data"] == final.meta[0]["data"]
        assert all(t.equal(final.ranks[0][k]) for k, t in final.ranks[r].items() if k.startswith("model."))

    steps = committed_steps(out)
    assert sorted(steps) == list(range(STEPS))
    sizes = []
    for step in range(STEPS):
        recs = steps[step]
        world = recs[0]["world"]
        assert [r["rank"] for r in recs] == list(range(world)), f"step {step}: ranks {recs}"
        sizes.append(world)
    assert sizes[0] == 3 and sizes[-1] == 3 and 2 in sizes  # 3 ranks, shrunk to 2, grown back
    first2, last2 = sizes.index(2), len(sizes) - 1 - sizes[::-1].index(2)
    assert set(sizes[first2 : last2 + 1]) == {2}, sizes

    read = [tuple(s) for step in range(STEPS) for rec in steps[step] for s in rec["samples"]]
    by_epoch: dict[int, list[int]] = {}
    for epoch, sample in read:
        by_epoch.setdefault(epoch, []).append(sample)
    last = max(by_epoch)
    assert sorted(by_epoch) == list(range(last + 1)) and last >= 3
    for epoch, samples in by_epoch.items():
        repeated = [s for s, n in Counter(samples).items() if n > 1]
        assert not repeated, f"data epoch {epoch}: samples {repeated[:5]} read twice"
        if epoch < last:
            assert sorted(samples) == list(range(SAMPLES)), f"data epoch {epoch}: samples skipped"
