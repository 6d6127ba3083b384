"""The store's records and key layout, without a server.

A record written by a newer hotspare (one more field) must load in an older reader during
a rolling upgrade, and the explicit ``JobKeys`` properties must name exactly the keys the
layout has always had: they are the on-disk format in etcd.
"""

from __future__ import annotations

import json
import re

import pytest

from hotspare.orchestrator.store import (
    Event,
    JobKeys,
    Node,
    Progress,
    Report,
    Seat,
    StateRecord,
    StoreUnavailable,
    World,
    wait_until,
)

RECORDS = [
    Node("node0", "inc1", "spare", 2, host="10.0.0.1", replica_port=7000, pid=42, warm=1),
    Report("node0", 3, 2, "hang", exit_code=None, signal=9, time=1.5, message="hung"),
    Progress(1, 50, 2, "node0", 3.0, step_time=0.1, compute_time=0.05, metrics={"loss": 0.5}),
    Event(10.0, "swap", "controller", "why", {"epoch": 2, "lost": [1]}),
    StateRecord("running", 5.0, "placed"),
]


def _with_extra(raw: bytes, **extra: object) -> bytes:
    return json.dumps({**json.loads(raw), **extra}).encode()


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_round_trips_through_json(record):
    assert type(record).from_json(record.to_json()) == record


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_from_a_newer_writer_with_an_extra_field_loads(record):
    raw = _with_extra(record.to_json(), field_from_the_future={"any": "thing"})
    assert type(record).from_json(raw) == record


def test_a_world_from_a_newer_writer_loads_with_extra_fields_in_it_and_in_its_seats():
    world = World(3, (Seat("node0", "i0", 1), Seat("spare0", "i1", 3, sid=1)), reason="swap",
                  lost=(1,), shrunk_from=0, grown_from=0)
    d = json.loads(world.to_json())
    d["placement_hint"] = "rack-a"
    d["seats"][1]["gpu"] = "H200"
    assert World.from_json(json.dumps(d).encode()) == world
    assert World.from_json(world.to_json()) == world


def test_a_record_missing_a_required_field_is_still_an_error():
    """Tolerance is for fields added, not for a record that is not one."""
    d = json.loads(RECORDS[0].to_json())
    del d["incarnation"]
    with pytest.raises(TypeError):
        Node.from_json(json.dumps(d).encode())


def test_state_record_names_its_job_state():
    assert StateRecord("cancelled").job_state.terminal
    assert not StateRecord("running").job_state.terminal


def test_job_keys_are_the_layout_the_keys_always_had():
    k = JobKeys("j")
    assert {
        "prefix": k.prefix, "spec": k.spec, "secret": k.secret, "state": k.state,
        "cancel": k.cancel, "leader": k.leader, "epoch": k.epoch, "checkpoint": k.checkpoint,
        "progress_prefix": k.progress_prefix, "events_prefix": k.events_prefix,
        "rdzv_prefix": k.rdzv_prefix,
    } == {
        "prefix": "/hotspare/j/", "spec": "/hotspare/j/spec", "secret": "/hotspare/j/secret",
        "state": "/hotspare/j/state", "cancel": "/hotspare/j/cancel",
        "leader": "/hotspare/j/leader", "epoch": "/hotspare/j/epoch",
        "checkpoint": "/hotspare/j/checkpoint", "progress_prefix": "/hotspare-progress/j/",
        "events_prefix": "/hotspare-events/j/", "rdzv_prefix": "/hotspare-rdzv/j/",
    }
    assert k.world(12) == "/hotspare/j/world/00000012"
    assert k.node("n1") == "/hotspare/j/nodes/n1"
    assert k.report("n1", 3) == "/hotspare/j/reports/n1/3"
    assert k.done(2) == "/hotspare/j/done/2"
    assert k.progress(2) == "/hotspare-progress/j/2"
    assert k.chaos("n1", "c7") == "/hotspare/j/chaos/n1/c7"
    assert k.chaos_node_prefix("n1") == "/hotspare/j/chaos/n1/"
    assert k.fired(4) == "/hotspare/j/fired/4"
    assert re.fullmatch(r"/hotspare-events/j/00000000001234567890-[0-9a-f]{6}", k.event(1234567890))


def test_job_keys_have_no_magic_attributes():
    with pytest.raises(AttributeError):
        JobKeys("j").world_prefix  # noqa: B018 - the lookup is the test


def test_wait_until_returns_true_once_the_predicate_holds_and_counts_outages_as_not_yet():
    answers = iter([StoreUnavailable("down"), False, True])

    def pred() -> bool:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert wait_until(pred, timeout=60, interval=0)


def test_wait_until_gives_up_when_abort_says_so_long_before_its_timeout():
    rounds = []
    assert not wait_until(lambda: rounds.append(1) or False, timeout=3600, interval=0,
                          abort=lambda: len(rounds) >= 3)
    assert len(rounds) == 3


def test_wait_until_prefers_a_true_predicate_over_abort():
    assert wait_until(lambda: True, timeout=3600, abort=lambda: True)


def test_wait_until_without_abort_times_out():
    assert not wait_until(lambda: False, timeout=0, interval=0)
