"""The agent's worker processes: their life cycle, how one is started, and what its exit means.

A worker goes WARM (started; importing, then waiting on stdin) -> ASSIGNED (holds a seat)
-> HANG_KILLED (its watchdog killed it; the exit is reported as a hang) or out of the
agent's table once it exits. :func:`classify_exit` turns an exit into the report's kind and
sentence without touching anything, so every branch has a unit test.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .worker_link import (
    EXIT_UNRECOVERABLE,
    Assignment,
    Heartbeat,
    WorkerEnv,
    fatal_path,
    worker_command,
)


class WorkerState(str, Enum):
    WARM = "warm"  # started, no seat yet (possibly still importing: see its heartbeat)
    ASSIGNED = "assigned"  # holds a seat; watched by the heartbeat watchdog
    HANG_KILLED = "hang-killed"  # holds its seat until its exit is reported as a hang

    def __str__(self) -> str:
        return self.value


@dataclass
class WorkerProc:
    """One worker process of the agent and the seat it holds (if any)."""

    slot: int
    proc: subprocess.Popen
    hb: Heartbeat
    state: WorkerState = WorkerState.WARM
    rank: int = -1  # meaningful once ASSIGNED; a shrink may change it
    sid: int = -1  # the seat's state id: stays when a shrink renumbers the rank
    epoch: int = 0
    assigned_at: float = 0.0
    # watchdog bookkeeping: the last heartbeat record seen and when it last changed
    last_hb: tuple = ()
    last_change: float = 0.0

    @property
    def holds_seat(self) -> bool:
        return self.state is not WorkerState.WARM

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def assign(self, rank: int, sid: int, epoch: int) -> None:
        self.state = WorkerState.ASSIGNED
        self.rank, self.sid, self.epoch, self.assigned_at = rank, sid, epoch, time.time()

    def send(self, assignment: Assignment) -> bool:
        """Write the assignment line to the worker's stdin; False if it has just died."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(assignment.to_line())
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def fatal_text(self) -> str | None:
        """The reason the worker left for an unrecoverable exit, if it could write one."""
        try:
            return fatal_path(self.hb.path).read_text().strip()
        except OSError:
            return None

    def kill(self, wait: bool = True) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        if wait:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def classify_exit(returncode: int, hang_killed: bool, fatal_text: str | None, pid: int) -> tuple[str, str]:
    """(kind, message) of an assigned worker's non-zero exit, as the agent reports it.

    ``kind`` is what the controller acts on: ``fatal`` (its state is gone everywhere: the
    job fails with the worker's reason, ``fatal_text``), ``hang`` (the watchdog killed it)
    or ``exit`` (it crashed or was killed: a spare takes the seat)."""
    if returncode == EXIT_UNRECOVERABLE:
        why = "its state cannot be restored (see its rank log)" if fatal_text is None else fatal_text
        return "fatal", f"worker pid {pid} cannot go on: {why}"
    if hang_killed:
        return "hang", f"worker pid {pid} hung (no heartbeat) and was killed"
    if returncode < 0:
        return "exit", f"worker pid {pid} killed by signal {-returncode}"
    return "exit", f"worker pid {pid} exited with code {returncode}"


def heartbeat_path(run_dir: Path, slot: int) -> Path:
    """A fresh heartbeat file for a worker in ``slot`` (a respawned slot gets a new one)."""
    return run_dir / f"slot{slot}-{time.time_ns()}.hb"


def spawn_worker(slot: int, link: WorkerEnv, env: Mapping[str, str]) -> WorkerProc:
    """Start a warm worker (:func:`~hotspare.agents.worker_link.worker_command`) with its heartbeat file and log.

    ``env`` is the environment around the contract (the agent's own, the job's ``env``);
    ``link`` is the contract itself, and wins over ``env``."""
    hb = Heartbeat(link.hb)
    full = {**env, **link.to_env(), "PYTHONUNBUFFERED": "1"}
    logf = open(Path(link.log_dir) / f"worker-{link.node}-slot{slot}.log", "ab")
    try:
        proc = subprocess.Popen(
            worker_command(),
            stdin=subprocess.PIPE,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=full,
        )
    finally:
        logf.close()
    return WorkerProc(slot=slot, proc=proc, hb=hb)
