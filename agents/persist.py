"""The agent's persister: flushes replication points of its local seats to the persistent tier.

Runs in the agent, not in the training process: the worker only ever writes its snapshot
into host memory (``/dev/shm``), so persisting costs training nothing but memory bandwidth
on another core. Persisted steps are replication points (``persist_every`` is a multiple
of ``replicate_every``), which every rank snapshots at the same step, so the per-rank files
of one step form a consistent checkpoint; ``hotspare checkpoint JOB`` asks for the next
point out of schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.store import EventKind
from hotspare.orchestrator.util import PeriodicWorker
from hotspare.recovery import persist
from hotspare.recovery.slotfile import COMPLETE, WRITING, SlotDir, slot_ctrl

from .node_view import NodeView

log = logging.getLogger("hotspare.persist")


class Persister(PeriodicWorker):
    """Writes the wanted points of this node's seats to the persistent tier, one thread.

    It reads the agent's state only through the published :class:`NodeView` (``view``):
    which seats are local (sid -> rank), the world size, and the step ``hotspare
    checkpoint`` asked for."""

    def __init__(
        self,
        run_dir: Path,
        spec: JobSpec,
        *,
        job: str,
        view: Callable[[], NodeView],
        event: Callable[..., None],
        interval: float = 1.0,
    ) -> None:
        # kicked by the agent's bell when a point starts or completes; the interval is a
        # safety net for a lost ring, and paces the retries of a failed write
        super().__init__("persister", interval)
        self.run_dir = run_dir
        self.slots = SlotDir(run_dir)
        self.every = spec.persist_every
        self.root = spec.persist_root
        self.local_dir = spec.persist_local_dir
        self.keep = spec.persist_keep
        self._points = spec.replication_enabled
        self.job = job
        self.run_id = spec.run_id
        self.view = view
        self.event = event
        self.done: dict[int, tuple[int, int]] = {}  # sid -> newest (timeline, step) persisted (or given up on)
        self._settled: dict[Path, int] = {}  # point slot -> seq of the write nothing is left to do for

    @property
    def enabled(self) -> bool:
        """Whether there is anything to persist: a point is what gets persisted, so none
        without replication. Not ``persist_every > 0``: with it 0, ``hotspare checkpoint``
        still asks for one."""
        return self._points

    def stop(self, join: float = 5.0) -> None:
        super().stop(join)  # longer than a replication round: a file may be mid-write

    def wanted(self, step: int, requested: int | None) -> bool:
        if step <= 0:
            return False
        return (self.every > 0 and step % self.every == 0) or (requested is not None and step == requested)

    def once(self) -> None:
        self.persist_once()

    def persist_once(self) -> None:
        view = self.view()
        for sid, rank in sorted(view.seats.items()):
            self._persist_newest(sid, rank, view)

    def _persist_newest(self, sid: int, rank: int, view: NodeView) -> None:
        """Persist the newest wanted point of ``sid`` not yet dealt with, if any."""
        # polled often (a late start delays the checkpoint): first only the 64-byte control
        # blocks; a slot's header is read only for a wanted step not yet dealt with
        paths = [p for p in self.slots.points(sid)
                 if (c := slot_ctrl(p)) and c[0] in (WRITING, COMPLETE)
                 and self.wanted(c[1], view.checkpoint) and self._settled.get(p) != c[2]]
        # a point still being copied counts: the writer streams it as the copy goes on
        views = [v for p in paths if (v := persist.open_slot(p, writing=True))]
        try:
            for slot in sorted(views, key=lambda v: -int(v.header["step"])):
                step = int(slot.header["step"])
                # a step computed again after a rollback is a new (timeline, step): persisted
                # again, never mixed with the files of its first computation
                key = (int(slot.header.get("timeline", 0)), step)
                if key <= self.done.get(sid, (-1, -1)):
                    self._settled[slot.path] = slot.seq  # nothing left to do for this write
                    continue
                if step in persist.complete_steps(self.root):
                    self.done[sid] = key  # complete already: never rewrite it
                else:
                    self._persist(slot, sid, rank, key, view.world_size)
                if key <= self.done.get(sid, (-1, -1)):
                    self._settled[slot.path] = slot.seq
                break  # the newest wanted point only
        finally:
            for v in views:
                v.close()

    def _persist(self, slot: persist.SlotView, sid: int, rank: int, key: tuple[int, int],
                 world_size: int) -> None:
        timeline, step = key
        # the rank and world size the state belongs to, as the worker wrote them with it
        # (the agent's current assignment may already be a newer epoch's)
        rank = int(slot.header.get("world_rank", rank))
        size = int(slot.header.get("world_size") or world_size)
        try:
            rec = persist.write_rank(slot, self.root, rank=rank, job=self.job, timeline=timeline,
                                     world_size=size, local_dir=self.local_dir, run_id=self.run_id)
        except InterruptedError as e:
            log.info("%s; next point", e)
            return
        except Exception as e:  # noqa: BLE001 - OSError (disk full, ...) or an object store's own
            self.done[sid] = key  # do not retry the same step in a loop
            try:
                prev = persist.complete_steps(self.root)
            except Exception:  # noqa: BLE001
                prev = []
            what = ("disk full" if persist.is_disk_full(e) else "write failed") if isinstance(e, OSError) \
                else type(e).__name__
            msg = (f"persisting step {step} of rank {rank} to {self.root} failed ({what}: "
                   f"{getattr(e, 'strerror', None) or e}); "
                   + (f"the previous checkpoint (step {prev[-1]}) is intact" if prev else "no earlier checkpoint exists"))
            log.error(msg)
            self.event(EventKind.PERSIST_FAILED, msg, rank=rank, step=step, error=str(e))
            return
        self.done[sid] = key
        log.info("persisted rank %d step %d: %d bytes in %.3fs", rank, step, rec["bytes"], rec["write_s"])
        if persist.try_finish(self.root, step, size, self.job, self.run_id):
            removed = persist.prune(self.root, self.keep)
            self.event(EventKind.PERSISTED, f"checkpoint of step {step} complete in {self.root}", step=step,
                       path=str(persist.checkpoint_path(self.root, step)), removed=removed)
