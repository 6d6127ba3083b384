"""What a job's ranks are doing, read from one :class:`JobSnapshot`: the rows of ``hotspare
status``, the straggler scores behind them, and the next replication point a checkpoint
request can still reach.

Pure functions over a snapshot (the clock is a parameter), so the CLI prints them and tests
build snapshots by hand; no etcd, no torch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .store import JobSnapshot, JobState, Progress, Seat, World

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
    state: str  # one of RANK_STATES
    step: int  # last completed step; -1: none published in this seat yet
    since_epoch: int
    step_time: float | None
    compute_time: float | None
    straggler_score: float | None
    age_s: float | None  # seconds since the rank last published progress
    metrics: dict[str, float] = field(default_factory=dict)  # what it logged (session.log), loss included

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: What a rank's ``state`` can be. Only ``running`` and ``straggler`` claim a live worker that
#: is training: ``starting`` is a seat whose worker has not completed a step in it yet,
#: ``exited``/``hung`` a worker its agent reported gone (not yet replaced), ``lost`` a seat whose
#: node (that incarnation of it) is gone, ``stopped`` a seat of a job that ended without it.
RANK_STATES = ("starting", "running", "straggler", "done", "exited", "hung", "lost", "stopped")


def threshold(snap: JobSnapshot) -> float:
    return snap.spec.straggler_threshold if snap.spec else DEFAULT_THRESHOLD


def on_straggler(snap: JobSnapshot) -> str:
    return snap.spec.on_straggler if snap.spec else DEFAULT_ON_STRAGGLER


def _reported(snap: JobSnapshot, rank: int, since: int) -> str | None:
    """``exited`` or ``hung`` if an agent reported this seat's worker gone (a report older
    than the seat is about a previous holder)."""
    for rep in snap.reports:
        if rep.rank == rank and rep.epoch >= since:
            return "hung" if rep.kind == "hang" else "exited"
    return None


def _rank_state(snap: JobSnapshot, rank: int, seat: Seat, p: Progress | None) -> str:
    """What the seat's worker is doing, from the records that prove it: the done mark, the
    job's end, the agent's report, the node's incarnation, progress in this seat."""
    if rank in snap.done or snap.state is JobState.SUCCEEDED:
        return "done"
    if snap.state.terminal:
        return "stopped"
    node = snap.nodes.get(seat.node)
    if node is None or node.incarnation != seat.incarnation:
        return "lost"
    reported = _reported(snap, rank, seat.since)
    if reported:
        return reported
    if p is None or p.epoch < seat.since or p.step < 0:
        return "starting"
    return "running"


def seat_progress(snap: JobSnapshot, world: World) -> dict[int, Progress]:
    """Each rank's progress, if it is this world's: a rank number past the world's size (after
    a shrink) is someone else's old record."""
    return {r: p for r, p in snap.progress.items() if r < world.size}


def rank_rows(snap: JobSnapshot, now: float) -> list[RankRow]:
    """Every seat of the current world (see RANK_STATES); a running rank is a straggler
    while its score is at or over the spec's threshold."""
    w = snap.world
    if w is None:
        return []
    scores = straggler_scores(snap, w)
    limit = threshold(snap)
    progress = seat_progress(snap, w)
    rows = []
    for r, seat in enumerate(w.seats):
        p = progress.get(r)
        state = _rank_state(snap, r, seat, p)
        score = scores.get(r)
        if state == "running" and score is not None and score >= limit:
            state = "straggler"
        rows.append(RankRow(
            rank=r, node=seat.node, state=state, step=p.step if p else -1, since_epoch=seat.since,
            step_time=p.step_time if p else None, compute_time=p.compute_time if p else None,
            straggler_score=round(score, 2) if score is not None else None,
            age_s=round(now - p.time, 1) if p else None, metrics=dict(p.metrics) if p else {}))
    return rows


def job_step(rows: list[RankRow]) -> int:
    """Steps the whole world completed: the slowest rank's, among ranks that completed one in
    their seat (a seat just taken over publishes -1 until it restored and stepped)."""
    steps = [r.step + 1 for r in rows if r.step >= 0]
    return min(steps) if steps else 0


def mean_metrics(rows: list[RankRow]) -> dict[str, float]:
    """Each metric's mean over the ranks that logged it (``loss`` first)."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.metrics.items():
            sums.setdefault(k, []).append(v)
    keys = sorted(sums, key=lambda k: (k != "loss", k))
    return {k: sum(sums[k]) / len(sums[k]) for k in keys}


def format_metrics(metrics: dict[str, float], most: int | None = None) -> str:
    """``loss 2.301 acc 0.41``: loss first, then the others by name (the first ``most``)."""
    keys = sorted(metrics, key=lambda k: (k != "loss", k))[:most]
    return " ".join(f"{k} {metrics[k]:.4g}" for k in keys)


def total_steps(snap: JobSnapshot) -> int | None:
    return snap.spec.steps if snap.spec else None


def spares(snap: JobSnapshot) -> list[str]:
    """Live nodes that hold no seat of the current world."""
    used = {s.node for s in (snap.world.seats if snap.world else ())}
    return [n.name for n in snap.nodes.values() if n.name not in used]


def job_status(snap: JobSnapshot, now: float) -> dict[str, Any]:
    """``hotspare status JOB --json`` (less the scheduler's line, which the CLI adds).
    ``step`` is :func:`job_step`, ``metrics`` :func:`mean_metrics`; ``error`` is a failed
    job's evidence (the end of the failing rank's traceback, "" if none)."""
    rows = rank_rows(snap, now)
    return {"job": snap.job, "state": snap.state.value, "message": snap.state_message,
            "epoch": snap.epoch, "ranks": [r.to_dict() for r in rows],
            "spares": spares(snap), "nodes": sorted(snap.nodes), "leader": snap.leader,
            "step": job_step(rows), "total_steps": total_steps(snap), "metrics": mean_metrics(rows),
            "error": snap.state_error}


def error_excerpt(error: str, lines: int = 8, indent: str = "  ") -> str:
    """The last ``lines`` lines of a failed job's traceback, indented: what the CLI shows under
    the job's sentence (the exception's own line is last; the whole traceback is in the rank's
    log)."""
    kept = [ln for ln in error.rstrip().splitlines() if ln.strip()][-lines:]
    return "\n".join(indent + ln for ln in kept)


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
