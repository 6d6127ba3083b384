"""Turn a job's events into recovery breakdowns: detect, decide, rebuild, restore.

A recovery starts at the failure (the chaos injection if we caused it, else the moment
an agent or the controller saw it) and ends when every rank has completed its first
step in the new world. Phases: detect (failure -> seen), decide (seen -> new world
written), rebuild (-> last rank joined the new group), restore (-> last rank restored),
and total (-> last rank completed a step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .chaos import NODE_LOSS_ACTIONS
from .store.records import Event, EventKind

#: The fields of a recovery that ``hotspare run --json`` reports (``events --json``: all).
SUMMARY_FIELDS = ("failed_rank", "failed_node", "spare_node", "kind", "detect_s", "decide_s",
                  "rebuild_s", "restore_s", "total_s")


def _last_before(events: list[Event], t: float, pred: Callable[[Event], bool],
                 window: float = 120.0) -> Event | None:
    best = None
    for e in events:
        if e.time <= t and t - e.time <= window and pred(e):
            best = e
    return best


def _max_time(events: list[Event], kind: EventKind, epoch: int) -> float | None:
    ts = [e.time for e in events if e.kind == kind and e.data.get("epoch") == epoch]
    return max(ts) if ts else None


def _caused_by(rank: int | None, node: str | None) -> Callable[[Event], bool]:
    """The chaos injection behind a failure: aimed at its rank, or at its node by an action
    that takes the whole node down."""
    def match(e: Event) -> bool:
        return e.kind == EventKind.CHAOS and (
            e.data.get("rank") == rank
            or (e.data.get("action") in NODE_LOSS_ACTIONS and e.data.get("node") == node))
    return match


def _span(a: float | None, b: float | None) -> float | None:
    return round(b - a, 3) if a is not None and b is not None else None


def _recovery(events: list[Event], f: Event) -> dict[str, Any]:
    """One controller ``failure`` event's recovery, phase by phase."""
    rank, node, epoch = f.data.get("rank"), f.data.get("node"), f.data.get("epoch")
    detected = float(f.data.get("detected") or f.time)
    chaos = _last_before(events, detected, _caused_by(rank, node))
    failed_at = chaos.time if chaos else detected
    decision = next((e for e in events if e.kind in (EventKind.SWAP, EventKind.SHRINK)
                     and e.data.get("epoch") == epoch), None)
    decided = decision.time if decision else None
    # a second failure during recovery moves the world on: follow to the epoch that resumed
    e = epoch
    resumed = _max_time(events, EventKind.RESUMED, e)
    while resumed is None and any(x.data.get("epoch") == e + 1 for x in events if x.kind == EventKind.REBUILT):
        e += 1
        resumed = _max_time(events, EventKind.RESUMED, e)
    rebuilt = _max_time(events, EventKind.REBUILT, e)
    restored = _max_time(events, EventKind.RESTORED, e)
    return {
        "failed_rank": rank,
        "failed_node": node,
        "spare_node": f.data.get("spare"),
        "kind": f.data.get("kind"),
        "epoch": epoch,
        "detect_s": _span(failed_at, detected),
        "decide_s": _span(detected, decided),
        "rebuild_s": _span(decided, rebuilt),
        "restore_s": _span(rebuilt, restored),
        "total_s": _span(failed_at, resumed),
    }


def recoveries(events: list[Event]) -> list[dict[str, Any]]:
    """Every recovery in a job's timeline, oldest first (one per controller ``failure``; not
    the failures the job ended with: nothing recovered from them)."""
    events = sorted(events, key=lambda e: e.time)
    return [_recovery(events, f) for f in events
            if f.kind == EventKind.FAILURE and f.source == "controller" and not f.data.get("ended_job")]


def summary(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recoveries as ``hotspare run --json`` reports them (SUMMARY_FIELDS only)."""
    return [{k: r[k] for k in SUMMARY_FIELDS} for r in recs]


def format_recoveries(recs: list[dict[str, Any]]) -> str:
    if not recs:
        return "no recoveries"

    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    head = f"{'rank':>4} {'kind':<9} {'from':<8} {'to':<8} {'detect':>7} {'decide':>7} {'rebuild':>8} {'restore':>8} {'total':>7}"
    rows = [head]
    for r in recs:
        rows.append(
            f"{f(r['failed_rank']):>4} {f(r['kind']):<9} {f(r['failed_node']):<8} {f(r['spare_node']):<8} "
            f"{f(r['detect_s']):>7} {f(r['decide_s']):>7} {f(r['rebuild_s']):>8} {f(r['restore_s']):>8} {f(r['total_s']):>7}"
        )
    return "\n".join(rows) + "\n(seconds)"


def format_section(recs: list[dict[str, Any]]) -> str:
    """The ``recoveries:`` block that ``hotspare run`` and ``hotspare events`` end with."""
    return "recoveries:\n" + format_recoveries(recs)


def format_event(e: Event, t0: float) -> str:
    """One timeline line of ``hotspare events``: wall clock, offset from ``t0``, kind, source."""
    return (f"{time.strftime('%H:%M:%S', time.localtime(e.time))}.{int(e.time * 1000) % 1000:03d} "
            f"+{e.time - t0:8.3f}s {e.kind:<12} {e.source:<10} {e.message}")
