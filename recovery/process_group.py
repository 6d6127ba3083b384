"""A process group that is reconfigured, not recreated by its users.

The facade stays the same object for the whole job; its backend (gloo on CPU, NCCL on
GPU) is rebuilt for every epoch on a fresh store prefix. When the control plane says a
newer epoch exists, collectives in flight are *abandoned* at once: on gloo ``abort()``
does not interrupt a pending ``wait()`` (shared/notes), so we never block in ``wait()``.
Each collective waits on an event set either by the work's completion callback or by
:meth:`supersede`, whichever comes first.

Errors are recorded, not raised (torchft's rule): a failed or abandoned collective
returns ``False`` and marks the step as failed; the session then rolls the step back and
rebuilds. Abandoned work keeps its (staged) tensors alive in a graveyard, because gloo
may still write into them until its own timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class EpochSuperseded(RuntimeError):
    """A newer epoch exists; this group's collectives are void."""


class GroupBroken(RuntimeError):
    """The group broke (a collective or its rendezvous failed) and no newer epoch came to
    rebuild it: the worker gives its seat up. A crash for the controller to handle like a lost
    worker, never a code error (``agents.worker.not_the_code``)."""


class ReconfigurableProcessGroup:
    def __init__(
        self,
        make_store: Callable[[int], dist.Store],
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=60),
        beat: Callable[[], None] = lambda: None,
    ) -> None:
        self._make_store = make_store
        self.backend_name = backend
        self.timeout = timeout
        self._beat = beat
        self._pg: dist.ProcessGroup | None = None
        self.epoch = 0
        self.rank = -1
        self.world_size = 0
        self._latest_epoch = 0  # newest epoch the control plane told us about
        self._lock = threading.Lock()
        self._waiters: set[threading.Event] = set()
        self._graveyard: list[object] = []
        self.error: str | None = None
        self.device = torch.device("cpu")
        self.comm_seconds = 0.0  # wall time spent inside collectives (straggler scoring)

    # -- control plane side ---------------------------------------------------------------
    def supersede(self, epoch: int) -> None:
        """Called from the control thread: epoch ``epoch`` exists. Wakes every waiter."""
        with self._lock:
            if epoch <= self._latest_epoch:
                return
            self._latest_epoch = epoch
            waiters = list(self._waiters)
        for ev in waiters:
            ev.set()

    @property
    def latest_epoch(self) -> int:
        return self._latest_epoch

    @property
    def superseded(self) -> bool:
        return self._latest_epoch > self.epoch

    @property
    def healthy(self) -> bool:
        return self._pg is not None and self.error is None and not self.superseded

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
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            pg = self._build_gloo(store, epoch, rank, world_size)
        self._pg = pg
        self.epoch, self.rank, self.world_size = epoch, rank, world_size
        with self._lock:
            self._latest_epoch = max(self._latest_epoch, epoch)

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
        """Give up on the current backend (recording why); the next configure replaces it."""
        if self.error is None:
            self.error = why
        if self.backend_name == "nccl" and self._pg is not None:
            try:  # NCCL can be aborted for real, unlike gloo
                self._pg.abort()
            except Exception:  # noqa: BLE001
                pass

    # -- collectives ----------------------------------------------------------------------
    def _run(self, what: str, launch: Callable[[dist.ProcessGroup], dist.Work], keep: object) -> bool:
        if not self.healthy:
            if self.error is None and self.superseded:
                self.error = f"epoch {self.epoch} superseded by {self._latest_epoch}"
            return False
        assert self._pg is not None
        try:
            work = launch(self._pg)
        except Exception as e:  # noqa: BLE001
            self.abandon(f"{what} failed to start: {e}")
            return False
        t0 = time.perf_counter()
        done = threading.Event()
        with self._lock:
            self._waiters.add(done)
            if self.superseded:
                done.set()
        try:
            work.get_future().add_done_callback(lambda _f: done.set())
            while not done.wait(0.5):
                self._beat()
        finally:
            with self._lock:
                self._waiters.discard(done)
            self.comm_seconds += time.perf_counter() - t0
        if not work.is_completed() and self.superseded:
            self._graveyard.append((work, keep))
            self.abandon(f"{what} abandoned: epoch {self.epoch} superseded by {self._latest_epoch}")
            return False
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - peer died, connection reset, timeout ...
            self._graveyard.append((work, keep))
            self.abandon(f"{what} failed: {str(e).splitlines()[0][:200]}")
            return False
        return True

    def allreduce_(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, stage: bool = True
    ) -> bool:
        """In-place allreduce that never blocks past a failure. True if it completed.

        By default the collective runs on a private staging copy: if it is abandoned, gloo
        may keep writing into the staging buffer, never into the caller's tensor. A caller
        that owns a scratch buffer and drops it after a failure passes ``stage=False``.
        """
        buf = tensor.detach().clone() if stage else tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        ok = self._run("allreduce", lambda pg: pg.allreduce([buf], opts), buf)
        if ok and stage:
            tensor.copy_(buf)
        return ok

    def broadcast_(self, tensor: torch.Tensor, src: int) -> bool:
        stage = tensor.detach().clone()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        ok = self._run("broadcast", lambda pg: pg.broadcast([stage], opts), stage)
        if ok:
            tensor.copy_(stage)
        return ok

    def barrier(self) -> bool:
        return self.allreduce_(torch.zeros(1, device=self.device))

    @property
    def backend(self) -> dist.ProcessGroup:
        """The current epoch's raw backend (for DDP); replaced at every epoch."""
        if self._pg is None:
            raise EpochSuperseded("process group not configured")
        return self._pg

