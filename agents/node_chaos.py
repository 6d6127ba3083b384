"""The chaos actions a node agent carries out (``executor: agent`` in :mod:`hotspare.orchestrator.chaos`).

Which actions exist, what they target and their default durations are the table's; this
module holds only their side effects on this node: killing or stopping a worker, slowing
its steps, killing the whole node, or cutting it off (a partition) and healing it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Collection

from hotspare.orchestrator import chaos
from hotspare.orchestrator.store import EventKind, JobStore, Lease

from .node_services import NodeServices
from .node_workers import WorkerProc

log = logging.getLogger("hotspare.agent")

#: (the target worker of a rank action, seconds, every worker, the node's lease)
_Handler = Callable[["WorkerProc | None", "float | None", "Collection[WorkerProc]", "Lease | None"], None]


class NodeChaos:
    """Executes chaos commands addressed to one node, and keeps the partition's state."""

    #: action -> the method that carries it out; every ``executor: agent`` action has one
    #: (a unit test holds the two together)
    HANDLERS: dict[str, str] = {
        "kill-node": "_kill_node",
        "kill-rank": "_kill_rank",
        "hang-rank": "_hang_rank",
        "slow-rank": "_slow_rank",
        "partition-node": "_partition_node",
    }

    def __init__(self, js: JobStore, node: str, services: NodeServices, lease_ttl: float) -> None:
        self.js = js
        self.node = node
        self.services = services
        self.lease_ttl = lease_ttl
        self.partitioned_until = 0.0  # monotonic time a partition heals at; 0: none
        self._frozen: list[WorkerProc] = []

    def execute(self, cmd: dict, workers: Collection[WorkerProc], lease: Lease | None) -> None:
        """Carry out one command from ``/hotspare/<job>/chaos/<node>/``."""
        action, rank, seconds = cmd.get("action"), cmd.get("rank"), cmd.get("seconds")
        spec = chaos.ACTIONS.get(action) if isinstance(action, str) else None
        target = next((w for w in workers if w.holds_seat and w.rank == rank), None)
        on_rank = spec is not None and spec.executor is chaos.Executor.AGENT and spec.target is chaos.Target.RANK
        if on_rank and target is None:
            log.warning("chaos %s: rank %s is not on %s; ignored", action, rank, self.node)
            return
        if not cmd.get("evented"):  # scheduled entries were already written by the worker
            self.js.event(
                EventKind.CHAOS,
                self.node,
                f"{action} on {self.node}" + (f" rank {rank}" if rank is not None else ""),
                action=action,
                rank=rank,
                node=self.node,
                seconds=seconds,
            )
        log.warning("chaos: %s %s", action, cmd)
        name = self.HANDLERS.get(action) if isinstance(action, str) else None
        if name is None:
            log.warning("chaos action %s is not executed by agents", action)
            return
        handler: _Handler = getattr(self, name)
        handler(target, seconds, workers, lease)

    # -- the actions --------------------------------------------------------------------------
    def _kill_node(self, target: WorkerProc | None, seconds: float | None,
                   workers: Collection[WorkerProc], lease: Lease | None) -> None:
        # the node dies at once: no report, no goodbye; workers are killed first (as they would
        # die with us anyway: zygote.die_with_agent)
        for w in workers:
            w.proc.kill()
        os.kill(os.getpid(), signal.SIGKILL)

    def _kill_rank(self, target: WorkerProc | None, seconds: float | None,
                   workers: Collection[WorkerProc], lease: Lease | None) -> None:
        assert target is not None
        target.proc.send_signal(signal.SIGKILL)

    def _hang_rank(self, target: WorkerProc | None, seconds: float | None,
                   workers: Collection[WorkerProc], lease: Lease | None) -> None:
        assert target is not None
        target.proc.send_signal(signal.SIGSTOP)  # until the watchdog kills it

    def _slow_rank(self, target: WorkerProc | None, seconds: float | None,
                   workers: Collection[WorkerProc], lease: Lease | None) -> None:
        assert target is not None
        target.hb.set_delay(float(chaos.seconds_or_default("slow-rank", seconds) or 0.0))

    def _partition_node(self, target: WorkerProc | None, seconds: float | None,
                        workers: Collection[WorkerProc], lease: Lease | None) -> None:
        length = chaos.seconds_or_default("partition-node", seconds)
        self.partition(2 * self.lease_ttl if length is None else length, workers, lease)

    # -- partitions ---------------------------------------------------------------------------
    @property
    def partitioned(self) -> bool:
        return bool(self.partitioned_until)

    def partition(self, seconds: float, workers: Collection[WorkerProc], lease: Lease | None) -> None:
        """Cut this node off for ``seconds``: no keepalives, no replica traffic, workers
        frozen. If that outlasts the lease the controller replaces our ranks; when the
        partition heals the workers find themselves fenced (their seats belong to other
        nodes now) and we re-register as a new incarnation."""
        assert lease is not None
        lease.pause()
        self.services.pause(True)
        frozen = [w for w in workers if w.alive]
        for w in frozen:
            w.proc.send_signal(signal.SIGSTOP)
        self.partitioned_until = time.monotonic() + seconds
        self._frozen = frozen

    def heal_if_due(self, lease: Lease | None) -> bool:
        """Heal the partition once its time is up; False while it lasts."""
        if time.monotonic() < self.partitioned_until:
            return False
        self.partitioned_until = 0.0
        for w in self._frozen:
            try:
                w.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        for w in self._frozen:
            w.assigned_at = time.monotonic()  # the watchdog counts from the heal, not the freeze
        self._frozen = []
        self.services.pause(False)
        assert lease is not None
        lease.resume()
        log.warning("partition healed")
        return True
