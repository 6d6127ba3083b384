"""Typed constructors for the timeline's events: one place that spells each kind's data.

``orchestrator/timeline.py`` (the recovery breakdown), ``hotspare events`` and the tests
read these data keys by name, and they are written by four kinds of process (controller,
agent, worker, CLI). Building an event here keeps writer and reader agreeing on the
spelling. Each function returns an :class:`Event` stamped now; ``JobStore.put_event``
writes it (the worker's control link queues it first, off the step path).

The stored form is unchanged: ``kind`` is the :class:`EventKind`'s plain value and the data
keys are the ones written before these constructors existed.
"""

from __future__ import annotations

import time
from typing import Any

from .records import Event, EventKind

#: The controller's source name on the events it writes about the job.
CONTROLLER_SOURCE = "controller"


class _Unset:
    """A keyword not given (``None`` is a value some writers store on purpose)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def make(kind: EventKind | str, source: str, message: str = "", /, **data: Any) -> Event:
    """An event of any kind, stamped now (the constructors below are the typed forms)."""
    return Event(time=time.time(), kind=str(kind), source=source, message=message, data=data)


def _given(**data: Any) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not UNSET}


# -- controller --------------------------------------------------------------------------
def leader(ident: str) -> Event:
    """Controller ``ident`` took the job's leader key."""
    return make(EventKind.LEADER, ident, f"controller {ident} leads", controller=ident)


def waiting(reason: str) -> Event:
    """The controller decided to wait (nodes, capacity or a spare are missing)."""
    return make(EventKind.WAITING, CONTROLLER_SOURCE, reason)


def placed(reason: str, epoch: int, seats: list[str]) -> Event:
    """The first world: ``seats`` is the node of each rank."""
    return make(EventKind.PLACED, CONTROLLER_SOURCE, reason, epoch=epoch, seats=list(seats))


def failure(rank: int, node: str, kind: str, detail: str, epoch: int, spare: str | None,
            detected: float, step: int = -1, error: str = "", ended_job: bool = False) -> Event:
    """A lost rank, as the controller handles it. ``epoch`` is the world that replaces it
    (the current one when the job fails over it: ``ended_job``, no recovery to measure),
    ``detected`` when it was first seen: the timeline measures detect and decide from it.
    ``step``: the step it was computing (-1: not known); ``error``: the last line of what its
    code raised (``ValueError: boom``), if it did."""
    return make(EventKind.FAILURE, CONTROLLER_SOURCE, f"rank {rank} on {node}: {detail}",
                rank=rank, node=node, kind=str(kind), epoch=epoch, spare=spare, detected=detected,
                step=step, error=error, **({"ended_job": True} if ended_job else {}))


#: The decisions that write a new world after the first (their event kind is the action).
DECIDED_KINDS = (EventKind.SWAP, EventKind.SHRINK, EventKind.GROW)


def decided(action: str, reason: str, epoch: int, lost: list[int], spares: list[str],
            decided: float) -> Event:
    """A swap, shrink or grow written as world ``epoch`` at time ``decided``."""
    if str(action) not in DECIDED_KINDS:
        raise ValueError(f"{str(action)!r} writes no new world; expected one of "
                         f"{', '.join(k.value for k in DECIDED_KINDS)}")
    return make(str(action), CONTROLLER_SOURCE, reason, epoch=epoch, lost=list(lost),
                spares=list(spares), decided=decided)


#: The job's final states (their event kind is the state).
FINAL_KINDS = (EventKind.SUCCEEDED, EventKind.FAILED, EventKind.CANCELLED)


def final(state: str, reason: str) -> Event:
    """The job ended: ``state`` is succeeded, failed or cancelled."""
    if str(state) not in FINAL_KINDS:
        raise ValueError(f"{str(state)!r} is not a final state")
    return make(str(state), CONTROLLER_SOURCE, reason)


# -- worker ------------------------------------------------------------------------------
def rebuilt(rank: int, epoch: int, began: float, seconds: float, pid: int, node: str) -> Event:
    """Rank ``rank`` joined the process group of ``epoch`` (built from ``began`` on)."""
    return make(EventKind.REBUILT, f"rank{rank}", f"rank {rank} joined epoch {epoch}",
                epoch=epoch, rank=rank, began=began, seconds=seconds, pid=pid, node=node)


def restored(rank: int, epoch: int, restore_step: int, source: str, bytes: int,
             seconds: float) -> Event:
    """Rank ``rank`` restored the state of ``restore_step`` from ``source`` (the keyword
    names are the data keys, so a restore's info dict can be passed as ``**info``)."""
    return make(EventKind.RESTORED, f"rank{rank}",
                f"rank {rank} resumes after step {restore_step} ({source})", epoch=epoch,
                rank=rank, restore_step=restore_step, source=source, bytes=bytes, seconds=seconds)


def resumed(rank: int, epoch: int, step: int) -> Event:
    """Rank ``rank`` completed its first step after a recovery: the timeline's end mark."""
    return make(EventKind.RESUMED, f"rank{rank}", f"rank {rank} completed step {step}",
                epoch=epoch, rank=rank, step=step)


# -- anyone ------------------------------------------------------------------------------
def chaos(source: str, message: str, action: str, rank: int | None = UNSET,
          node: str | None = UNSET, step: int | None = UNSET, seconds: float | None = UNSET,
          **extra: Any) -> Event:
    """A failure injected (by the CLI or a scheduled entry) or carried out (agent,
    controller). Only the targets given are stored; a ``None`` given is stored as null.
    The timeline matches a failure to its chaos event by ``rank``, or by ``node`` for the
    actions that take a node down."""
    return make(EventKind.CHAOS, source, message, action=action,
                **_given(rank=rank, node=node, step=step, seconds=seconds), **extra)
