"""Recovery breakdowns from a job's timeline (orchestrator/timeline.py), on events built by hand."""

from __future__ import annotations

from hotspare.orchestrator.store import Event
from hotspare.orchestrator.timeline import (
    SUMMARY_FIELDS,
    format_event,
    format_section,
    recoveries,
    summary,
)


def ev(t: float, kind: str, source: str = "x", /, **data: object) -> Event:
    return Event(time=t, kind=kind, source=source, message=f"{kind} at {t}", data=data)


def failure(t: float, rank: int, node: str, epoch: int = 2) -> Event:
    return ev(t, "failure", "controller", rank=rank, node=node, epoch=epoch, kind="lease",
              spare="s0", detected=t - 0.25)


def healed(epoch: int, start: float) -> list[Event]:
    return [ev(start, "swap", "controller", epoch=epoch), ev(start + 1, "rebuilt", epoch=epoch),
            ev(start + 2, "restored", epoch=epoch), ev(start + 3, "resumed", epoch=epoch)]


def test_a_node_loss_is_timed_from_the_injection_aimed_at_its_node():
    for action in ("kill-node", "partition-node"):
        events = [ev(10.0, "chaos", "cli", action=action, node="n1", rank=None),
                  failure(14.0, rank=3, node="n1"), *healed(2, 15.0)]
        (rec,) = recoveries(events)
        assert rec["detect_s"] == 3.75, action  # chaos at 10, detected at 13.75
        assert rec["total_s"] == 8.0


def test_an_injection_at_another_rank_or_node_is_not_the_cause():
    events = [ev(10.0, "chaos", "cli", action="kill-rank", node="n1", rank=0),
              ev(11.0, "chaos", "cli", action="kill-node", node="n2", rank=None),
              failure(14.0, rank=3, node="n1"), *healed(2, 15.0)]
    (rec,) = recoveries(events)
    assert rec["detect_s"] == 0.0  # timed from its own detection: no injection caused it
    assert rec["decide_s"] == 1.25


def test_a_second_failure_during_recovery_is_followed_to_the_epoch_that_resumed():
    events = [failure(10.0, rank=1, node="n1"), ev(10.5, "swap", "controller", epoch=2),
              ev(11.0, "rebuilt", epoch=3), *healed(3, 12.0)[1:]]
    (rec,) = recoveries(events)
    assert rec["rebuild_s"] == 2.5 and rec["total_s"] == 5.25


def test_only_the_controller_s_failures_count_and_the_summary_keeps_its_fields():
    events = [ev(9.0, "failure", "agent", rank=1, node="n1", epoch=2), failure(10.0, 1, "n1"), *healed(2, 11.0)]
    recs = recoveries(events)
    assert len(recs) == 1
    assert [list(r) for r in summary(recs)] == [list(SUMMARY_FIELDS)]


def test_the_recoveries_section_is_a_table_in_seconds():
    recs = recoveries([failure(10.0, 1, "n1"), *healed(2, 11.0)])
    lines = format_section(recs).splitlines()
    assert lines[0] == "recoveries:" and lines[1].split()[:4] == ["rank", "kind", "from", "to"]
    assert lines[2].split()[:4] == ["1", "lease", "n1", "s0"] and lines[-1] == "(seconds)"
    assert format_section([]) == "recoveries:\nno recoveries"


def test_an_event_line_shows_its_offset_from_the_first():
    line = format_event(ev(12.5, "swap", "controller"), t0=10.0)
    assert "+   2.500s swap" in line and line.endswith("controller swap at 12.5")
