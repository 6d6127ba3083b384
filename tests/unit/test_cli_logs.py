"""`hotspare logs`: cutting a slot log into its workers' parts, and following files."""

from __future__ import annotations

from hotspare.agents.worker_link import WORKER_STARTED
from hotspare.orchestrator.commands.logs import (
    Follower,
    assigned_workers,
    pre_assignment,
    worker_parts,
)
from hotspare.orchestrator.store import Event


def _line(pid: int, msg: str) -> str:
    return f"2026-01-01 00:00:00,000 INFO [job node0 pid{pid}] root: {msg}"


SLOT_LOG = [
    _line(11, WORKER_STARTED),
    "loading the data",  # the first worker's warmup() print
    _line(11, "some warning"),
    _line(22, WORKER_STARTED),  # the slot's next worker (the first took a rank, or died)
    "Traceback (most recent call last):",
    "ValueError: boom",
    _line(33, WORKER_STARTED),
]


def test_a_slot_log_is_cut_at_each_workers_first_line():
    parts = dict(worker_parts(SLOT_LOG))
    assert parts[11] == SLOT_LOG[0:3]
    assert parts[22] == SLOT_LOG[3:6]  # unmarked lines belong to the worker before them
    assert parts[33] == SLOT_LOG[6:]


def test_a_log_without_start_lines_is_cut_where_the_pid_changes():
    old = [_line(11, "a"), "print", _line(22, "b"), _line(22, "c")]
    assert list(worker_parts(old)) == [(11, old[:2]), (22, old[2:])]
    assert list(worker_parts(["before any worker line"])) == [(None, ["before any worker line"])]


def test_rank_r_finds_the_slot_log_part_of_every_worker_that_took_it(tmp_path):
    (tmp_path / "worker-node0-slot0.log").write_text("\n".join(SLOT_LOG) + "\n")
    events = [Event(time=1, kind="assigned", source="node0", data={"rank": 1, "node": "node0", "pid": 22}),
              Event(time=2, kind="assigned", source="node0", data={"rank": 0, "node": "node0", "pid": 11})]
    assert assigned_workers(events, 1) == [("node0", 22)]
    f, lines = pre_assignment(tmp_path, "node0", 22)
    assert f.name == "worker-node0-slot0.log" and lines[-1] == "ValueError: boom"
    assert pre_assignment(tmp_path, "node1", 22) is None


def test_follow_prints_complete_lines_once_with_a_header_per_file(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("1\n2\n3\npart")
    out: list[str] = []
    f = Follower(lambda: [a, b], tail=2, out=out.append)
    f.poll()
    assert out == [f"==> {a} <==", "2\n3"]  # the last 2 complete lines; b does not exist yet
    with open(a, "a") as fh:
        fh.write("ial\n4\n")
    b.write_text("x\n")
    f.poll()
    assert out[2:] == ["partial\n4", f"==> {b} <==", "x"]
    f.poll()
    assert len(out) == 5
