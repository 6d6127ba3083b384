"""What a job's ranks are doing, read from one :class:`JobSnapshot`: the rows of ``hotspare
status``, the straggler scores behind them, and the next replication point a checkpoint
request can still reach.

Pure functions over a snapshot (the clock is a parameter), so the CLI prints them and tests
build snapshots by hand; no etcd, no torch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from .store import JobSnapshot, World

#: The spec's straggler_threshold / on_straggler when a snapshot has no spec (a job being
#: deleted): the JobSpec defaults.
DEFAULT_THRESHOLD = 2.0
DEFAULT_ON_STRAGGLER = "report"


def straggler_scores(obs: JobSnapshot, world: World) -> dict[int, float]:
    """Each rank's compute time per step (outside collectives) over the median of all
    ranks. In synchronous training every rank's *step* time is the slowest rank's, so
    only the compute share tells who makes the others wait. Empty until more than half of
    the world has reported a compute time in its current seat."""
    times = {
        r: p.compute_time
        for r, p in obs.progress.items()
        if r < world.size and p.epoch >= world.seats[r].since and p.compute_time > 0
    }
    if len(times) < max(2, world.size // 2 + 1):
        return {}
    ordered = sorted(times.values())
    median = ordered[len(ordered) // 2]
    return {r: t / median for r, t in times.items()} if median > 0 else {}


@dataclass(frozen=True)
class RankRow:
    """One rank as ``hotspare status`` shows it (``--json``: these fields, in this order)."""

    rank: int
    node: str
    state: str  # running, straggler, done or lost
    step: int  # -1: no progress published yet
    since_epoch: int
    step_time: float | None
    compute_time: float | None
    straggler_score: float | None
    age_s: float | None  # seconds since the rank last published progress

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def threshold(snap: JobSnapshot) -> float:
    return snap.spec.straggler_threshold if snap.spec else DEFAULT_THRESHOLD


def on_straggler(snap: JobSnapshot) -> str:
    return snap.spec.on_straggler if snap.spec else DEFAULT_ON_STRAGGLER


def rank_rows(snap: JobSnapshot, now: float) -> list[RankRow]:
    """Every seat of the current world: a rank is lost once its node's incarnation is gone,
    a straggler while its score is at or over the spec's threshold."""
    w = snap.world
    if w is None:
        return []
    scores = straggler_scores(snap, w)
    limit = threshold(snap)
    rows = []
    for r, seat in enumerate(w.seats):
        p = snap.progress.get(r)
        alive = seat.node in snap.nodes and snap.nodes[seat.node].incarnation == seat.incarnation
        state = "done" if r in snap.done else ("running" if alive else "lost")
        score = scores.get(r)
        if state == "running" and score is not None and score >= limit:
            state = "straggler"
        rows.append(RankRow(
            rank=r, node=seat.node, state=state, step=p.step if p else -1, since_epoch=seat.since,
            step_time=p.step_time if p else None, compute_time=p.compute_time if p else None,
            straggler_score=round(score, 2) if score is not None else None,
            age_s=round(now - p.time, 1) if p else None))
    return rows


def spares(snap: JobSnapshot) -> list[str]:
    """Live nodes that hold no seat of the current world."""
    used = {s.node for s in (snap.world.seats if snap.world else ())}
    return [n.name for n in snap.nodes.values() if n.name not in used]


def job_status(snap: JobSnapshot, now: float) -> dict[str, Any]:
    """``hotspare status JOB --json`` (less the scheduler's line, which the CLI adds)."""
    return {"job": snap.job, "state": snap.state.value, "message": snap.state_message,
            "epoch": snap.epoch, "ranks": [r.to_dict() for r in rank_rows(snap, now)],
            "spares": spares(snap), "nodes": sorted(snap.nodes), "leader": snap.leader}


def next_point(snap: JobSnapshot, every: int, margin_s: float, now: float | None = None) -> int:
    """The first replication point every rank will reach at least ``margin_s`` from now.

    Progress is published every few seconds, so each rank's step is extrapolated from its
    step time; the request must reach every agent before its ranks pass the point."""
    now = time.time() if now is None else now
    est, step_time = -1.0, 0.0
    for p in snap.progress.values():
        guess = p.step + (max(0.0, now - p.time) / p.step_time if p.step_time > 0 else 0.0)
        est, step_time = max(est, guess), max(step_time, p.step_time)
    ahead = margin_s / step_time if step_time > 0 else 0.0
    return (int(est + ahead) // every + 1) * every
