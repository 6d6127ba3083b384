"""The agent's background services for one job, built and owned in one place.

:class:`NodeServices` creates the run directory (the workers' snapshot slots, in shared
memory), the replica server, the replicator and the persister, starts the ones the spec
asks for and stops them again. The services never read the agent's fields: the agent's
main loop publishes a :class:`~hotspare.agents.node_view.NodeView` and they read the current one.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.store import Node, World
from hotspare.orchestrator.util import atomic_write, pid_alive
from hotspare.recovery.bell import AGENT_BELL, Bell, Ringer
from hotspare.recovery.slotfile import SlotDir

from .node_view import Buddy, NodeView
from .persist import Persister
from .replica import ReplicaServer, ReplicaStore, Replicator

log = logging.getLogger("hotspare.agent")


def shm_base() -> Path:
    """Where run directories go: shared memory if the machine has it."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


#: The lock file in every run directory: its agent holds an exclusive ``flock`` on it for as
#: long as it lives, so a sweeper in any PID namespace sharing this ``/dev/shm`` can tell.
OWNER = ".owner"
#: A run directory without an owner file is swept only once it is older than this (an agent
#: creates the file right after the directory: microseconds; older agents never did).
UNCLAIMED_GRACE_S = 60.0


#: The name a run directory has until its owner lock is held (the sweep looks at ``hotspare-*``).
CLAIMING = ".claiming-"


def make_run_dir(base: Path, prefix: str) -> tuple[Path, int]:
    """A new directory ``base/<prefix>XXXXXXXX`` and the descriptor holding its owner lock.
    It is made under a name the sweep does not look at, claimed, then renamed into place: a
    sweep running beside it (another agent starting) sees it only once it is locked. Claimed
    in place, the owner file existed unlocked for a moment, and a sweep that locked it then
    removed the new agent's directory under it ("No such file or directory" at start-up)."""
    tmp = Path(tempfile.mkdtemp(prefix=CLAIMING + prefix, dir=base))
    fd = claim_run_dir(tmp)
    final = base / tmp.name.removeprefix(CLAIMING)
    os.rename(tmp, final)  # atomic; the lock is on the owner file, which moves with it
    return final, fd


def claim_run_dir(run_dir: Path) -> int:
    """Create ``run_dir``'s owner file and lock it; the returned descriptor holds the lock
    until it is closed or the process dies (the kernel drops it then, whatever killed us)."""
    fd = os.open(run_dir / OWNER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _owner_gone(d: Path) -> bool:
    """True when nobody holds ``d``'s owner lock, or (no owner file) the directory is old and
    the PID in its name is not alive here. A PID is only meaningful in this PID namespace:
    agents in containers that share ``/dev/shm`` (``--ipc=host``) see each other's directories
    with PIDs that mean nothing here, and the lock is what tells them apart."""
    try:
        fd = os.open(d / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        pid = d.name.rsplit("-", 2)[-2] if d.name.count("-") >= 3 else ""
        return _older_than(d, UNCLAIMED_GRACE_S) and pid.isdigit() and not pid_alive(int(pid))
    except OSError:
        return False  # a symlink, or not ours to read: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its agent is alive, in this namespace or another
    finally:
        os.close(fd)
    return True


def sweep_stale_run_dirs(base: Path) -> None:
    """Remove snapshot directories of agents that died without cleaning up (SIGKILL, node
    loss): their shared memory would otherwise stay allocated until reboot. A directory is
    stale when nobody holds its owner lock (see :func:`_owner_gone`); symlinks are never
    followed. A directory still being claimed (:func:`make_run_dir`) is swept only if it was
    left so for ``UNCLAIMED_GRACE_S`` (its agent died in those microseconds)."""
    for d in [*base.glob("hotspare-*"), *base.glob(CLAIMING + "hotspare-*")]:
        if d.is_dir() and not d.is_symlink() and _owner_gone(d) and (
                not d.name.startswith(CLAIMING) or _older_than(d, UNCLAIMED_GRACE_S)):
            shutil.rmtree(d, ignore_errors=True)


def _older_than(d: Path, seconds: float) -> bool:
    """Whether ``d`` was last modified more than ``seconds`` ago (False if it cannot be told)."""
    try:
        return time.time() - d.lstat().st_mtime > seconds
    except OSError:
        return False


def ring_successors(world: World, me: str) -> list[str]:
    """The other nodes of ``world`` in ring order, starting after ``me`` (:meth:`World.successors`)."""
    return world.successors(me)


def buddies_key(world: World, me: str, k: int) -> tuple:
    """What :func:`ring_buddies` of ``me`` depends on in ``world``: the first ``2k + 2``
    successors and the incarnations seated there (a node that re-registered has a new record)."""
    if k <= 0:
        return ()
    return tuple((n, world.incarnation_of(n)) for n in world.successors(me, 2 * k + 2))


def ring_buddies(world: World, nodes: Mapping[str, Node], me: str, k: int) -> list[Buddy]:
    """The ``k`` nodes after ``me`` in ring order (nodes of the world, in seat order) that
    hold this node's replicas; never this node itself. ``nodes`` needs only the records of
    the successors: a dead one (no record, or no replica port) is skipped."""
    out = []
    for name in ring_successors(world, me) if k > 0 else []:
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
        self.run_dir, self._owner = make_run_dir(base, f"hotspare-{job}-{node}-{run}{os.getpid()}-")
        self._view = NodeView(world_size=spec.ranks)
        self._replicate = spec.replication_enabled
        replicas = ReplicaStore(self.run_dir)
        self.server = ReplicaServer(replicas, secret, host=host)
        self.replicator = Replicator(replicas, secret, view=self.view)
        self.persister = Persister(self.run_dir, spec, job=job, view=self.view, event=event)
        # workers ring it when a snapshot point starts or completes and when they turn warm
        self.bell = Bell(self.run_dir / AGENT_BELL)
        self.on_ring: Callable[[], object] = lambda: None  # the agent's wake-up
        self._bell_thread = threading.Thread(target=self._answer_bell, name="agent-bell", daemon=True)
        self._closing = False

    def _answer_bell(self) -> None:
        """Each ring kicks the services and wakes the agent's loop; nothing polls meanwhile."""
        while not self._closing:
            if self.bell.wait(None) and not self._closing:
                self.replicator.kick()
                self.persister.kick()
                self.on_ring()

    @property
    def port(self) -> int:
        return self.server.port

    def view(self) -> NodeView:
        """The view the agent published last (what the services act on)."""
        return self._view

    def publish(self, view: NodeView) -> None:
        """Called by the agent's main loop only: one attribute swap, atomic under the GIL.
        A changed view (new seats, buddies, a requested checkpoint) kicks the services."""
        changed = view != self._view
        if view.checkpoint != self._view.checkpoint and view.checkpoint is not None:
            try:  # for the ranks' vote on which candidate steps become points (recovery.session)
                atomic_write(SlotDir(self.run_dir).checkpoint_request, str(view.checkpoint), fsync=False)
            except OSError as e:
                log.warning("could not pass the checkpoint request on to the workers: %s", e)
        self._view = view
        if changed:
            self.replicator.kick()
            self.persister.kick()

    def start(self) -> NodeServices:
        self._bell_thread.start()
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
        self._closing = True
        Ringer(self.bell.path).ring()  # unblocks the bell's thread
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
        finally:
            self.bell.close()
            if self._owner >= 0:
                os.close(self._owner)
                self._owner = -1
