"""The job's process group: one ``torch.distributed.ProcessGroup`` whose backend is replaced,
never its users' reference to it.

:class:`ReconfigurableProcessGroup` **is** a ``ProcessGroup`` (a Python subclass, through
torch's pybind trampoline), so ``DistributedDataParallel(model, process_group=...)``,
FSDP2's ``DeviceMesh`` and plain ``dist.all_reduce(t)`` use it as written in a torchrun
script. It is also registered as the default group. Every collective is forwarded to the
current epoch's backend (gloo on CPU, NCCL on GPU), which is rebuilt for every epoch on a
fresh store prefix.

The rule for failures (torchft's): errors are recorded, never raised, and the work a
collective returns **always completes**. When the control plane says a newer epoch
exists, every collective in flight is *abandoned* at once: its future completes with the
caller's tensors as they are (garbage), the group records why, and the session rolls the
step back and rebuilds. Nothing ever blocks in the backend's own ``wait()`` (on gloo
``abort()`` does not interrupt one; shared/notes). On gloo, the backend works on private
*staged* copies of the tensors it writes: abandoned work can still be written into by
gloo until its timeout, so it writes into a buffer kept alive in a graveyard, never into
a DDP bucket the next step uses. NCCL can be aborted for real, so it works in place.

Before the session's first join there is no backend. DDP's constructor still runs two
collectives (a parameter-shape allgather and a broadcast of rank 0's module state); they
complete locally, and the session redoes the module broadcast when the job starts fresh
(``hotspare.recovery.frameworks``). Any other collective before the first join is an
error that says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .collectives import (
    BACKEND_NAME,
    GROUP_NAME,
    HotspareWork,
    Op,
    TorchCollectives,
    future_of,
    register,
)

__all__ = ["EpochSuperseded", "GroupBroken", "HotspareWork", "ReconfigurableProcessGroup", "register"]

log = logging.getLogger(__name__)



class EpochSuperseded(RuntimeError):
    """A newer epoch exists; this group's collectives are void."""


class GroupBroken(RuntimeError):
    """The group broke (a collective or its rendezvous failed) and no newer epoch came to
    rebuild it: the worker gives its seat up. A crash for the controller to handle like a lost
    worker, never a code error (``agents.worker.not_the_code``)."""


class ReconfigurableProcessGroup(TorchCollectives, dist.ProcessGroup):
    def __init__(
        self,
        make_store: Callable[[int], dist.Store],
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=60),
        beat: Callable[[], None] = lambda: None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(rank, world_size)
        self._make_store = make_store
        self.backend_name = backend
        self.timeout = timeout
        self._beat = beat
        self._pg: dist.ProcessGroup | None = None
        self.epoch = 0
        self._rank = rank
        self._size = world_size
        self._latest_epoch = 0  # newest epoch the control plane told us about
        self._lock = threading.Lock()
        self._pending: dict[int, Op] = {}
        self._graveyard: list[object] = []
        self.error: str | None = None
        self.device = torch.device("cpu")
        self.comm_seconds = 0.0  # wall time with a collective in flight (straggler scoring)
        self._busy_since = 0.0
        self._beating = threading.Condition(self._lock)
        self._beater: threading.Thread | None = None
        self.prejoin_ops: list[str] = []  # collectives completed locally before the first join

    # -- what torch asks of a ProcessGroup --------------------------------------------------
    def getRank(self) -> int:  # noqa: N802 - the C++ name the trampoline calls
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def world_size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802
        # not "gloo"/"nccl": torch would then look for a C++ backend object registered on
        # the group (DDP's logger does), and there is none -- every call comes through here.
        # dist.get_backend() still answers the inner backend's name (see register()).
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return GROUP_NAME

    def getGroupDesc(self) -> str:  # noqa: N802
        return "hotspare's reconfigurable job group"

    def abort(self) -> None:
        self.abandon("aborted by its user")

    def shutdown(self) -> None:
        """``dist.destroy_process_group()`` in a script: the session owns the backend and
        ends it with the job, so this is a no-op."""

    def __repr__(self) -> str:
        return (f"<hotspare ReconfigurableProcessGroup {self.backend_name} epoch {self.epoch} "
                f"rank {self._rank}/{self._size}>")

    # -- control plane side ---------------------------------------------------------------
    def supersede(self, epoch: int) -> None:
        """Called from the control thread: epoch ``epoch`` exists. Abandons every
        collective in flight (their futures complete; the step will be rolled back)."""
        with self._lock:
            if epoch <= self._latest_epoch:
                return
            self._latest_epoch = epoch
            abandoned = self._take_pending() if self._latest_epoch > self.epoch else []
        if abandoned:
            self._record(f"{abandoned[0].what} abandoned: epoch {self.epoch} superseded by {epoch}")
        for op in abandoned:
            self._graveyard.append((op.work, op.staged))
            op.fut.set_result(op.outputs)
        if self.backend_name == "nccl" and self._pg is not None and self.superseded:
            # NCCL work is never "pending" here (its future is chained, see _collective): abort
            # the communicator, so a kernel waiting for a dead peer ends and its future errors
            self.abandon(f"epoch {self.epoch} superseded by {epoch}")

    @property
    def latest_epoch(self) -> int:
        return self._latest_epoch

    @property
    def superseded(self) -> bool:
        return self._latest_epoch > self.epoch

    @property
    def healthy(self) -> bool:
        return self._pg is not None and self.error is None and not self.superseded

    @property
    def joined(self) -> bool:
        return self.epoch > 0

    # -- (re)configuration ----------------------------------------------------------------
    def configure(self, epoch: int, rank: int, world_size: int) -> None:
        """Build the backend for ``epoch``. Raises if the rendezvous is superseded."""
        old = self._pg
        if old is not None:
            self._graveyard.append(old)  # never destroy: pending work may still reference it
        self._pg = None
        self.error = None
        store = self._make_store(epoch)
        if self.backend_name == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = self.timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            pg = self._build_gloo(store, epoch, rank, world_size)
        self._pg = pg
        self.epoch, self._rank, self._size = epoch, rank, world_size
        with self._lock:
            self._latest_epoch = max(self._latest_epoch, epoch)
        register(self)

    def _build_gloo(self, store: dist.Store, epoch: int, rank: int, world_size: int) -> dist.ProcessGroup:
        """Construct the gloo group in a helper thread (the constructor releases the GIL),
        beating meanwhile. After the rendezvous every member connects to every other one: a
        member that dies in between would hold the rest in that connect until the gloo
        timeout, without a heartbeat. A newer epoch abandons the construction instead (the
        thread ends at the timeout; what it built, if anything, goes to the graveyard)."""
        box: dict[str, object] = {}
        done = threading.Event()

        def build() -> None:
            try:
                box["pg"] = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=build, name=f"gloo-build-epoch{epoch}", daemon=True).start()
        while not done.wait(0.2):
            self._beat()
            if self._latest_epoch > epoch:
                self._graveyard.append(box)
                raise EpochSuperseded(f"epoch {epoch} superseded by {self._latest_epoch} while its group was connecting")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["pg"]  # type: ignore[return-value]

    def abandon(self, why: str) -> None:
        """Give up on the current backend (recording why); the next configure replaces it.
        Collectives in flight complete at once."""
        self._record(why)
        with self._lock:
            abandoned = self._take_pending()
        for op in abandoned:
            self._graveyard.append((op.work, op.staged))
            op.fut.set_result(op.outputs)
        if self.backend_name == "nccl" and self._pg is not None:
            try:  # NCCL can be aborted for real, unlike gloo
                self._pg.abort()
            except Exception:  # noqa: BLE001
                pass

    def _record(self, why: str) -> None:
        if self.error is None:
            self.error = why

    # -- the collective machinery ---------------------------------------------------------
    def _take_pending(self) -> list[Op]:
        """(lock held) Every op in flight, marked done so its backend callback is ignored."""
        ops = list(self._pending.values())
        self._pending.clear()
        for op in ops:
            op.done = True
        self._idle()
        return ops

    def _idle(self) -> None:
        """(lock held) Account the time a collective was in flight."""
        if not self._pending and self._busy_since:
            self.comm_seconds += time.perf_counter() - self._busy_since
            self._busy_since = 0.0

    def _collective(
        self,
        what: str,
        outputs: Sequence[torch.Tensor],
        launch: Callable[[dist.ProcessGroup, list[torch.Tensor]], dist.Work | list[dist.Work]],
        prejoin: Callable[[], None] | None = None,
        stage: bool = True,
    ) -> HotspareWork:
        """Run ``launch(backend, staged_outputs)`` under the group's rules and return work
        that always completes. ``outputs`` are the caller's tensors the collective writes;
        ``prejoin`` says how it completes locally before the first join (None: it may not)."""
        outs = list(outputs)
        if self.epoch == 0 and self._pg is None:
            if prejoin is None:
                raise RuntimeError(
                    f"hotspare: {what} on the job's process group before session.steps() started: the "
                    "group forms when the training loop starts; move the collective into the loop")
            prejoin()
            self.prejoin_ops.append(what)
            return self._completed(outs)
        if not self.healthy:
            if self.error is None and self.superseded:
                self.error = f"epoch {self.epoch} superseded by {self._latest_epoch}"
            return self._completed(outs)
        assert self._pg is not None
        stage = stage and self.backend_name != "nccl"
        staged = [t.detach().clone() for t in outs] if stage else outs
        op = Op(what, outs, staged)
        try:
            op.work = launch(self._pg, staged)
        except Exception as e:  # noqa: BLE001
            self.abandon(f"{what} failed to start: {str(e).splitlines()[0][:200]}")
            return self._completed(outs)
        with self._lock:
            if not self._pending:
                self._busy_since = time.perf_counter()
            self._pending[id(op)] = op
            self._beating.notify()
            late = self.superseded  # superseded before the op was registered: abandon it here
        if not stage and self.backend_name == "nccl":
            return self._chained(op, late)
        self._ensure_beater()
        self._on_done(op)
        if late:
            self.abandon(f"{what} abandoned: epoch {self.epoch} superseded by {self._latest_epoch}")
        return HotspareWork(self, op.fut)

    def _chained(self, op: Op, late: bool) -> HotspareWork:
        """NCCL: the backend's future is a CUDA future (it completes when the work is queued;
        waiting on it makes the current stream wait for NCCL's). The work handed out chains
        on it, so it keeps those stream semantics, and never raises: a failure (an abort
        after a newer epoch, a dead peer) is recorded and the caller's tensors come back."""
        with self._lock:
            self._pending.pop(id(op), None)
            self._idle()
        assert isinstance(op.work, dist.Work)

        def done(f: torch.futures.Future) -> list[torch.Tensor]:
            try:
                f.value()
            except Exception as e:  # noqa: BLE001 - aborted, peer died, timeout
                self._record(f"{op.what} failed: {str(e).splitlines()[0][:200]}")
            return op.outputs

        op.fut = op.work.get_future().then(done)
        if late:
            self.abandon(f"{op.what} abandoned: epoch {self.epoch} superseded by {self._latest_epoch}")
        return HotspareWork(self, op.fut, op.work)

    def _on_done(self, op: Op) -> None:
        """Call :meth:`_finish` when the backend's work (one, or a list) completes."""
        if isinstance(op.work, list):
            fut = torch.futures.collect_all([future_of(w, op.what) for w in op.work])
        else:
            fut = future_of(op.work, op.what)
        fut.add_done_callback(lambda f: self._finish(op, f))

    def _finish(self, op: Op, f: torch.futures.Future) -> None:
        """The backend's work completed (in the backend's thread)."""
        with self._lock:
            if op.done:
                return  # abandoned meanwhile: its future already completed
            op.done = True
            self._pending.pop(id(op), None)
            self._idle()
        try:
            for x in f.value() if isinstance(op.work, list) else [f]:
                x.value()
        except Exception as e:  # noqa: BLE001 - peer died, connection reset, timeout ...
            self._graveyard.append((op.work, op.staged))
            self.abandon(f"{op.what} failed: {str(e).splitlines()[0][:200]}")
        else:
            if op.staged is not op.outputs:
                for dst, src in zip(op.outputs, op.staged, strict=True):
                    dst.copy_(src)
        op.fut.set_result(op.outputs)

    def _completed(self, outs: list[torch.Tensor]) -> HotspareWork:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(outs)
        return HotspareWork(self, fut)

    def _wait(self, fut: torch.futures.Future) -> None:
        if fut.done():
            return
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        while not done.wait(0.5):
            self._beat()

    def _ensure_beater(self) -> None:
        """A collective can block in C++ (DDP's reducer waits on its future there): a
        thread keeps the heartbeat going while any collective is in flight, and sleeps
        while none is."""
        if self._beater is None:
            self._beater = threading.Thread(target=self._beat_while_busy, name="hotspare-pg-beat", daemon=True)
            self._beater.start()

    def _beat_while_busy(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._beating.wait()
                self._beating.wait(1.0)
                busy = bool(self._pending)
            if busy:
                self._beat()

    # -- hotspare's own calls: True if the collective completed --------------------------
    def allreduce_(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, stage: bool = True) -> bool:
        """In-place allreduce that never blocks past a failure. True if it completed.
        A caller that owns a scratch buffer and drops it after a failure passes
        ``stage=False`` (no staged copy on gloo)."""
        opts = c10d.AllreduceOptions()
        opts.reduceOp = op
        on = self._on_device(tensor)
        self._collective("allreduce", [on], lambda pg, t: pg.allreduce(t, opts), stage=stage).wait()
        self._back(tensor, on)
        return self.healthy

    def broadcast_(self, tensor: torch.Tensor, src: int) -> bool:
        opts = c10d.BroadcastOptions()
        opts.rootRank = src
        on = self._on_device(tensor)
        self.broadcast([on], opts).wait()
        self._back(tensor, on)
        return self.healthy

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """hotspare's own small control tensors live on the CPU; NCCL takes CUDA tensors only."""
        return t.to(self.device) if self.backend_name == "nccl" and t.device != self.device else t

    def _back(self, t: torch.Tensor, on: torch.Tensor) -> None:
        if on is not t:
            t.copy_(on.to(t.device))  # a synchronizing copy: the collective's result is in

    def barrier_(self) -> bool:
        return self.allreduce_(torch.zeros(1, device=self.device))

    @property
    def backend(self) -> dist.ProcessGroup:
        """The current epoch's raw backend; replaced at every epoch. Prefer the group
        itself: a collective on the raw backend raises when a peer dies."""
        if self._pg is None:
            raise EpochSuperseded("process group not configured")
        return self._pg

