"""How much of the snapshot directory (``/dev/shm``) a node's snapshots need, checked before a
rank's first slot of a layout is made: a job whose state does not fit fails at its start with
the numbers and the fix, instead of an ``ENOSPC`` (or, on a mapped tmpfs page, a ``SIGBUS``)
somewhere in the middle of the run.

What one node keeps, each copy the size of one rank's snapshot:

* every rank on the node: its snapshot slots (two ring slots, plus two point slots when
  replication is on; :class:`hotspare.recovery.snapshot.SnapshotEngine`);
* the replicas its agent keeps for the ranks of the nodes before it in the ring (``replicas``
  of them, each with ``ranks_per_node`` ranks): :data:`~hotspare.recovery.slotfile.REPLICAS_KEPT`
  per rank, plus the one being received before the oldest is dropped.

Every rank of a job is assumed to hold about as much state as this one (data parallelism).
Torch-free: the decision is plain arithmetic, tested without a filesystem.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ShmTooSmall
from .slotfile import REPLICAS_KEPT

FIX = "docker run --shm-size, the Kubernetes option shm_size"


def fmt_bytes(n: float) -> str:
    """``1.50 GiB``, ``64.0 MiB``, ``512 B``: sizes in messages."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ShmNeed:
    """What one node keeps in its snapshot directory, in copies of one rank's snapshot."""

    state_bytes: int  # one rank's snapshot: the data area of a slot
    copy_bytes: int  # one copy on disk: the state plus a slot's control block and header room
    ranks_per_node: int
    slots_per_rank: int
    replica_ranks: int  # ranks whose replicas this node's agent keeps

    @property
    def copies(self) -> int:
        return self.ranks_per_node * self.slots_per_rank + self.replica_ranks * (REPLICAS_KEPT + 1)

    @property
    def total(self) -> int:
        return self.copies * self.copy_bytes

    def why(self) -> str:
        """How the copies add up, for the message."""
        mine = f"{self.slots_per_rank} snapshot slots for each of its {self.ranks_per_node} rank(s)"
        if not self.replica_ranks:
            return mine
        return (f"{mine} + {REPLICAS_KEPT + 1} replicas ({REPLICAS_KEPT} kept, 1 arriving) for each of "
                f"{self.replica_ranks} rank(s) of the nodes before it in the ring")


def need_for(spec: Any, *, state_bytes: int, copy_bytes: int, slots_per_rank: int) -> ShmNeed:
    """This node's need under ``spec`` (a :class:`hotspare.orchestrator.spec.JobSpec`) for a
    snapshot of ``state_bytes`` (``copy_bytes`` each on disk)."""
    per_node = min(spec.ranks, spec.ranks_per_node)
    senders = min(spec.replicas, spec.nodes - 1) if spec.replicas > 0 else 0
    return ShmNeed(state_bytes, copy_bytes, per_node, slots_per_rank, senders * per_node)


def room(directory: Path, statvfs: Callable[[Any], os.statvfs_result] = os.statvfs) -> tuple[int, int]:
    """(bytes the directory's filesystem has free for us, bytes its files already take): the
    files are this job's (the agent's private run directory), so they count as room too."""
    st = statvfs(directory)
    used = 0
    with os.scandir(directory) as it:
        for e in it:
            try:
                if e.is_file(follow_symlinks=False):
                    used += e.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:  # a temporary file renamed or removed meanwhile
                continue
    return st.f_bavail * st.f_frsize, used


def verdict(need: ShmNeed, free: int, used: int, budget: int | None, where: str, who: str) -> str | None:
    """The one sentence that refuses ``need`` (``who``: whose state, e.g. ``rank 3``), or None
    if it fits both the configured ``budget`` (the spec's ``shm_budget``) and the filesystem."""
    head = (f"this node's snapshots need {fmt_bytes(need.total)} in {where}: {who}'s state is "
            f"{fmt_bytes(need.state_bytes)} and the node keeps {need.copies} copies of such a state "
            f"({need.why()})")
    lower = "lower replicas or ranks_per_node, or shrink the state"
    if budget is not None and need.total > budget:
        return (f"{head}, more than the spec's shm_budget of {fmt_bytes(budget)}; raise shm_budget to at least "
                f"{fmt_bytes(need.total)} (more if the state grows: an optimizer makes its state at its first "
                f"step) if the machine has that much shared memory, or {lower}")
    if need.total > free + used:
        size = math.ceil(need.total * 1.1 / (1 << 30))
        return (f"{head}, but its filesystem has only {fmt_bytes(free + used)} for them ({fmt_bytes(free)} free "
                f"+ {fmt_bytes(used)} this job holds there already); give /dev/shm more room ("
                f"docker run --shm-size={size}g, or the Kubernetes option shm_size), or {lower}")
    return None


def check_room(directory: Path, need: ShmNeed, budget: int | None, who: str,
               statvfs: Callable[[Any], os.statvfs_result] = os.statvfs) -> None:
    """Raise :class:`ShmTooSmall` with :func:`verdict`'s sentence if ``need`` does not fit."""
    free, used = room(directory, statvfs)
    why = verdict(need, free, used, budget, str(directory), who)
    if why is not None:
        raise ShmTooSmall(why)


def no_room(directory: Path, nbytes: int, what: str, err: OSError) -> ShmTooSmall | None:
    """The error to raise for ``err`` while making room for ``what`` (``nbytes``) in
    ``directory``: a :class:`ShmTooSmall` naming the sizes and the fix if ``err`` is ENOSPC,
    else None (the caller re-raises ``err``)."""
    if err.errno != errno.ENOSPC:
        return None
    try:
        free = fmt_bytes(os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize)
    except OSError:
        free = "unknown"
    return ShmTooSmall(
        f"no space left in {directory} for {what} of {fmt_bytes(nbytes)} ({free} free): the filesystem is "
        f"smaller than this job needs or something else filled it; give /dev/shm more room ({FIX}), lower "
        "replicas or ranks_per_node, or free it")
