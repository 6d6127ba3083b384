"""Turn a job's events into recovery breakdowns: detect, decide, rebuild, restore.

A recovery starts at the failure (the chaos injection if we caused it, else the moment
an agent or the controller saw it) and ends when every rank has completed its first
step in the new world. Phases: detect (failure -> seen), decide (seen -> new world
written), rebuild (-> last rank joined the new group), restore (-> last rank restored),
and total (-> last rank completed a step).
"""

from __future__ import annotations

from typing import Any

from .store.records import Event


def _last_before(events: list[Event], t: float, pred, window: float = 120.0) -> Event | None:
    best = None
    for e in events:
        if e.time <= t and t - e.time <= window and pred(e):
            best = e
    return best


def _max_time(events: list[Event], kind: str, epoch: int) -> float | None:
    ts = [e.time for e in events if e.kind == kind and e.data.get("epoch") == epoch]
    return max(ts) if ts else None


def recoveries(events: list[Event]) -> list[dict[str, Any]]:
    events = sorted(events, key=lambda e: e.time)
    out = []
    for f in events:
        if f.kind != "failure" or f.source != "controller":
            continue
        rank, node, epoch = f.data.get("rank"), f.data.get("node"), f.data.get("epoch")
        detected = float(f.data.get("detected") or f.time)
        chaos = _last_before(
            events,
            detected,
            lambda e, rank=rank, node=node: e.kind == "chaos"
            and (
                e.data.get("rank") == rank
                or (e.data.get("action") in ("kill-node", "partition-node") and e.data.get("node") == node)
            ),
        )
        failed_at = chaos.time if chaos else detected
        decision = next(
            (e for e in events if e.kind in ("swap", "shrink") and e.data.get("epoch") == epoch), None
        )
        decided = decision.time if decision else None
        # a second failure during recovery moves the world on: follow to the epoch that resumed
        e = epoch
        resumed = _max_time(events, "resumed", e)
        while resumed is None and any(x.data.get("epoch") == e + 1 for x in events if x.kind == "rebuilt"):
            e += 1
            resumed = _max_time(events, "resumed", e)
        rebuilt = _max_time(events, "rebuilt", e)
        restored = _max_time(events, "restored", e)

        def span(a: float | None, b: float | None) -> float | None:
            return round(b - a, 3) if a is not None and b is not None else None

        out.append(
            {
                "failed_rank": rank,
                "failed_node": node,
                "spare_node": f.data.get("spare"),
                "kind": f.data.get("kind"),
                "epoch": epoch,
                "detect_s": span(failed_at, detected),
                "decide_s": span(detected, decided),
                "rebuild_s": span(decided, rebuilt),
                "restore_s": span(rebuilt, restored),
                "total_s": span(failed_at, resumed),
            }
        )
    return out


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
