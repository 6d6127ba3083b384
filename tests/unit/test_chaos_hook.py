"""Scheduled chaos in the training process: which rank fires an entry, that it fires once,
and where each action goes (the process itself, a node's agent, the controller, the CLI)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from hotspare.orchestrator.spec import ChaosEntry
from hotspare.orchestrator.store import CONTROLLER, StoreError
from hotspare.recovery.chaos_hook import ChaosHook


class FakeJobStore:
    def __init__(self, fail: bool = False) -> None:
        self.fired: set[int] = set()
        self.events: list[tuple] = []
        self.sent: list[tuple[str, dict]] = []
        self.fail = fail

    def fire_once(self, index: int) -> bool:
        if self.fail:
            raise StoreError("etcd is away")
        if index in self.fired:
            return False
        self.fired.add(index)
        return True

    def put_event(self, ev):
        self.events.append((ev.kind, ev.source, ev.message, ev.data))

    def send_chaos(self, node: str, command: dict) -> str:
        self.sent.append((node, command))
        return "id"


def _hook(js, *entries, agent_pid=0, persist_root="/nonexistent", events=None):
    return ChaosHook(js, entries, job="j", node="node0", agent_pid=agent_pid, persist_root=persist_root,
                     event=lambda kind, msg, **d: (events if events is not None else []).append((str(kind), msg, d)))


def test_an_entry_fires_once_in_its_rank_only():
    js = FakeJobStore()
    hook = _hook(js, ChaosEntry(at_step=5, action="slow-rank", rank=1, seconds=0.25))
    hook.at_step(5, rank=0)
    hook.at_step(4, rank=1)
    assert hook.slow == 0.0 and not js.events
    hook.at_step(5, rank=1)
    assert hook.slow == 0.25
    [(kind, source, message, data)] = js.events
    assert (kind, source, message) == ("chaos", "rank1", "scheduled slow-rank at step 5 of rank 1")
    assert data == {"action": "slow-rank", "rank": 1, "node": "node0", "step": 5, "seconds": 0.25}
    hook.slow = 0.0
    hook.at_step(5, rank=1)  # the step recomputed after a rollback
    assert hook.slow == 0.0 and len(js.events) == 1


def test_slow_rank_without_seconds_takes_the_tables_default():
    hook = _hook(FakeJobStore(), ChaosEntry(at_step=0, action="slow-rank", rank=0))
    hook.at_step(0, rank=0)
    assert hook.slow == 0.5


def test_node_and_control_entries_fire_in_rank_0_and_go_to_their_executor():
    js = FakeJobStore()
    hook = _hook(js, ChaosEntry(at_step=3, action="partition-node", node="node2", seconds=4.0),
                 ChaosEntry(at_step=3, action="kill-node", rank=2),
                 ChaosEntry(at_step=3, action="kill-controller"))
    hook.at_step(3, rank=1)
    assert js.sent == []
    hook.at_step(3, rank=0)  # the kill-node entry targets rank 2: not rank 0's
    assert js.sent == [("node2", {"action": "partition-node", "seconds": 4.0, "evented": True}),
                       (CONTROLLER, {"action": "kill-controller", "evented": True})]
    hook.at_step(3, rank=2)  # rank 2 runs on this node, and there is no agent pid to kill
    assert js.sent[-1] == ("node0", {"action": "kill-node", "seconds": None, "evented": True})


def test_actions_on_the_process_itself_are_done_at_once(monkeypatch):
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr("time.sleep", lambda s: None)
    js = FakeJobStore()
    hook = _hook(js, ChaosEntry(at_step=1, action="kill-rank", rank=0),
                 ChaosEntry(at_step=2, action="hang-rank", rank=0),
                 ChaosEntry(at_step=3, action="kill-node", rank=0), agent_pid=4242)
    for step in (1, 2, 3):
        hook.at_step(step, rank=0)
    me = os.getpid()
    assert killed == [(me, signal.SIGKILL), (me, signal.SIGSTOP), (4242, signal.SIGKILL), (me, signal.SIGKILL)]
    assert js.sent == []


def test_restart_etcd_is_handed_to_a_detached_cli(monkeypatch):
    runs: list[list[str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: runs.append(argv))
    hook = _hook(FakeJobStore(), ChaosEntry(at_step=0, action="restart-etcd"))
    hook.at_step(0, rank=0)
    [argv] = runs
    assert argv[1:] == ["-m", "hotspare.orchestrator.cli", "chaos", "j", "--action", "restart-etcd", "--seconds", "5.0"]


def test_an_etcd_outage_skips_the_entry_without_failing_the_step(caplog):
    hook = _hook(FakeJobStore(fail=True), ChaosEntry(at_step=0, action="slow-rank", rank=0))
    hook.at_step(0, rank=0)
    assert hook.slow == 0.0 and any("not fired" in r.getMessage() for r in caplog.records)


def test_corrupt_checkpoint_flips_bytes_of_this_ranks_newest_file(tmp_path):
    d = tmp_path / "step00000010"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    f = d / "rank1.safetensors"
    f.write_bytes(bytes(64))
    events: list = []
    hook = _hook(FakeJobStore(), ChaosEntry(at_step=0, action="corrupt-checkpoint", rank=1),
                 persist_root=str(tmp_path), events=events)
    hook.at_step(0, rank=1)
    assert f.read_bytes() == bytes(32) + b"\xff" * 16 + bytes(16)
    assert events == [("corrupted", f"corrupted {f}", {"rank": 1, "step": 10, "path": str(f)})]


@pytest.mark.parametrize("root", ["/nonexistent", "memory://bucket/ckpt"])
def test_corrupt_checkpoint_without_a_local_checkpoint_says_so(root):
    events: list = []
    hook = _hook(FakeJobStore(), ChaosEntry(at_step=0, action="corrupt-checkpoint", rank=0),
                 persist_root=root, events=events)
    hook.at_step(0, rank=0)
    assert events == [("corrupted", f"corrupt-checkpoint: no complete checkpoint in {root} yet", {"rank": 0})]
