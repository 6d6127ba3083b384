"""Scheduled chaos, fired by the training process itself at the start of a step, or inside a
recovery.

The spec's ``chaos:`` entries name a step. Entries targeting a rank fire in that rank;
entries naming a node (or no target: kill-controller, restart-etcd) fire in rank 0. What
this process can do itself -- kill, stop or slow itself, damage its checkpoint file, kill its
own agent -- it does at once, precisely at the step; the rest goes through etcd to whoever
executes it (:mod:`hotspare.orchestrator.chaos` says who), as ``hotspare chaos`` would.

An entry with ``during: <phase>`` fires instead the first time a process reaches that phase
of a recovery (:data:`hotspare.orchestrator.chaos.PHASES`) at step ``at_step`` or later
(:meth:`ChaosHook.at_phase`): in the process that holds ``rank`` in the epoch being joined,
or, without a rank, in whichever process gets there first. A kill-node of another node
holds the phase until that node's lease has expired, so the phase goes on without it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from hotspare.orchestrator import chaos
from hotspare.orchestrator.chaos import Executor, Target
from hotspare.orchestrator.spec import ChaosEntry
from hotspare.orchestrator.store import CONTROLLER, EventKind, JobStore, StoreError, events

from .persist import complete_steps, rank_file, step_dir

log = logging.getLogger(__name__)


class ChaosHook:
    """The spec's scheduled failures for one training process.

    ``event`` queues an event under this rank (the session's control link); ``slow`` is the
    delay slow-rank set, which the step loop sleeps after every step."""

    def __init__(self, js: JobStore, entries: Sequence[ChaosEntry], *, job: str, node: str,
                 agent_pid: int, persist_root: str, event: Callable[..., None],
                 beat: Callable[[], None] = lambda: None, lease_ttl: float = 5.0) -> None:
        self.js = js
        self.entries = tuple(entries)
        self.job = job
        self.node = node
        self.agent_pid = agent_pid
        self.persist_root = persist_root
        self.event = event
        self.beat = beat
        self.lease_ttl = lease_ttl
        self.slow = 0.0  # seconds to sleep after every step (chaos slow-rank; 0: none)
        #: the entries that fire inside a recovery, by phase, until they have fired
        self._pending: dict[str, list[int]] = {}
        for i, c in enumerate(self.entries):
            if c.during:
                self._pending.setdefault(c.during, []).append(i)
        #: what the training process does to itself, by action name (Target.RANK)
        self._on_self: dict[str, Callable[[ChaosEntry, int], None]] = {
            "kill-rank": lambda c, rank: os.kill(os.getpid(), signal.SIGKILL),
            "hang-rank": lambda c, rank: os.kill(os.getpid(), signal.SIGSTOP),
            "slow-rank": self._slow_down,
            "corrupt-checkpoint": lambda c, rank: self._corrupt_checkpoint(rank),
        }

    def at_step(self, step: int, rank: int) -> None:
        """Fire this rank's entries for ``step``, each exactly once in the job's life (a step
        recomputed after a rollback does not fire its failure again)."""
        for i, c in enumerate(self.entries):
            if c.during or c.at_step != step:
                continue
            mine = c.rank == rank if c.rank is not None else rank == 0
            if mine:
                self._claim_and_fire(i, c, rank, step)

    def at_phase(self, phase: str, rank: int, step: int) -> None:
        """Fire the entries scheduled ``during`` this recovery phase (``step``: the step this
        process resumes at, or was computing, when it got there). Free when none is pending."""
        pending = self._pending.get(phase)
        if not pending:
            return
        for i in list(pending):
            c = self.entries[i]
            if step < c.at_step or (c.rank is not None and c.rank != rank):
                continue
            pending.remove(i)  # claimed by this process or an earlier one: never asked again
            self._claim_and_fire(i, c, rank, step)

    def _claim_and_fire(self, i: int, c: ChaosEntry, rank: int, step: int) -> None:
        """Fire entry ``i`` if no process has yet (etcd's fire-once key), with its event."""
        try:
            if not self.js.fire_once(i):
                return  # already fired in an earlier life of this step, or by another process
            target = c.node or self.node
            self.js.put_event(events.chaos(
                f"rank{rank}",
                f"scheduled {c.action} at step {step}"
                + (f" during {c.during}" if c.during else "")
                + (f" of rank {c.rank}" if c.rank is not None else "")
                + (f" on {c.node}" if c.node else ""),
                c.action, rank=c.rank, node=target, step=step, seconds=c.seconds,
                **({"during": c.during} if c.during else {}),
            ))
            self._fire(c, target, rank)
            if c.during and c.action == "kill-node" and target != self.node:
                self._until_gone(target)
        except StoreError as e:
            log.warning("chaos entry %d not fired: %s", i, e)

    def _until_gone(self, node: str) -> None:
        """Hold the phase (beating) until ``node``'s lease has expired, so the phase goes on
        without it; at most a few lease TTLs (its agent may have been gone already)."""
        deadline = time.monotonic() + 3 * self.lease_ttl + 10
        while time.monotonic() < deadline:
            try:
                if not self.js.node_registered(node):
                    return
            except StoreError:
                pass
            self.beat()
            time.sleep(0.1)
        log.warning("chaos: %s still registered after %.0fs; going on", node, 3 * self.lease_ttl + 10)

    def _fire(self, c: ChaosEntry, node: str, rank: int) -> None:
        log.warning("chaos: %s at step (rank %d)", c.action, rank)
        action = chaos.ACTIONS.get(c.action)
        if action is None:  # a newer spec's action: nothing here knows how to do it
            log.warning("chaos: unknown action %s not fired", c.action)
        elif action.target is Target.RANK:
            fire = self._on_self.get(action.name)
            if fire is None:
                log.warning("chaos: %s is not something a training process can do to itself", action.name)
            else:
                fire(c, rank)
        elif action.name == "kill-node" and node == self.node and self.agent_pid:
            self._kill_own_node()
        elif action.target is Target.NODE:
            self.js.send_chaos(node, {"action": action.name, "seconds": c.seconds, "evented": True})
        elif action.executor is Executor.CONTROLLER:
            self.js.send_chaos(CONTROLLER, {"action": action.name, "evented": True})
        elif action.executor is Executor.CLI:
            # the CLI owns the embedded etcd: a detached `hotspare chaos` does it
            subprocess.Popen(
                [sys.executable, "-m", "hotspare.orchestrator.cli", "chaos", self.job, "--action", action.name,
                 "--seconds", str(chaos.seconds_or_default(action.name, c.seconds))],
                start_new_session=True, stdin=subprocess.DEVNULL,
            )

    def _slow_down(self, c: ChaosEntry, rank: int) -> None:
        seconds = chaos.seconds_or_default(c.action, c.seconds)
        self.slow = max(0.0, seconds or 0.0)  # 0 clears it

    def _kill_own_node(self) -> None:
        """Our own node's loss, exactly at the step: the agent dies; this worker and its
        siblings follow through PDEATHSIG (and this one at the latest 5 s later)."""
        os.kill(self.agent_pid, signal.SIGKILL)
        time.sleep(5)
        os.kill(os.getpid(), signal.SIGKILL)

    def _corrupt_checkpoint(self, rank: int) -> None:
        """Flip bytes in the middle of this rank's file of the newest complete checkpoint (a
        bad disk, a torn copy): recovery must refuse it and fall back to an older one."""
        root = self.persist_root
        steps = complete_steps(root) if "://" not in root else []
        if not steps:
            self.event(EventKind.CORRUPTED, f"corrupt-checkpoint: no complete checkpoint in {root} yet", rank=rank)
            return
        f = step_dir(root, steps[-1]) / rank_file(rank)
        with open(f, "r+b") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(size // 2)
            b = fh.read(16)
            fh.seek(size // 2)
            fh.write(bytes(x ^ 0xFF for x in b))
        self.event(EventKind.CORRUPTED, f"corrupted {f}", rank=rank, step=steps[-1], path=str(f))
