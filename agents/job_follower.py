"""How a node agent learns its job's state: watches on its own keys, not the whole job.

The agent watches the keys :meth:`JobStore.agent_watches` names (spec, state, cancel,
checkpoint request, its node record, its chaos commands and the world's change). A change of
any of them but the world's means "read the job" (one round trip: :meth:`JobStore.agent_snapshot`).
A new world arrives *in* the event of its change record (:class:`WorldChange`, written in
the decision's txn), and is applied to the world the agent holds without reading anything
(:meth:`JobStore.follow_change`): a decision costs etcd one event per agent, not one read
of an N-seat world per agent (benchmarks/scale.py: 16 requests per decision at 1,000 nodes,
was 3,028). A change that does not apply (a missed epoch, a shrink) falls back to the read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hotspare.orchestrator.store import KV, JobSnapshot, JobStore


class JobFollower:
    """The agent's last view of its job (:attr:`snap`) and what its watches said since."""

    def __init__(self, js: JobStore, node: str, wake: Callable[[], None]) -> None:
        self.js, self.node, self._wake = js, node, wake
        self.snap: JobSnapshot | None = None
        self._lock = threading.Lock()  # the watch threads set, the agent's loop takes
        self._changed = True  # something but the world changed (or nothing was read yet)
        self._moved: KV | None = None  # the newest world change a watch delivered, not yet applied
        self._cancels: list[Callable[[], None]] = []
        self.read_at = 0.0  # time.monotonic() of the last read of the whole (not a change applied)

    def start(self) -> None:
        keys, prefixes = self.js.agent_watches(self.node)
        world_change = self.js.keys.world_change
        self._cancels = [self.js.store.watch_prefix(k, self.changed, self._world_moved if k == world_change else None)
                         for k in (*keys, *prefixes)]

    def stop(self) -> None:
        for cancel in self._cancels:
            cancel()
        self._cancels = []

    @property
    def pending(self) -> bool:
        """A watch fired since the last :meth:`read`."""
        return self._changed or self._moved is not None

    def changed(self) -> None:
        """Read the job on the next :meth:`read` (a watch fired, or a read failed). Any thread."""
        self._changed = True
        self._wake()

    def _world_moved(self, changes: list[tuple[KV, bool]]) -> None:
        with self._lock:
            for kv, deleted in changes:
                if deleted:
                    self._changed = True
                elif self._moved is None or kv.mod_revision > self._moved.mod_revision:
                    self._moved = kv
        self._wake()

    def read(self, full: bool = False) -> JobSnapshot:
        """The job now: the new world applied to the one held if that is all that changed,
        else (or with ``full``) read from etcd. Raises StoreError (then it reads next time)."""
        with self._lock:
            full = full or self._changed or self.snap is None
            moved, self._moved, self._changed = self._moved, None, False
        try:
            snap = None if full or moved is None else self.js.follow_change(self.snap, moved)
            if snap is None:
                now = time.monotonic()
                snap = self.js.agent_snapshot(self.node, self.snap)
                self.read_at = now
            self.snap = snap
        except BaseException:
            self._changed = True
            raise
        return self.snap
