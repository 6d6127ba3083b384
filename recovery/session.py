"""The training process's view of hotspare: ``train(session, **args)``.

``for step in session.steps(total)`` drives everything the user should not have to:
joining the epoch's process group, agreeing on the step to resume from, rolling a step
back when a collective in it failed, rebuilding the group under the new epoch, and the
final barrier. Nothing here touches etcd on the step path: epoch changes arrive through
:class:`ControlLink` (a background thread) as a plain attribute.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from orchestrator.spec import ChaosEntry, JobSpec
from orchestrator.store import CONTROLLER, JobStore, Store, StoreError
from orchestrator.store.c10d import EtcdC10dStore, RendezvousAborted

from .control import ControlLink
from .final import write_manifest, write_rank
from .process_group import ReconfigurableProcessGroup
from .snapshot import SnapshotEngine, restore, tensors_from_bytes
from .state import RNGState, provider_for, reseed

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = 60.0  # seconds a collective or rendezvous may take before it counts as failed
WINDOW = 64  # steps considered when agreeing on a common snapshot (newest - 63 .. newest)


class _StepFailed(Exception):
    """A collective of the recovery protocol failed: wait for the next epoch."""


class Fenced(SystemExit):
    """This worker no longer owns its rank (the world moved on without it)."""

    def __init__(self, why: str) -> None:
        super().__init__(3)
        self.why = why


class Unrecoverable(RuntimeError):
    """No copy of the state this rank needs is left (no common snapshot, no usable checkpoint)."""


class Session:
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
        self._agent_pid = agent_pid
        self._slow = 0.0
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._pg = ReconfigurableProcessGroup(
            self._rendezvous_store, backend=backend, timeout=timeout, beat=self._beat
        )
        self.link = ControlLink(self.js, self, node, on_epoch=self._pg.supersede)
        self._grad_buf: torch.Tensor | None = None
        self._resumed_pending = False
        snap_dir = Path(os.environ.get("HOTSPARE_SNAP_DIR") or tempfile.mkdtemp(prefix="hotspare-snap-"))
        self.snapshots = SnapshotEngine(
            snap_dir,
            self.sid,
            replicate_every=spec.point_every,
            beat=self._beat,
        )
        self.snapshots.providers = [("rng", RNGState())]
        self.snapshots.superseded = lambda: self.link.latest_epoch > self.epoch
        self._dirty = False  # an optimizer stepped since the last snapshot
        self._secret = b""
        self.last_restore: dict = {}

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
        self.snapshots.providers = providers

    def _before_optimizer_step(self, *_: object) -> None:
        # parameters and optimizer state are about to change: the previous step's
        # snapshot copy must be done reading them (usually it long is)
        self.snapshots.wait()
        self._dirty = True

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
        try:
            step = self._join()
            while True:
                if step >= total:
                    self._write_final(total)
                    if self._pg.barrier():
                        break
                    step = self._join()
                    continue
                if not self._pg.healthy:
                    step = self._join()
                    continue
                self._maybe_chaos(step)
                t0 = time.perf_counter()
                comm0 = self._pg.comm_seconds
                yield step
                slow = self._slow or self._delay()
                if slow:
                    time.sleep(slow)
                if not self._pg.healthy:
                    log.warning("step %d failed (%s); rolling back", step, self._pg.error)
                    step = self._join()
                    continue
                self.step_time = time.perf_counter() - t0
                compute = self.step_time - (self._pg.comm_seconds - comm0)
                self.compute_time = compute if self.compute_time == 0 else 0.8 * self.compute_time + 0.2 * compute
                self.committed = step
                self.snapshots.capture(step)
                self._dirty = False
                self._beat(step)
                if self._resumed_pending:
                    self._resumed_pending = False
                    self.link.event("resumed", f"rank {self.rank} completed step {step}", epoch=self.epoch, rank=self.rank, step=step)
                step += 1
            write_manifest(self.spec.output_dir, self.job, self.world_size, total, self.epoch)
            try:  # written before the done mark: once one rank is done, agents stop the rest
                self.link.publish_progress()  # the last step's metrics, not the last periodic ones
                self.js.event("finished", f"rank{self.rank}", f"rank {self.rank} finished {total} steps",
                              rank=self.rank, epoch=self.epoch)
            except StoreError:
                pass
            self.js.mark_done(self.rank, self.epoch, total)
        finally:
            self.link.stop()
            self.snapshots.close()

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
        deadline = time.monotonic() + self.spec.hang_timeout
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
            t0 = time.time()
            log.info("joining epoch %d as rank %d of %d", epoch, rank, size)
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
            try:
                restore_step, info = self._agree_and_restore(epoch)
            except _StepFailed:
                continue
            self.committed = restore_step
            self._resumed_pending = epoch > 1
            self.last_restore = info
            self.link.event(
                "restored",
                f"rank {rank} resumes after step {restore_step} ({info['source']})",
                epoch=epoch,
                rank=rank,
                restore_step=restore_step,
                **info,
            )
            return restore_step + 1

    def _holders(self) -> dict[int, list[tuple[str, str, int]]]:
        """step -> replica holders of this rank's state, asking every live agent."""
        from .replica_client import list_steps

        snap = self.js.snapshot()
        if not self._secret:
            self._secret = self.js.secret()
        found: dict[int, list[tuple[str, str, int]]] = {}
        for n in snap.nodes.values():
            if not n.replica_port:
                continue
            try:
                for s in list_steps(n.host, n.replica_port, self._secret, self.sid):
                    found.setdefault(s, []).append((n.name, n.host, n.replica_port))
            except Exception as e:  # noqa: BLE001 - a dead or partitioned holder
                log.info("replica holder %s unreachable: %s", n.name, e)
        return found

    def _agree_and_restore(self, epoch: int) -> tuple[int, dict]:
        """Agree on the newest step every member can restore, then restore it.

        Survivors offer the steps in their own snapshot slots; a newcomer (spare) offers
        the steps replica holders have for its sid. Two small allreduces: MAX of each
        member's newest step (and of a flag per rank: "my seat is fresh from a grow"), then
        MIN of an availability mask over the 64 steps below it. A fresh seat constrains
        nothing; it receives a member's state once the others have restored
        (:meth:`_send_to_fresh`).
        """
        t0 = time.time()
        local = set(self.snapshots.available())
        fresh = bool(self._fresh) and not local
        remote: dict[int, list[tuple[str, str, int]]] = {}
        if not local and epoch > 1 and not fresh:
            remote = self._holders()
        offer = local | set(remote)
        head = torch.zeros(1 + self.world_size, dtype=torch.int64)
        head[0] = max(offer) if offer else -2
        head[1 + self.rank] = int(fresh)
        if not self._pg.allreduce_(head, dist.ReduceOp.MAX):
            raise _StepFailed()
        top = int(head[0].item())
        fresh_ranks = [r for r in range(self.world_size) if head[1 + r].item()]
        if top == -2:  # nobody holds any state: a fresh start
            self.snapshots.capture(-1)
            self.snapshots.wait()
            self._fresh = False
            return -1, {"source": "fresh start", "bytes": 0, "seconds": 0.0}
        persisted = self._persisted_step()
        mask = torch.tensor([1 if fresh or top - i in offer else 0 for i in range(WINDOW)] + [persisted],
                            dtype=torch.int64)
        if not self._pg.allreduce_(mask, dist.ReduceOp.MIN):
            raise _StepFailed()
        common = [top - i for i in range(WINDOW) if mask[i].item() == 1]
        persisted = int(mask[WINDOW].item())  # the newest checkpoint every member sees
        if not common and persisted >= 0:
            return self._restore_persisted(persisted, t0)
        if not common:
            raise Unrecoverable(
                f"rank {self.rank}: no snapshot step is held by every member of epoch {epoch} "
                f"(this rank offers {sorted(offer)[-5:]}, newest anywhere {top}) and there is no "
                f"complete persisted checkpoint in {self._persist_root()}: the state of a lost rank "
                "and all its replicas is gone (set persist_every to survive this)"
            )
        step = max(common)
        if fresh:
            source, nbytes = "", 0  # filled in by the transfer below
        elif step in local:
            skip = set() if (self._dirty or step != self.committed) else {
                n for n, p in self.snapshots.providers if p.async_ok
            }
            self.snapshots.load_local(step, skip=skip)
            self.snapshots.invalidate_after(step)
            source = "own snapshot" + (" (small state only)" if skip else "")
            nbytes = 0
        else:
            header, body, holder = self._fetch(step, remote[step])
            restore(self.snapshots.providers, tensors_from_bytes(header, body), header["meta"])
            self.snapshots.capture(step, timeline=header.get("timeline"))
            self.snapshots.wait()
            source, nbytes = f"replica on {holder}", len(body)
        if fresh_ranks:
            source, nbytes = self._send_to_fresh(step, fresh_ranks, source, nbytes)
        self._dirty = False
        return step, {"source": source, "bytes": nbytes, "seconds": round(time.time() - t0, 4)}

    def _send_to_fresh(self, step: int, fresh_ranks: list[int], source: str, nbytes: int) -> tuple[str, int]:
        """Seats added by a grow have no state of their own: the lowest-ranked member that
        has some broadcasts its restored snapshot of ``step`` (data-parallel replicas hold
        identical parameters, optimizer, scheduler and data position). A fresh rank keeps
        all of it but the RNGs, which it seeds from the donor's RNG state and its own rank:
        deterministic, and distinct per rank. Its data shard follows from the shared global
        position and its rank (e.g. :class:`recovery.sampler.ElasticSampler`)."""
        donor = min(r for r in range(self.world_size) if r not in fresh_ranks)
        sizes = torch.zeros(2, dtype=torch.int64)
        payload = b""
        if self.rank == donor:
            header, body = self.snapshots.read(step)
            hb = json.dumps(header, separators=(",", ":")).encode()
            payload = hb + bytes(body)
            sizes[0], sizes[1] = len(hb), len(body)
        if not self._pg.broadcast_(sizes, donor):
            raise _StepFailed()
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.zeros(int(sizes.sum().item()), dtype=torch.uint8)
        if not self._pg.broadcast_(buf, donor):
            raise _StepFailed()
        if self.rank not in fresh_ranks:
            return source, nbytes
        hlen = int(sizes[0].item())
        raw = buf.numpy().tobytes()
        header = json.loads(raw[:hlen])
        restore(self.snapshots.providers, tensors_from_bytes(header, raw[hlen:]), header["meta"])
        digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + f"/{self.rank}".encode()).digest()
        reseed(int.from_bytes(digest[:8], "little") >> 1)
        self.snapshots.capture(step, timeline=header.get("timeline"))
        self.snapshots.wait()
        self._fresh = False
        return f"peer rank {donor} (grown seat)", len(raw) - hlen

    def _persist_root(self) -> str:
        return self.spec.persist_root

    def _persisted_step(self, below: int | None = None) -> int:
        """Newest complete persisted checkpoint of this world size (older than ``below``), or -1."""
        from . import persist

        root = self._persist_root()
        try:  # never let the fallback's lookup break a recovery that may not need it
            for step in reversed(persist.complete_steps(root)):
                if below is not None and step >= below:
                    continue
                if int(persist.read_manifest(root, step)["world_size"]) == self.world_size:
                    return step
        except Exception as e:  # noqa: BLE001 - CheckpointError, fsspec/object-store errors
            log.warning("persisted checkpoints in %s not usable: %s", root, e)
        return -1

    def _restore_persisted(self, step: int, t0: float) -> tuple[int, dict]:
        """Every member rolls back to a persisted checkpoint (no replica of a lost rank is left).

        Each member first reads and verifies its own file; only if every member could (a MIN
        allreduce of an ok flag) do they restore it. Otherwise they all move on to the next
        older complete checkpoint, so one corrupt, truncated or pruned file never leaves the
        others waiting in a collective. None left: :class:`Unrecoverable`, in every member.
        """
        from . import persist

        root = self._persist_root()
        refused: list[str] = []
        while step >= 0:
            try:
                m = persist.read_manifest(root, step)
                tensors, meta = persist.load_rank(root, step, self.rank, m)
                err = None
            except Exception as e:  # noqa: BLE001 - CheckpointError names the file; object-store errors
                tensors, meta, m, err = None, None, None, e
            if err is not None:
                log.error("persisted checkpoint of step %d unusable here: %s", step, err)
                self.link.event("checkpoint-unusable", f"rank {self.rank}: {err}", rank=self.rank,
                                step=step, epoch=self.epoch)
            flag = torch.tensor([0 if err else 1, self._persisted_step(below=step)], dtype=torch.int64)
            if not self._pg.allreduce_(flag, dist.ReduceOp.MIN):
                raise _StepFailed()
            if flag[0].item() == 1:
                restore(self.snapshots.providers, tensors, meta)
                self.snapshots.invalidate_after(-2)
                timelines = {rec.get("timeline") for rec in m["files"].values()}
                self.snapshots.capture(step, timeline=timelines.pop() if len(timelines) == 1 else None)
                self.snapshots.wait()
                self._dirty = False
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                return step, {"source": f"persisted checkpoint {persist.checkpoint_path(root, step)}"
                              + (f" (step(s) {', '.join(refused)} unusable)" if refused else ""),
                              "bytes": nbytes, "seconds": round(time.time() - t0, 4)}
            refused.append(str(step))
            step = int(flag[1].item())  # the newest older one every member sees
        raise Unrecoverable(
            f"no usable persisted checkpoint in {root}: step(s) {', '.join(refused)} could not be read by "
            "every member (see the checkpoint-unusable events) and no older complete one exists"
        )

    def _corrupt_checkpoint(self) -> None:
        """Chaos: flip bytes in the middle of this rank's file of the newest complete checkpoint
        (a bad disk, a torn copy) -- recovery must refuse it and fall back to an older one."""
        from . import persist

        root = self._persist_root()
        steps = persist.complete_steps(root) if "://" not in root else []
        if not steps:
            self.link.event("corrupted", f"corrupt-checkpoint: no complete checkpoint in {root} yet", rank=self.rank)
            return
        f = persist.step_dir(root, steps[-1]) / f"rank{self.rank}.safetensors"
        with open(f, "r+b") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(size // 2)
            b = fh.read(16)
            fh.seek(size // 2)
            fh.write(bytes(x ^ 0xFF for x in b))
        self.link.event("corrupted", f"corrupted {f}", rank=self.rank, step=steps[-1], path=str(f))

    def _fetch(self, step: int, holders: list[tuple[str, str, int]]) -> tuple[dict, bytes, str]:
        from .replica_client import fetch_first

        return fetch_first(holders, self._secret, self.sid, step)

    def _write_final(self, total: int) -> None:
        self.snapshots.wait()
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {}
        for name, p in self.snapshots.providers:
            tensors.update({f"{name}/{k}": t for k, t in p.tensors().items()})
            meta[name] = p.meta()
        write_rank(self.spec.output_dir, self.rank, total - 1, tensors, meta)

    def _maybe_chaos(self, step: int) -> None:
        """Scheduled failures from the spec, fired exactly once at the start of a step.

        Entries targeting a rank fire in that rank; entries naming a node (or no target:
        kill-controller, restart-etcd) fire in rank 0. What this process can do itself
        (kill, stop or slow itself, kill its own agent) it does at once, precisely at the
        step; the rest goes through etcd to whoever executes it, as the CLI would.
        """
        for i, c in enumerate(self.spec.chaos):
            if c.at_step != step:
                continue
            mine = c.rank == self.rank if c.rank is not None else self.rank == 0
            if not mine:
                continue
            try:
                if not self.js.fire_once(i):
                    continue  # already fired in an earlier life of this step
                target = c.node or self.node
                self.js.event(
                    "chaos",
                    f"rank{self.rank}",
                    f"scheduled {c.action} at step {step}"
                    + (f" of rank {c.rank}" if c.rank is not None else "")
                    + (f" on {c.node}" if c.node else ""),
                    action=c.action,
                    rank=c.rank,
                    node=target,
                    step=step,
                    seconds=c.seconds,
                )
                self._fire(c, target)
            except StoreError as e:
                log.warning("chaos entry %d not fired: %s", i, e)

    def _fire(self, c: ChaosEntry, node: str) -> None:
        action = c.action
        log.warning("chaos: %s at step (rank %d)", action, self.rank)
        if action == "kill-rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "hang-rank":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "slow-rank":
            self._slow = 0.5 if c.seconds is None else max(0.0, float(c.seconds))  # 0 clears it
        elif action == "corrupt-checkpoint":
            self._corrupt_checkpoint()
        elif action == "kill-node" and node == self.node and self._agent_pid:
            # the agent dies; this worker and its siblings follow through PDEATHSIG
            os.kill(self._agent_pid, signal.SIGKILL)
            time.sleep(5)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action in ("kill-node", "partition-node"):
            self.js.send_chaos(node, {"action": action, "seconds": c.seconds, "evented": True})
        elif action == "kill-controller":
            self.js.send_chaos(CONTROLLER, {"action": action, "evented": True})
        elif action == "restart-etcd":
            import subprocess
            import sys

            subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cli", "chaos", self.job, "--action",
                 "restart-etcd", "--seconds", str(c.seconds or 5)],
                start_new_session=True, stdin=subprocess.DEVNULL,
            )
