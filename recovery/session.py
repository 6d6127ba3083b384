"""The training process's view of hotspare: ``train(session, **args)``.

``for step in session.steps(total)`` drives everything the user should not have to:
joining the epoch's process group, agreeing on the step to resume from, rolling a step
back when a collective in it failed, rebuilding the group under the new epoch, and the
final barrier. Nothing here touches etcd on the step path: epoch changes arrive through
:class:`ControlLink` (a background thread) as a plain attribute.

Where the state comes from after a failure is :mod:`hotspare.recovery.restore`; the spec's scheduled
failures are :mod:`hotspare.recovery.chaos_hook`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hotspare.agents.worker_link import EXIT_FENCED, default_etcd_outage_limit
from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.store import EventKind, JobStore, Store, StoreError, StoreFull, events
from hotspare.orchestrator.store.c10d import EtcdC10dStore, RendezvousAborted

from .chaos_hook import ChaosHook
from .control import ControlLink
from .data import ElasticDataLoader, session_loader, watch_untracked_loaders
from .final import write_manifest, write_rank
from .frameworks import after_join, check_world, sharded
from .process_group import GroupBroken, ReconfigurableProcessGroup, register
from .restore import (
    WINDOW,
    LocalSlots,
    Membership,
    PeerReplicas,
    PersistentTier,
    RestoreAgreement,
    Restored,
    StateSource,
    StepFailed,
    Unrecoverable,
)
from .shm_budget import check_room, need_for
from .snapshot import SnapshotEngine
from .state import ModuleState, RNGState, materialized, provider_for

__all__ = ["Session", "Fenced", "Unrecoverable", "COLLECTIVE_TIMEOUT", "WINDOW"]

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = 60.0  # seconds a collective or rendezvous may take before it counts as failed
_StepFailed = StepFailed  # the name this module used before hotspare.recovery.restore existed


class Fenced(SystemExit):
    """This worker no longer owns its rank (the world moved on without it)."""

    def __init__(self, why: str) -> None:
        super().__init__(EXIT_FENCED)
        self.why = why


def until_stored(write: Callable[[], object], *, deadline: float, beat: Callable[[], None] = lambda: None,
                 pause: float = 0.5) -> None:
    """``write()`` to etcd, retried through an outage until ``deadline`` (monotonic), and for as
    long as etcd answers but refuses writes for its space quota (:class:`StoreFull`: only an
    operator can end that, and the training is done, so the rank waits for it, saying why
    once); beating meanwhile. The last StoreError is raised if etcd never came back."""
    outage, said = max(0.0, deadline - time.monotonic()), ""
    while True:
        try:
            write()
            return
        except StoreFull as e:
            if said != "full":
                log.error("%s; this rank finished and waits to record it", e)
            said, deadline = "full", time.monotonic() + outage  # an outage after it gets its whole limit
        except StoreError:
            if time.monotonic() >= deadline:
                raise
            if said != "down":
                log.warning("etcd unavailable while writing the done mark; retrying")
            said = "down"
        beat()
        time.sleep(pause)


class Session:
    """One rank's training session (see the module docstring).

    ``snap_dir``: where the snapshot slots go -- the agent's shared-memory run directory,
    which its replicator and persister read (None: a temporary directory, for a session
    without an agent). ``snapshot_delay``: a test knob, seconds every background snapshot
    copy is held open so that an injected failure lands while one is in flight.
    ``delay()``: seconds to sleep after each step (the agent's slow-rank chaos).
    """

    def __init__(
        self,
        *,
        store: Store,
        job: str,
        spec: JobSpec,
        rank: int,
        epoch: int,
        node: str,
        incarnation: str,
        sid: int | None = None,
        beat: Callable[[int], None] = lambda step: None,
        backend: str | None = None,
        agent_pid: int = 0,
        delay: Callable[[], float] = lambda: 0.0,
        snap_dir: str | Path | None = None,
        snapshot_delay: float = 0.0,
    ) -> None:
        self.job = job
        self.spec = spec
        self.rank = rank
        self.sid = rank if sid is None else int(sid)  # names this seat's snapshots and replicas
        self._fresh: bool | None = None  # a seat added by a grow, not yet holding any state
        self.node = node
        self.incarnation = incarnation
        self.world_size = spec.ranks
        self.epoch = 0
        self._target_epoch = epoch
        self.committed = -1  # last step completed (with every collective in it) on this rank
        self.step_time = 0.0
        self.compute_time = 0.0  # EWMA of seconds per step outside collectives
        self.metrics: dict[str, float] = {}
        self._delay = delay
        self.js = JobStore(store, job)
        self._beat_fn = beat
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._pg = ReconfigurableProcessGroup(
            self._rendezvous_store, backend=backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT), beat=self._beat,
            rank=rank, world_size=spec.ranks,
        )
        register(self._pg)  # the default group: dist.get_rank(), dist.all_reduce(t), DeviceMesh
        self._mesh: Any = None
        self._shard_world: int | None = None  # the world size FSDP2 shards were cut for
        self.link = ControlLink(self.js, self, node, on_epoch=self._pg.supersede)
        self.chaos = ChaosHook(self.js, spec.chaos, job=job, node=node, agent_pid=agent_pid,
                               persist_root=spec.persist_root, event=self.link.event, beat=self._beat,
                               lease_ttl=spec.lease_ttl)
        self._grad_buf: torch.Tensor | None = None
        self._resumed_pending = self._first_step = False
        self.snapshots = SnapshotEngine(Path(snap_dir or tempfile.mkdtemp(prefix="hotspare-snap-")), self.sid,
                                        replicate_every=spec.point_every, beat=self._beat, test_delay=snapshot_delay)
        self.snapshots.providers = [("rng", RNGState())]
        self.snapshots.superseded = lambda: self.link.latest_epoch > self.epoch
        self.snapshots.admit = self._admit_snapshots  # this node's room, before a bigger layout's first slot
        self._replicas = PeerReplicas(self.js, self.sid, self.snapshots, replicas=spec.replicas)
        self._dirty = False  # an optimizer stepped since the last snapshot
        self.last_restore: dict = {}
        self._last_point = time.monotonic()  # when the newest replication point was taken

    # -- public API -----------------------------------------------------------------------
    def track(self, **components: object) -> None:
        """Register state to snapshot and restore: ``model=``, ``optimizer=``,
        ``scheduler=``, ``data=`` (anything with ``state_dict``/``load_state_dict``),
        ``extra=`` (a dict of JSON values, restored in place) or custom providers.
        torch/numpy/Python RNG states are always tracked."""
        providers = list(self.snapshots.providers)
        for name, obj in components.items():
            if obj is None:
                continue
            if any(n == name or n.startswith(name + ".") for n, _ in providers):
                raise ValueError(f"track(): {name!r} is already tracked")
            providers += provider_for(name, obj)
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._before_optimizer_step)
            if hasattr(obj, "on_update_start"):  # an OffloadedAdamW updates layers before step()
                obj.on_update_start.append(self._before_optimizer_step)
        self.snapshots.providers = providers

    def _before_optimizer_step(self, *_: object) -> None:
        # parameters and optimizer state are about to change: the previous step's
        # snapshot copy must be done reading them (usually it long is)
        self.snapshots.wait()
        self._dirty = True

    @property
    def process_group(self) -> ReconfigurableProcessGroup:
        """The job's process group: a ``torch.distributed.ProcessGroup`` (also the default
        group) whose backend is rebuilt under every epoch. Pass it where a torchrun script
        passes its group: ``DistributedDataParallel(model, process_group=...)``."""
        return self._pg

    @property
    def device_mesh(self) -> Any:
        """A 1-D ``DeviceMesh`` over the job's group, for FSDP2:
        ``fully_shard(module, mesh=session.device_mesh)``. A job sharded this way keeps its
        world size: a lost rank is replaced one for one; a shrink or grow is refused."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self._pg, self._pg.device.type if self._pg.joined else
                                               ("cuda" if self._pg.backend_name == "nccl" else "cpu"))
            self._shard_world = self._pg.size()
        return self._mesh

    @property
    def total_steps(self) -> int:
        """The spec's ``steps``: what ``session.steps()`` runs to without an argument (for an
        LR schedule's length, say), so the count is written once, in the spec."""
        return int(self.spec.steps)

    def data_loader(self, dataset: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                    drop_last: bool = False, num_workers: int = 0, collate_fn: Callable | None = None,
                    name: str | None = None, **loader_kwargs: Any) -> ElasticDataLoader:
        """A tracked, exactly resumable loader of a map-style dataset, sharded by rank: one
        ``next(loader)`` per step (``for step, batch in zip(session.steps(), loader)``).
        Call it before ``steps()``. Tracked as ``name`` (default ``data_loader``, then
        ``data_loader1``, ...); other keywords go to ``torch.utils.data.DataLoader``. See
        :class:`hotspare.recovery.data.ElasticDataLoader`."""
        return session_loader(self, dataset, batch_size, name, shuffle=shuffle, seed=seed, drop_last=drop_last,
                              num_workers=num_workers, collate_fn=collate_fn, **loader_kwargs)

    def log(self, **metrics: float) -> None:
        """Record metrics for the current step (published with progress, off the step path)."""
        self.metrics.update({k: float(v) for k, v in metrics.items()})

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> bool:
        return self._pg.allreduce_(tensor, op)

    def allreduce_grads(self, model: torch.nn.Module) -> bool:
        """Average gradients over the group in one flat bucket. False if the step failed
        (the session will roll it back; the caller may carry on with the step)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return self._pg.healthy
        n = sum(g.numel() for g in grads)
        buf = self._grad_buf
        if buf is None or buf.numel() != n or buf.dtype != grads[0].dtype:
            buf = self._grad_buf = torch.empty(n, dtype=grads[0].dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=buf)
        if not self._pg.allreduce_(buf, stage=False):
            self._grad_buf = None  # gloo may still write into it: never reuse
            return False
        buf.div_(self.world_size)
        off = 0
        for g in grads:
            g.copy_(buf[off : off + g.numel()].view_as(g))
            off += g.numel()
        return True

    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield step numbers until ``total`` steps are done, surviving failures.

        A step whose collectives failed is not committed: after the group is rebuilt
        every rank resumes from the newest step all members completed.
        """
        total = int(total if total is not None else self.spec.steps)
        self.link.start()
        unwatch = watch_untracked_loaders(self)  # warns once if a plain DataLoader is read across steps
        try:
            step = self._join()
            while True:
                if step >= total:
                    self._write_final(total)
                    if self._pg.barrier_():
                        break
                    step = self._join()
                    continue
                if not self._pg.healthy:
                    step = self._join()
                    continue
                self.chaos.at_step(step, self.rank)
                t0 = time.perf_counter()
                comm0 = self._pg.comm_seconds
                yield step
                slow = self.chaos.slow or self._delay()
                if slow:
                    time.sleep(slow)
                point = self._agree_point(step) if self._pg.healthy else False
                if not self._pg.healthy:
                    log.warning("step %d failed (%s); rolling back", step, self._pg.error)
                    step = self._join()
                    continue
                self._commit(step, time.perf_counter() - t0, self._pg.comm_seconds - comm0, point)
                step += 1
            self._finish(total)
        finally:
            unwatch()
            self.link.stop()
            self.snapshots.close()

    # -- internals ------------------------------------------------------------------------
    def _agree_point(self, step: int) -> bool:
        """Whether ``step`` becomes a replication point, the same answer on every rank. Only a
        candidate can (every ``replicate_every``-th step); with ``replicate_interval`` set,
        the ranks vote at each candidate -- one tiny allreduce (MAX) -- and it is a point
        when any rank wants it: ``replicate_interval`` seconds passed since the last point,
        it is a ``persist_every`` step, or this rank's agent passed on a ``hotspare
        checkpoint`` request for it. The interval is each rank's own clock; the vote is
        what makes the answer common."""
        if not self.snapshots.is_candidate(step):
            return False
        spec = self.spec
        if spec.replicate_interval <= 0:
            return True
        want = (time.monotonic() - self._last_point >= spec.replicate_interval
                or (spec.persist_every > 0 and step % spec.persist_every == 0)
                or self.snapshots.requested_point() == step)
        if self.world_size > 1:
            vote = torch.tensor([int(want)], dtype=torch.int32)
            if not self._pg.allreduce_(vote, dist.ReduceOp.MAX, stage=False):
                return False  # the step failed: the caller rolls back
            want = bool(vote.item())
        return want

    def _commit(self, step: int, seconds: float, comm_seconds: float, point: bool = True) -> None:
        """``step`` completed with every collective in it: snapshot it (to a point slot if the
        ranks agreed on one), beat, and tell the timeline if it is the first step after a
        recovery."""
        self.step_time = seconds
        compute = seconds - comm_seconds
        self.compute_time = compute if self.compute_time == 0 else 0.8 * self.compute_time + 0.2 * compute
        self.committed = step
        self.snapshots.capture(step, point=point)
        if point:
            self._last_point = time.monotonic()
        self._dirty = False
        self._beat(step)
        if self._first_step:  # the first step trained in this world: its progress record at once
            self._first_step = False
            self.link.progress_now()
        if self._resumed_pending:
            self._resumed_pending = False
            self.link.put(events.resumed(self.rank, self.epoch, step))

    def _finish(self, total: int) -> None:
        """Every member passed the final barrier: the manifest, the last progress, the done mark."""
        write_manifest(self.spec.output_dir, self.job, self.world_size, total, self.epoch)
        try:  # written before the done mark: once one rank is done, agents stop the rest
            self.link.publish_progress()  # the last step's metrics, not the last periodic ones
            self.js.event(EventKind.FINISHED, f"rank{self.rank}", f"rank {self.rank} finished {total} steps",
                          rank=self.rank, epoch=self.epoch)
        except StoreError:
            pass
        # an etcd hiccup now must not turn a finished rank into a failure (security review F21)
        until_stored(lambda: self.js.mark_done(self.rank, self.epoch, total),
                     deadline=time.monotonic() + default_etcd_outage_limit(self.spec.lease_ttl), beat=self._beat)

    def _admit_snapshots(self, data_len: int, slot_bytes: int, slots: int) -> None:
        """Whether this node has room for every copy of such a state it keeps (its ranks' slots,
        its buddies' replicas); raises ShmTooSmall, ending the job with the numbers and the fix."""
        need = need_for(self.spec, state_bytes=data_len, copy_bytes=slot_bytes, slots_per_rank=slots)
        check_room(self.snapshots.dir, need, self.spec.shm_budget, who=f"rank {self.rank}")

    def _beat(self, step: int | None = None) -> None:
        self._beat_fn(self.committed if step is None else step)

    def _rendezvous_store(self, epoch: int) -> dist.Store:
        return EtcdC10dStore(
            self.js.store,
            f"{self.js.keys.rdzv_prefix}epoch/{epoch}",
            timeout=self._pg.timeout,
            should_abort=lambda: self.link.latest_epoch > epoch,
            on_wait=self._beat,
        )

    def _next_epoch(self) -> int:
        """Block (beating) until an epoch newer than the broken one is published."""
        want = max(self._target_epoch, self.epoch + 1)
        deadline = time.monotonic() + self.spec.hang_timeout
        while self.link.latest_epoch < want:
            self.link.check_epoch()
            if self.link.latest_epoch >= want:
                break
            if time.monotonic() > deadline:
                raise GroupBroken(
                    f"collective failed ({self._pg.error}) and no new epoch came within "
                    f"hang_timeout; giving up this worker so the controller replaces it"
                )
            self._beat()
            time.sleep(0.02)
        return self.link.latest_epoch

    def _locate(self, world_epoch: int) -> tuple[int, int]:
        """My rank and the world size in ``world_epoch``; Fenced if I am no longer in it.

        The seat is found by its sid, not its number: a shrink renumbers the survivors
        (and epochs may have been skipped), but keeps each seat's sid."""
        if self._fresh is None:  # was my seat added by a grow? (then I own no state yet)
            w0 = self.link.world(self._target_epoch)
            self._fresh = 0 < w0.grown_from <= self.rank
        w = self.link.world(world_epoch)
        for rank, seat in enumerate(w.seats):
            if w.sid(rank) == self.sid and seat.node == self.node and seat.incarnation == self.incarnation:
                return rank, w.size
        raise Fenced(f"rank {self.rank} (sid {self.sid}) is no longer on {self.node} at epoch {w.epoch}")

    def _join(self) -> int:
        """(Re)build the group for the newest epoch and agree on where to resume."""
        while True:
            epoch = self._next_epoch()
            rank, size = self._locate(epoch)
            check_world(self._shard_world, size, self._shard_world is not None or self._has_shards())
            t0 = time.time()
            log.info("joining epoch %d as rank %d of %d", epoch, rank, size)
            self.chaos.at_phase("rendezvous", rank, self.committed + 1)
            try:
                self._pg.configure(epoch, rank, size)
            except (RendezvousAborted, RuntimeError, TimeoutError) as e:
                # a member died or the epoch moved on mid-rendezvous: wait for the next one
                log.info("rendezvous of epoch %d failed: %s", epoch, str(e).splitlines()[0])
                self.epoch = epoch
                continue
            self.rank, self.world_size, self.epoch = rank, size, epoch
            # what this epoch computes descends from this epoch's restore (see SnapshotEngine.lineage)
            self.snapshots.lineage = {"timeline": epoch, "world_rank": rank, "world_size": size}
            log.info("group of epoch %d built in %.3fs", epoch, time.time() - t0)
            self.link.put(events.rebuilt(rank, epoch, began=t0, seconds=time.time() - t0, pid=os.getpid(),
                                         node=self.node))
            try:
                restored = self._agree_and_restore(epoch)
            except StepFailed:
                continue
            if self._shard_world is None and self._has_shards():
                self._shard_world = size
            if after_join(self._pg, fresh_start=restored.step < 0) < 0:
                continue  # DDP's start-of-job module broadcast failed: wait for the next epoch
            if restored.seated:
                self._fresh = False
            if restored.clean:
                self._dirty = False
            self.committed = restored.step
            self._last_point = time.monotonic()  # every rank restored one step: the interval starts anew
            self._beat()  # the heartbeat names the restored step: a failure is reported at the step it hit
            self._resumed_pending, self._first_step = epoch > 1, True
            self.last_restore = restored.info()
            self.link.put(events.restored(rank, epoch, restored.step, **self.last_restore))
            return restored.step + 1

    def _has_shards(self) -> bool:
        """Whether a tracked model holds FSDP2 shards (DTensor parameters)."""
        return any(sharded(p.module.parameters()) for _, p in self.snapshots.providers if isinstance(p, ModuleState))

    def _agree_and_restore(self, epoch: int) -> Restored:
        """Agree with the other members on the newest step all can restore, and restore it
        (:class:`hotspare.recovery.restore.RestoreAgreement`). A survivor offers its own snapshot
        slots; a spare in a lost rank's seat (its slots empty, after the first epoch) asks
        the replica holders; a seat fresh from a grow offers nothing and is sent a member's
        state; the persisted tier is the fallback of all."""
        t0 = time.time()
        me = Membership(self.rank, self.world_size, epoch)
        own = LocalSlots(self.snapshots, live_step=None if self._dirty else self.committed)
        fresh = bool(self._fresh) and not own.offer()
        sources: list[StateSource] = [own]
        wider: list[StateSource] = []  # a survivor's seat's replica holders, asked only if no step is common
        if epoch > 1 and not fresh:
            (wider if own.offer() else sources).append(self._replicas)
        tier = PersistentTier(self.spec.persist_root, self.snapshots, self._pg, me, self.link.event)
        resume = self.spec.resume_root  # `hotspare run --resume`: the previous run's checkpoints
        prev = PersistentTier(resume, self.snapshots, self._pg, me, self.link.event) if resume else None
        return RestoreAgreement(self._pg, self.snapshots, me, phase=lambda name, step: self.chaos.at_phase(
            name, me.rank, step)).run(sources, tier, fresh, started=t0, resume=prev, wider=wider)

    def _write_final(self, total: int) -> None:
        self.snapshots.wait()
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {}
        for name, p in self.snapshots.providers:
            tensors.update({f"{name}/{k}": t for k, t in materialized(p).items()})
            meta[name] = p.meta()
        write_rank(self.spec.output_dir, self.rank, total - 1, tensors, meta)
