"""What ends a job instead of one more recovery: the failure guards of :func:`decide`.

A spare brings back a lost machine, not broken code, and a fault that strikes again after
every restore would otherwise consume spare after spare forever. Each guard is a pure
function of the :class:`JobSnapshot` (its failure history, ``/hotspare/<job>/failures``,
survives a controller failover), the spec and the losses at hand, and returns the
:class:`Verdict` the job fails with, or None:

* :func:`startup_error` -- a warm worker could not even load the job's code (its report
  names rank -1): no node will do better, whatever ``on_code_error`` says; or, before the
  first world, a node's agent could not start (kind ``agent``): the job would wait for that
  node forever;
* :func:`code_error` -- the training function raised (loss kind ``error``): fail at once
  (``on_code_error: fail``, the default) or retry on a spare until ``code_error_retries``
  code errors were retried;
* :func:`crash_loop` -- one seat failed at the same step ``crash_loop_limit`` times in a row,
  whatever the kind (each restore led to the same failure);
* :func:`too_many` -- more than ``max_failures`` failures within ``failure_window`` seconds.

:func:`new_failures` turns the losses a decision handles into the history's records.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .spec import JobSpec
from .store.job import JobSnapshot
from .store.records import AGENT_FAILED, Failure, World, last_line

if TYPE_CHECKING:
    from .decide import Loss

#: Loss kinds the guards do not count: a fenced worker's seat had moved on already (a
#: consequence, not a failure), a straggler is slow, not failed.
UNCOUNTED = frozenset({"fenced", "straggler"})


@dataclass(frozen=True)
class Verdict:
    """Why the job fails (one sentence) and the evidence: a traceback's end, if any."""

    reason: str
    error: str = ""


def startup_error(obs: JobSnapshot) -> Verdict | None:
    """A warm worker's report that the job's code cannot start (rank -1, kind ``error``), or,
    while the job waits for its first world, an agent's that it could not start (rank -1,
    kind ``agent``): placement would wait for that node forever. Once the job runs, a node
    whose agent fails is handled like a lost node (a spare that never came is no loss)."""
    if obs.world is None:
        agents = sorted((r for r in obs.reports if r.rank < 0 and r.kind == AGENT_FAILED),
                        key=lambda r: (r.time, r.node))
        if agents:
            rep = agents[0]
            return Verdict(f"the agent of node {rep.node} could not start: {rep.message}; the job cannot be "
                           f"placed without it (its log: `hotspare logs {obs.job} --node {rep.node}`)",
                           rep.traceback)
    reps = sorted((r for r in obs.reports if r.rank < 0 and r.kind == "error"), key=lambda r: (r.time, r.node))
    if not reps:
        return None
    rep = reps[0]
    entry = obs.spec.entrypoint if obs.spec is not None else "the entrypoint"
    others = sorted({r.node for r in reps} - {rep.node})
    return Verdict(
        f"the entrypoint {entry} cannot start on node {rep.node}"
        + (f" (nor on {', '.join(others)})" if others else "")
        + f": {last_line(rep.traceback) or rep.message}; fix it and submit the job again "
        "(the whole traceback: `hotspare logs`)",
        rep.traceback,
    )


def raised(lo: Loss) -> str:
    """``rank 1 on node-b raised at step 5: ValueError: boom``."""
    at = f"at step {lo.step}" if lo.step >= 0 else "before its first step"
    return f"rank {lo.rank} on {lo.node} raised {at}: {last_line(lo.traceback) or lo.detail}"


def code_error(spec: JobSpec, history: Sequence[Failure], losses: Sequence[Loss]) -> Verdict | None:
    """The training function raised: the job fails now (``on_code_error: fail``), or once
    ``code_error_retries`` code errors were retried (``retry``: each counted in the history)."""
    errors = [lo for lo in losses if lo.kind == "error"]
    if not errors:
        return None
    first = errors[0]
    what = raised(first) + (f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else "")
    if spec.on_code_error == "fail":
        return Verdict(f"{what} (on_code_error: fail); fix the code, or set on_code_error: retry "
                       "to retry it on a spare", first.traceback)
    count = sum(1 for f in history if f.kind == "error") + len(errors)
    if count > spec.code_error_retries:
        return Verdict(f"{what}; that is code error {count}, and on_code_error: retry allows "
                       f"{spec.code_error_retries} retries (code_error_retries); fix the code",
                       first.traceback)
    return None


def crash_loop(spec: JobSpec, world: World, history: Sequence[Failure],
               losses: Sequence[Loss]) -> Verdict | None:
    """A seat (its sid: the state, whatever its rank number) failing at the same step
    ``crash_loop_limit`` times in a row, counting this loss: every restore ran into it again."""
    for lo in losses:
        if lo.step < 0 or str(lo.kind) in UNCOUNTED or lo.rank >= world.size:
            continue
        n = 1 + _same_step_in_a_row(history, world.sid(lo.rank), lo.step)
        if n >= spec.crash_loop_limit:
            return Verdict(
                f"rank {lo.rank} failed at step {lo.step} {n} times in a row, after each restore "
                f"(crash loop): {lo.detail}; fix what fails it there (see `hotspare logs`), or raise "
                f"crash_loop_limit ({spec.crash_loop_limit})",
                lo.traceback,
            )
    return None


def _same_step_in_a_row(history: Sequence[Failure], sid: int, step: int) -> int:
    """How many of seat ``sid``'s latest counted failures, newest first, were at ``step``."""
    n = 0
    for f in reversed(history):
        if f.sid != sid or f.kind in UNCOUNTED:
            continue
        if f.step != step:
            break
        n += 1
    return n


def too_many(spec: JobSpec, history: Sequence[Failure], now: float,
             losses: Sequence[Loss]) -> Verdict | None:
    """More than ``max_failures`` failures (these losses included) within the last
    ``failure_window`` seconds: whatever the cause, it keeps coming back."""
    counted = [lo for lo in losses if str(lo.kind) not in UNCOUNTED]
    if not counted:
        return None
    since = now - spec.failure_window
    n = len(counted) + sum(1 for f in history if f.kind not in UNCOUNTED and f.time >= since)
    if n <= spec.max_failures:
        return None
    lo = counted[0]
    return Verdict(
        f"{n} failures within {spec.failure_window:g}s, more than max_failures={spec.max_failures} "
        f"in failure_window={spec.failure_window:g}s (the latest: rank {lo.rank} on {lo.node}: "
        f"{lo.detail}); find the cause with `hotspare events`, or raise max_failures or "
        "failure_window if failures this often are expected",
        lo.traceback,
    )


def verdict(obs: JobSnapshot, spec: JobSpec, world: World, losses: Sequence[Loss]) -> Verdict | None:
    """The first guard that fails the job over these losses: code errors, then a crash loop,
    then the failure rate."""
    return (code_error(spec, obs.failures, losses)
            or crash_loop(spec, world, obs.failures, losses)
            or too_many(spec, obs.failures, obs.now, losses))


def new_failures(obs: JobSnapshot, world: World, losses: Iterable[Loss]) -> tuple[Failure, ...]:
    """The history's records of the losses a decision on ``world`` handles."""
    return tuple(
        Failure(time=lo.detected or obs.now, rank=lo.rank,
                sid=world.sid(lo.rank) if 0 <= lo.rank < world.size else lo.rank,
                node=lo.node, kind=str(lo.kind), step=lo.step, epoch=world.epoch)
        for lo in losses
    )
