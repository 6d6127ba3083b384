"""The timeline's typed event constructors (orchestrator/store/events.py), without a server.

Each constructor must produce the kind, source, message and data keys that its writers
stored before it existed: ``orchestrator/timeline.py``, ``hotspare events`` and the chaos
tests read them by name. The last test feeds a recovery written with the constructors to
the timeline and checks every phase comes out.
"""

from __future__ import annotations

import dataclasses

import pytest

from hotspare.orchestrator.decide import Action, LossKind
from hotspare.orchestrator.store import Event, EventKind, events
from hotspare.orchestrator.timeline import recoveries


def _shape(ev: Event) -> tuple:
    return ev.kind, ev.source, ev.message, ev.data


def test_controller_events_keep_their_kinds_sources_and_data_keys():
    assert _shape(events.leader("host:1")) == (
        "leader", "host:1", "controller host:1 leads", {"controller": "host:1"})
    assert _shape(events.waiting("no spare")) == ("waiting", "controller", "no spare", {})
    assert _shape(events.placed("placing", 1, ["n0", "n1"])) == (
        "placed", "controller", "placing", {"epoch": 1, "seats": ["n0", "n1"]})
    assert _shape(events.failure(1, "n1", LossKind.HANG, "hung", 2, "s0", 9.5)) == (
        "failure", "controller", "rank 1 on n1: hung",
        {"rank": 1, "node": "n1", "kind": "hang", "epoch": 2, "spare": "s0", "detected": 9.5, "step": -1,
         "error": ""})
    assert _shape(events.failure(1, "n1", LossKind.ERROR, "raised", 2, None, 9.5, step=5, error="ValueError: boom",
                                 ended_job=True)) == (
        "failure", "controller", "rank 1 on n1: raised",
        {"rank": 1, "node": "n1", "kind": "error", "epoch": 2, "spare": None, "detected": 9.5, "step": 5,
         "error": "ValueError: boom", "ended_job": True})
    assert _shape(events.decided(Action.SHRINK, "why", 3, [1], [], 7.0)) == (
        "shrink", "controller", "why", {"epoch": 3, "lost": [1], "spares": [], "decided": 7.0})
    assert _shape(events.final("failed", "no spare")) == ("failed", "controller", "no spare", {})


def test_event_kinds_and_data_are_stored_as_plain_strings():
    ev = events.failure(1, "n1", LossKind.NODE_LOSS, "lost", 2, None, 1.0)
    assert type(ev.kind) is str and type(ev.data["kind"]) is str
    assert Event.from_json(ev.to_json()) == ev
    assert type(events.decided(Action.GROW, "r", 4, [], ["s"], 1.0).kind) is str


def test_only_world_writing_decisions_and_final_states_have_constructors():
    with pytest.raises(ValueError, match="writes no new world"):
        events.decided(Action.PLACE, "r", 1, [], [], 0.0)
    with pytest.raises(ValueError, match="not a final state"):
        events.final("running", "r")


def test_worker_events_keep_their_data_keys():
    assert _shape(events.rebuilt(2, 3, 1.0, 0.25, 4242, "n2")) == (
        "rebuilt", "rank2", "rank 2 joined epoch 3",
        {"epoch": 3, "rank": 2, "began": 1.0, "seconds": 0.25, "pid": 4242, "node": "n2"})
    info = {"source": "replica of n0", "bytes": 1024, "seconds": 0.5}
    assert _shape(events.restored(2, 3, 40, **info)) == (
        "restored", "rank2", "rank 2 resumes after step 40 (replica of n0)",
        {"epoch": 3, "rank": 2, "restore_step": 40, "source": "replica of n0", "bytes": 1024,
         "seconds": 0.5})
    assert _shape(events.resumed(2, 3, 41)) == (
        "resumed", "rank2", "rank 2 completed step 41", {"epoch": 3, "rank": 2, "step": 41})


def test_chaos_stores_only_the_targets_given_and_a_given_none_as_null():
    scheduled = events.chaos("rank0", "scheduled kill-node at step 5", "kill-node", rank=None,
                             node="n1", step=5, seconds=None)
    assert scheduled.data == {"action": "kill-node", "rank": None, "node": "n1", "step": 5,
                              "seconds": None}
    by_cli = events.chaos("cli", "restart-etcd: etcd down for 5.0s", "restart-etcd", seconds=5.0)
    assert by_cli.data == {"action": "restart-etcd", "seconds": 5.0}
    by_controller = events.chaos("A", "kill-controller: leader A dies", "kill-controller",
                                 controller="A")
    assert _shape(by_controller) == ("chaos", "A", "kill-controller: leader A dies",
                                     {"action": "kill-controller", "controller": "A"})


def test_every_constructor_kind_is_an_event_kind():
    made = [events.leader("a"), events.waiting("w"), events.placed("p", 1, []),
            events.failure(0, "n", "exit", "d", 2, None, 0.0),
            events.decided("swap", "s", 2, [0], ["x"], 0.0), events.final("succeeded", "f"),
            events.rebuilt(0, 2, 0.0, 0.0, 1, "n"), events.restored(0, 2, 1, "s", 0, 0.0),
            events.resumed(0, 2, 2), events.chaos("c", "m", "kill-rank", rank=0)]
    assert all(EventKind(e.kind).value == e.kind for e in made)


def _at(ev: Event, t: float) -> Event:
    return dataclasses.replace(ev, time=t)


def test_a_recovery_written_with_the_constructors_is_measured_phase_by_phase():
    timeline = [
        _at(events.chaos("cli", "kill-rank on n1 rank 1", "kill-rank", rank=1, node="n1"), 10.0),
        _at(events.failure(1, "n1", LossKind.EXIT, "died", 2, "s0", 10.5), 11.0),
        _at(events.decided(Action.SWAP, "swap", 2, [1], ["s0"], 11.0), 11.0),
        _at(events.rebuilt(0, 2, 11.0, 1.0, 100, "n0"), 12.0),
        _at(events.rebuilt(1, 2, 11.0, 1.5, 101, "s0"), 12.5),
        _at(events.restored(1, 2, 40, "replica", 10, 0.1), 13.0),
        _at(events.resumed(0, 2, 41), 14.0),
        _at(events.resumed(1, 2, 41), 14.5),
    ]
    (rec,) = recoveries(timeline)
    assert (rec["failed_rank"], rec["failed_node"], rec["spare_node"], rec["kind"]) == (
        1, "n1", "s0", "exit")
    assert (rec["detect_s"], rec["decide_s"], rec["rebuild_s"], rec["restore_s"],
            rec["total_s"]) == (0.5, 0.5, 1.5, 0.5, 4.5)
