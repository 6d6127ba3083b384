"""The training process's view of hotspare: ``train(session, **args)``.

``for step in session.steps(total)`` drives everything the user should not have to:
joining the epoch's process group, agreeing on the step to resume from, rolling a step
back when a collective in it failed, rebuilding the group under the new epoch, and the
final barrier. Nothing here touches etcd on the step path: epoch changes arrive through
:class:`ControlLink` (a background thread) as a plain attribute.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestrator.store import JobStore, Store, StoreError
from orchestrator.store.c10d import EtcdC10dStore, RendezvousAborted

from .control import ControlLink
from .process_group import ReconfigurableProcessGroup

log = logging.getLogger(__name__)

NO_STATE = 2**62  # a newcomer's vote in the resume-step agreement: "I hold nothing"


class Fenced(SystemExit):
    """This worker no longer owns its rank (the world moved on without it)."""

    def __init__(self, why: str) -> None:
        super().__init__(3)
        self.why = why


class Session:
    def __init__(
        self,
        *,
        store: Store,
        job: str,
        spec: dict,
        rank: int,
        epoch: int,
        node: str,
        incarnation: str,
        beat: Callable[[int], None] = lambda step: None,
        backend: str | None = None,
        agent_pid: int = 0,
    ) -> None:
        self.job = job
        self.spec = spec
        self.rank = rank
        self.node = node
        self.incarnation = incarnation
        self.world_size = spec["ranks"]
        self.epoch = 0
        self._target_epoch = epoch
        self.committed = -1  # last step completed (with every collective in it) on this rank
        self.step_time = 0.0
        self.metrics: dict[str, float] = {}
        self.js = JobStore(store, job)
        self._beat_fn = beat
        self._agent_pid = agent_pid
        self._slow = 0.0
        timeout = timedelta(seconds=float(spec.get("collective_timeout", 60)))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._pg = ReconfigurableProcessGroup(
            self._rendezvous_store, backend=backend, timeout=timeout, beat=self._beat
        )
        self.link = ControlLink(self.js, self, node, on_epoch=self._pg.supersede)
        self._grad_buf: torch.Tensor | None = None
        self._resumed_pending = False

    # -- public API -----------------------------------------------------------------------
    @property
    def process_group(self) -> ReconfigurableProcessGroup:
        return self._pg

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
        if not self._pg.allreduce_(buf):
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
        total = int(total if total is not None else self.spec["steps"])
        self.link.start()
        try:
            step = self._join()
            while True:
                if step >= total:
                    if self._pg.barrier():
                        break
                    step = self._join()
                    continue
                if not self._pg.healthy:
                    step = self._join()
                    continue
                self._maybe_chaos(step)
                t0 = time.perf_counter()
                yield step
                if self._slow:
                    time.sleep(self._slow)
                if not self._pg.healthy:
                    log.warning("step %d failed (%s); rolling back", step, self._pg.error)
                    step = self._join()
                    continue
                self.step_time = time.perf_counter() - t0
                self.committed = step
                self._beat(step)
                if self._resumed_pending:
                    self._resumed_pending = False
                    self.link.event("resumed", f"rank {self.rank} completed step {step}", epoch=self.epoch, rank=self.rank, step=step)
                step += 1
            self.js.mark_done(self.rank, self.epoch, total)
            self.link.event("finished", f"rank {self.rank} finished {total} steps", rank=self.rank, epoch=self.epoch)
        finally:
            self.link.stop()

    # -- internals ------------------------------------------------------------------------
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
        deadline = time.monotonic() + float(self.spec.get("hang_timeout", 60))
        while self.link.latest_epoch < want:
            self.link.check_epoch()
            if self.link.latest_epoch >= want:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"collective failed ({self._pg.error}) and no new epoch came within "
                    f"hang_timeout; giving up this worker so the controller replaces it"
                )
            self._beat()
            time.sleep(0.02)
        return self.link.latest_epoch

    def _locate(self, world_epoch: int) -> tuple[int, int]:
        """My rank and the world size in ``world_epoch``; Fenced if I am no longer in it."""
        w = self.link.world(world_epoch)
        rank = self.rank
        if w.shrunk_from and self.epoch:
            if rank in w.lost:
                raise Fenced(f"rank {rank} was dropped at epoch {w.epoch}")
            rank -= sum(1 for r in w.lost if r < rank)
        if rank >= w.size or w.seats[rank].node != self.node or w.seats[rank].incarnation != self.incarnation:
            raise Fenced(f"rank {self.rank} belongs to another node at epoch {w.epoch}")
        return rank, w.size

    def _join(self) -> int:
        """(Re)build the group for the newest epoch and agree on where to resume."""
        while True:
            epoch = self._next_epoch()
            rank, size = self._locate(epoch)
            t0 = time.time()
            try:
                self._pg.configure(epoch, rank, size)
            except (RendezvousAborted, RuntimeError, TimeoutError) as e:
                # a member died or the epoch moved on mid-rendezvous: wait for the next one
                log.info("rendezvous of epoch %d failed: %s", epoch, str(e).splitlines()[0])
                self.epoch = epoch
                continue
            self.rank, self.world_size, self.epoch = rank, size, epoch
            self.link.event(
                "rebuilt",
                f"rank {rank} joined epoch {epoch}",
                epoch=epoch,
                rank=rank,
                began=t0,
                seconds=time.time() - t0,
                pid=os.getpid(),
                node=self.node,
            )
            vote = torch.tensor([self.committed if self.committed >= 0 else NO_STATE], dtype=torch.int64)
            if not self._pg.allreduce_(vote, dist.ReduceOp.MIN):
                continue
            agreed = int(vote.item())
            restore = -1 if agreed == NO_STATE else agreed
            self._restore(restore)
            self.committed = restore
            self._resumed_pending = epoch > 1
            self.link.event("restored", f"rank {rank} resumes after step {restore}", epoch=epoch, rank=rank, restore_step=restore)
            return restore + 1

    def _restore(self, step: int) -> None:
        """Bring tracked state to the end of ``step`` (state providers plug in here)."""

    def _maybe_chaos(self, step: int) -> None:
        for i, c in enumerate(self.spec.get("chaos") or ()):
            if c["at_step"] != step or c.get("rank") != self.rank:
                continue
            if c["action"] not in ("kill-rank", "hang-rank", "slow-rank", "kill-node"):
                continue
            try:
                if not self.js.store.create(self.js.keys.fired(i), str(time.time())):
                    continue  # already fired in an earlier life of this step
                self.js.event(
                    "chaos",
                    f"rank{self.rank}",
                    f"scheduled {c['action']} of rank {self.rank} at step {step}",
                    action=c["action"],
                    rank=self.rank,
                    node=self.node,
                    step=step,
                )
            except StoreError:
                continue
            self._fire(c)

    def _fire(self, c: dict) -> None:
        action = c["action"]
        log.warning("chaos: %s at step (rank %d)", action, self.rank)
        if action == "kill-rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "hang-rank":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "slow-rank":
            self._slow = float(c.get("seconds") or 0.5)
        elif action == "kill-node" and self._agent_pid:
            # the agent dies; this worker and its siblings follow through PDEATHSIG
            os.kill(self._agent_pid, signal.SIGKILL)
            time.sleep(5)
            os.kill(os.getpid(), signal.SIGKILL)
