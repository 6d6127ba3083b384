"""The agent's background services for one job, built and owned in one place.

:class:`NodeServices` creates the run directory (the workers' snapshot slots, in shared
memory), the replica server, the replicator and the persister, starts the ones the spec
asks for and stops them again. The services never read the agent's fields: the agent's
main loop publishes a :class:`~hotspare.agents.node_view.NodeView` and they read the current one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.store import Node, World
from hotspare.orchestrator.util import pid_alive

from .node_view import Buddy, NodeView
from .persist import Persister
from .replica import ReplicaServer, ReplicaStore, Replicator


def shm_base() -> Path:
    """Where run directories go: shared memory if the machine has it."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def sweep_stale_run_dirs(base: Path) -> None:
    """Remove snapshot directories of agents that died without cleaning up (SIGKILL, node
    loss): their shared memory would otherwise stay allocated until reboot."""
    for d in base.glob("hotspare-*"):
        pid = d.name.rsplit("-", 2)[-2] if d.name.count("-") >= 3 else ""
        if d.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def ring_buddies(world: World, nodes: Mapping[str, Node], me: str, k: int) -> list[Buddy]:
    """The ``k`` nodes after ``me`` in ring order (nodes of the world, in seat order) that
    hold this node's replicas; never this node itself."""
    ring: list[str] = []
    for seat in world.seats:
        if seat.node not in ring:
            ring.append(seat.node)
    if me not in ring or k <= 0:
        return []
    i = ring.index(me)
    out = []
    for j in range(1, len(ring)):
        name = ring[(i + j) % len(ring)]
        n = nodes.get(name)
        if n is not None and n.replica_port:
            out.append((name, n.host, n.replica_port))
        if len(out) == k:
            break
    return out


class NodeServices:
    """Run directory, replica server, replicator and persister of one agent.

    The replicator runs only with replication on (``replicas > 0``); the persister only
    when it has something to persist (:attr:`Persister.enabled`). The server always runs: a
    seat restored on any node may fetch a crashed worker's ring slots from it, replication
    or not."""

    def __init__(self, spec: JobSpec, *, job: str, node: str, secret: bytes, host: str,
                 event: Callable[..., None]) -> None:
        base = shm_base()
        sweep_stale_run_dirs(base)
        # per run and per agent process: a new run of the job name never reads an old one's slots
        run = f"{spec.run_id}-" if spec.run_id else ""
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"hotspare-{job}-{node}-{run}{os.getpid()}-", dir=base))
        self._view = NodeView(world_size=spec.ranks)
        self._replicate = spec.replication_enabled
        replicas = ReplicaStore(self.run_dir)
        self.server = ReplicaServer(replicas, secret, host=host)
        self.replicator = Replicator(replicas, secret, view=self.view)
        self.persister = Persister(self.run_dir, spec, job=job, view=self.view, event=event)

    @property
    def port(self) -> int:
        return self.server.port

    def view(self) -> NodeView:
        """The view the agent published last (what the services act on)."""
        return self._view

    def publish(self, view: NodeView) -> None:
        """Called by the agent's main loop only: one attribute swap, atomic under the GIL."""
        self._view = view

    def start(self) -> NodeServices:
        self.server.start()
        if self._replicate:
            self.replicator.start()
        if self.persister.enabled:
            self.persister.start()
        return self

    def pause(self, paused: bool) -> None:
        """Chaos partition: no replica traffic in or out while ``paused``."""
        self.server.paused = paused
        self.replicator.paused = paused

    def stop(self) -> None:
        self.replicator.stop()
        self.persister.stop()
        self.server.stop()

    def remove_run_dir(self) -> None:
        """Free the shared memory of every slot and replica (after :meth:`stop`)."""
        try:
            for p in self.run_dir.iterdir():
                p.unlink()
            self.run_dir.rmdir()
        except OSError:
            pass
