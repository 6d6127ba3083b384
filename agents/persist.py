"""The agent's persister: flushes replication points of its local ranks to the persistent tier.

Runs in the agent, not in the training process: the worker only ever writes its snapshot
into host memory (``/dev/shm``), so persisting costs training nothing but memory bandwidth
on another core. Persisted steps are replication points (``persist_every`` is a multiple
of ``replicate_every``), which every rank snapshots at the same step, so the per-rank files
of one step form a consistent checkpoint; ``hotspare checkpoint JOB`` asks for the next
point out of schedule.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from recovery import persist
from recovery.slotfile import COMPLETE, WRITING, slot_ctrl

log = logging.getLogger("hotspare.persist")


class Persister:
    def __init__(
        self,
        run_dir: Path,
        spec: dict,
        *,
        job: str,
        local_ranks: Callable[[], dict[int, int]],  # sid (names the slot files) -> current rank
        world: Callable[[], tuple[int, int]],  # (epoch, world size)
        requested: Callable[[], int | None],
        event: Callable[..., None],
        interval: float = 0.02,
    ) -> None:
        self.run_dir = run_dir
        self.every = spec.persist_every
        self.root = spec.persist_root
        self.local_dir = spec.persist_local_dir
        self.keep = spec.persist_keep
        self.job = job
        self.local_ranks = local_ranks
        self.world = world
        self.requested = requested
        self.event = event
        self.interval = interval
        self.done: dict[int, int] = {}  # sid -> newest step persisted (or given up on)
        self.failed: dict[int, str] = {}
        self._settled: dict[Path, int] = {}  # point slot -> seq of the write nothing is left to do for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="persister", daemon=True)

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def start(self) -> Persister:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def wanted(self, step: int) -> bool:
        if step <= 0:
            return False
        req = self.requested()
        return (self.every > 0 and step % self.every == 0) or (req is not None and step == req)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.persist_once()
            except Exception:  # noqa: BLE001 - persisting is best effort, never fatal
                log.exception("persist round failed")

    def persist_once(self) -> None:
        for sid, rank in sorted(self.local_ranks().items()):
            # polled often (a late start delays the checkpoint): first only the 64-byte control
            # blocks; a slot's header is read only for a wanted step not yet dealt with
            paths = [p for k in range(2)
                     if (c := slot_ctrl(p := self.run_dir / f"rank{sid}.point{k}"))
                     and c[0] in (WRITING, COMPLETE) and self.wanted(c[1]) and self._settled.get(p) != c[2]]
            # a point still being copied counts: the writer streams it as the copy goes on
            views = [v for p in paths if (v := persist.open_slot(p, writing=True))]
            try:
                for view in sorted(views, key=lambda v: -int(v.header["step"])):
                    step = int(view.header["step"])
                    # a step computed again after a rollback is a new (timeline, step): persisted
                    # again, never mixed with the files of its first computation
                    key = (int(view.header.get("timeline", 0)), step)
                    if key <= self.done.get(sid, (-1, -1)):
                        self._settled[view.path] = view.seq  # nothing left to do for this write
                        continue
                    if step in persist.complete_steps(self.root):
                        self.done[sid] = key  # complete already: never rewrite it
                    else:
                        self._persist(view, sid, rank, key)
                    if key <= self.done.get(sid, (-1, -1)):
                        self._settled[view.path] = view.seq
                    break  # the newest wanted point only
            finally:
                for v in views:
                    v.close()

    def _persist(self, view: persist.SlotView, sid: int, rank: int, key: tuple[int, int]) -> None:
        timeline, step = key
        # the rank and world size the state belongs to, as the worker wrote them with it
        # (the agent's current assignment may already be a newer epoch's)
        rank = int(view.header.get("world_rank", rank))
        size = int(view.header.get("world_size") or self.world()[1])
        try:
            rec = persist.write_rank(view, self.root, rank=rank, job=self.job, timeline=timeline,
                                     world_size=size, local_dir=self.local_dir)
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
            self.event("persist-failed", msg, rank=rank, step=step, error=str(e))
            return
        self.done[sid] = key
        log.info("persisted rank %d step %d: %d bytes in %.3fs", rank, step, rec["bytes"], rec["write_s"])
        if persist.try_finish(self.root, step, size, self.job):
            removed = persist.prune(self.root, self.keep)
            self.event("persisted", f"checkpoint of step {step} complete in {self.root}", step=step,
                       path=str(persist.checkpoint_path(self.root, step)), removed=removed)
