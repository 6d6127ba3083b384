"""Chaos inside a recovery (``during:``): the spec's field, and which process fires an entry
and when."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hotspare.orchestrator import chaos
from hotspare.orchestrator.spec import ChaosEntry, JobSpec, SpecError, parse_spec
from hotspare.recovery.chaos_hook import ChaosHook

from ..conftest import EXAMPLES
from .test_chaos_hook import FakeJobStore


def _spec(*entries: dict) -> JobSpec:
    return parse_spec({"name": "j", "entrypoint": f"{EXAMPLES / 'gpt.py'}:train", "ranks": 3, "steps": 50,
                       "chaos": list(entries)})


def test_during_names_a_recovery_phase_and_round_trips():
    spec = _spec({"at_step": 20, "action": "kill-node", "node": "node1", "during": "fetch"})
    assert spec.chaos[0] == ChaosEntry(at_step=20, action="kill-node", node="node1", during="fetch")
    assert JobSpec.from_json(spec.to_json()).chaos == spec.chaos
    assert _spec({"at_step": 20, "action": "kill-rank", "rank": 1}).chaos[0].during is None


@pytest.mark.parametrize("entry, error", [
    ({"at_step": 5, "action": "kill-rank", "rank": 1, "during": "restor"},
     "chaos[0].during: must be one of rendezvous, restore, fetch, got 'restor' (did you mean 'restore'?)"),
    ({"at_step": 5, "action": "kill-rank", "rank": 1, "during": 2},
     "chaos[0].during: must be one of rendezvous, restore, fetch, got 2"),
    ({"at_step": 5, "action": "slow-rank", "rank": 1, "seconds": 0.1, "during": "restore"},
     "chaos[0].during: slow-rank slows every step and cannot fire during a recovery phase (remove during:"),
])
def test_a_bad_during_is_refused_naming_the_field_and_the_fix(entry, error):
    with pytest.raises(SpecError) as e:
        _spec(entry)
    assert error in str(e.value)


def test_every_phase_is_reached_by_the_code():
    """The names are the table's; the session and the restore agreement call exactly these."""
    import inspect

    from hotspare.recovery import restore, session

    code = inspect.getsource(session) + inspect.getsource(restore)
    for phase in chaos.PHASES:
        assert f'"{phase}"' in code, phase


def _hook(js, *entries, node="node0", agent_pid=0, beat=lambda: None):
    return ChaosHook(js, entries, job="j", node=node, agent_pid=agent_pid, persist_root="/nonexistent",
                     event=lambda *a, **k: None, beat=beat, lease_ttl=1.0)


def test_a_phase_entry_fires_in_its_rank_at_its_phase_once_it_is_due_and_never_at_a_step_start(monkeypatch):
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    js = FakeJobStore()
    hook = _hook(js, ChaosEntry(at_step=20, action="kill-rank", rank=1, during="restore"))
    hook.at_step(20, rank=1)  # not at the start of a step
    hook.at_phase("rendezvous", 1, 25)  # another phase
    hook.at_phase("restore", 0, 25)  # another rank
    hook.at_phase("restore", 1, 19)  # too early
    assert killed == [] and js.fired == set()
    hook.at_phase("restore", 1, 20)
    assert killed == [(os.getpid(), signal.SIGKILL)]
    [(kind, source, message, data)] = js.events
    assert (kind, source, message) == ("chaos", "rank1", "scheduled kill-rank at step 20 during restore of rank 1")
    assert data["during"] == "restore" and data["step"] == 20
    hook.at_phase("restore", 1, 30)  # fired once
    assert len(killed) == 1


def test_an_entry_without_a_rank_fires_in_the_first_process_to_reach_the_phase():
    js = FakeJobStore()
    first = _hook(js, ChaosEntry(at_step=3, action="kill-controller", during="rendezvous"))
    second = _hook(js, ChaosEntry(at_step=3, action="kill-controller", during="rendezvous"))
    first.at_phase("rendezvous", 2, 4)
    second.at_phase("rendezvous", 0, 4)
    assert [node for node, _ in js.sent] == ["_controller"]
    assert not second._pending["rendezvous"], "claimed elsewhere: never asked again"


def test_a_phase_with_no_entry_for_it_costs_nothing():
    class NoStore:
        def __getattr__(self, name):
            raise AssertionError(f"etcd touched: {name}")

    hook = _hook(NoStore(), ChaosEntry(at_step=3, action="kill-rank", rank=0))
    hook.at_phase("fetch", 0, 10)
    hook.at_phase("rendezvous", 0, 10)


class Registry(FakeJobStore):
    """Knows which nodes are registered; ``gone_after`` reads later, the target's lease expires."""

    def __init__(self, gone_after: int) -> None:
        super().__init__()
        self.reads = 0
        self.gone_after = gone_after

    def node_registered(self, node: str) -> bool:
        self.reads += 1
        return self.reads <= self.gone_after


def test_killing_another_node_during_a_phase_holds_the_phase_until_that_node_is_gone(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: None)
    js, beats = Registry(gone_after=3), []
    hook = _hook(js, ChaosEntry(at_step=5, action="kill-node", node="node1", during="fetch"),
                 beat=lambda: beats.append(1))
    hook.at_phase("fetch", 2, 6)
    assert js.sent == [("node1", {"action": "kill-node", "seconds": None, "evented": True})]
    assert js.reads == 4 and len(beats) == 3, "it beat while it waited for node1's lease to expire"
