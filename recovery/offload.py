"""AdamW with its optimizer state on disk (GreedySnake-style SSD offload), bit-identical to
``torch.optim.AdamW``.

    opt = OffloadedAdamW(model, path=f"/nvme/offload/rank{rank}", lr=3e-4, weight_decay=0.1,
                         ram_budget_bytes=256 << 20, overlap=True)
    for x, y in data:
        loss_fn(model(x), y).backward()    # layer updates start here, as gradients become final
        opt.step()                         # hands off (overlap) or finishes the rest
        sched.step(); opt.zero_grad()

**What is offloaded.** The parameters stay ordinary fp32 module parameters in RAM (they are
the master copy: no second one). Adam's moments (``exp_avg``, ``exp_avg_sq``, and
``max_exp_avg_sq`` with ``amsgrad``) live in files under ``path`` (one directory per rank),
one file per *layer* and version. A layer is, by default, the direct parameters of one
module (``model.named_modules()`` order); ``layers=[block0, block1, ...]`` makes each given
module (all its parameters) one layer instead -- what :func:`vertical_step` wants.

**When a layer is updated.** A ``register_post_accumulate_grad_hook`` on every parameter
notices when all of a layer's gradients are final and queues the layer; a stepper thread
reads the layer's moments (prefetched ahead of need, in the order the previous iteration's
backward produced gradients: learned, starting from reverse module order), applies
``torch.optim.adam.adam`` (the very function ``torch.optim.AdamW`` calls; on CPU its
single-tensor loop) to the layer, and writes the moments back, while backward goes on.
``step()`` queues whatever the hooks did not (parameters without hooks, layers with an unused
parameter) and then, with ``overlap=False``, waits until every layer is updated and written;
with ``overlap=True`` it returns at once, the remaining layers are updated in forward order,
and a forward pre-hook on each module waits only for the layers its parameters belong to:
never a stale weight. Hyper-parameters (``lr`` ...) are read from ``param_groups`` when a layer
is queued, i.e. during backward: change them (LR scheduler) after ``step()`` as usual, not
between ``backward()`` and ``step()``. Code that must see all gradients before the update
(global-norm clipping, ``GradScaler`` unscaling) needs ``step_in_backward=False``.

**Gradient accumulation.** ``accumulation_steps=k``: the k-th backward since the last
``step()`` is the final one for each parameter. Or mark micro-batches explicitly:
``with opt.accumulating(): loss.backward()`` (not final) and ``with opt.final_micro_batch():``.

**Memory.** Moments pass through a pool of page-aligned buffers, each the size of the largest
layer's state: ``ram_budget_bytes`` (default: two layers) // that size buffers; a layer larger
than the budget is a ``ValueError``. On top: Adam's own temporaries (as in torch), 4 KiB per layer.

**I/O.** :mod:`hotspare.recovery.offload_io`: O_DIRECT ``preadv``/``pwritev`` on a thread pool
(the measurements behind that choice are there), per-chunk CRC32 (``verify``), data first and
the header last. Writes of one layer go to the version (``a``/``b``) that does *not* hold its
last completed state, and an iteration's writes start only after the previous iteration's
finished, so the files always hold the last completed step (``completed_step``), listed by
``state_files()`` and in ``manifest.json`` (rewritten when a step completes). A failed write
(``ENOSPC``: both versions are preallocated with ``posix_fallocate`` when first written, so the
disk fills up there, early) or a corrupt/short file raises one :class:`OffloadError` naming
the file; the optimizer then refuses to continue, and the previous version is untouched:
``load_from(opt.state_files())`` (or the directory) on a new optimizer restores it. Nothing is
fsync'ed: the files survive a crash of the process (what hotspare recovers from), not a power cut.

**Snapshots (hotspare).** The optimizer is itself a state provider, so
``session.track(model=model, optimizer=opt)`` makes its state part of every snapshot, replica and
checkpoint, and a spare restores it (into its own ``path``). Nothing is copied on the training
thread: the snapshot engine, on its own thread, waits for the pending updates and reads the
layer files straight into the snapshot (``meta()``/``fill()``), while the next forward runs; the
next iteration's first update waits for that read (``on_update_start``, which the session
hooks). The price: each snapshot slot in shared memory holds a copy of the optimizer state
(offload keeps the state out of the training process, not off the node while hot swap is on).
With ``overlap=True`` parameters are updated after ``step()`` returns: call ``opt.finish()``
before code of your own reads them all (the session does so before it snapshots them).

**DDP.** ``DistributedDataParallel`` averages gradients at the end of backward, after the
gradient hooks fired: with a DDP model the default is ``step_in_backward=False`` (every layer
is updated from ``step()``, still overlapped with the next forward), and ``True`` is refused.

Limits: dense contiguous CPU parameters (no DTensor), no ``add_param_group``, torch's single-tensor
update (what ``torch.optim.AdamW`` runs on CPU), not foreach/fused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam as adam_fn

from .offload_io import CHUNK, Buffer, IOBackend, Layer, OffloadError, S, build_layers, pack_header
from .offload_state import OffloadStateMixin
from .offload_vertical import vertical_step

__all__ = ["OffloadedAdamW", "OffloadError", "vertical_step"]

HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def _in_backward(model: nn.Module, asked: bool | None) -> bool:
    """``step_in_backward`` as given, or its default: yes, except under DDP, whose gradient
    hooks fire before it averages the gradients (True is refused there)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return True if asked is None else asked
    if asked:
        raise ValueError("step_in_backward=True with a DistributedDataParallel model would update layers "
                         "from each rank's own gradients (DDP averages them at the end of backward): "
                         "leave step_in_backward unset (False under DDP)")
    return False


class OffloadedAdamW(OffloadStateMixin, torch.optim.Optimizer):
    """AdamW whose moments live in per-layer files under ``path``; see the module docstring.

    ``model``: the module whose parameters are optimized (all, in one group, unless
    ``param_groups`` -- torch-style dicts with ``params`` from ``model`` -- says otherwise).
    ``layers``: modules, each one layer (default: each module's direct parameters).
    ``ram_budget_bytes``: RAM for state buffers (default: two layers' worth).
    ``overlap``: ``step()`` hands off and each layer's forward waits for its own update.
    ``step_in_backward``: update layers from gradient hooks (else everything in ``step()``);
    default: yes, unless ``model`` is a ``DistributedDataParallel`` (refused there).
    ``accumulation_steps``: backward passes per step (the last one's hooks update).
    ``io_threads``, ``direct`` (O_DIRECT), ``verify`` (CRC32), ``chunk``: the I/O backend.
    """

    async_ok = True  # tensors() returns fresh copies read back from the files

    def __init__(self, model: nn.Module, path: str | os.PathLike, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, param_groups: list[dict] | None = None,
                 layers: Sequence[nn.Module] | None = None, ram_budget_bytes: int | None = None,
                 overlap: bool = True, step_in_backward: bool | None = None, accumulation_steps: int = 1,
                 io_threads: int = 4, direct: bool = True, verify: bool = True, chunk: int = CHUNK) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(param_groups if param_groups is not None else list(model.parameters()), defaults)
        if accumulation_steps < 1:
            raise ValueError("accumulation_steps must be >= 1")
        self.model, self.overlap, self.in_backward = model, overlap, _in_backward(model, step_in_backward)
        #: called on the training thread before an iteration's first layer update is queued (the
        #: hotspare session waits there for the snapshot still reading the files and parameters)
        self.on_update_start: list[Any] = []
        self._started = -1  # the iteration on_update_start was last called for
        self.accumulation_steps = accumulation_steps
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lockf = open(self.root / ".lock", "w")  # noqa: SIM115 - held for the optimizer's life
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lockf.close()
            raise OffloadError(f"{self.root} is in use by another OffloadedAdamW (give each rank and "
                               "optimizer its own path)") from None
        self.io = IOBackend(io_threads, chunk, direct, verify)
        self.keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if any(g["amsgrad"] for g in self.param_groups) else ())
        self.layers = build_layers(model, self.param_groups, layers, self.keys, self.root, chunk)
        self.slot_bytes = max(L.total for L in self.layers) if self.layers else 0
        budget = 2 * self.slot_bytes if ram_budget_bytes is None else int(ram_budget_bytes)
        big = max(self.layers, key=lambda L: L.total, default=None)
        if big is not None and budget < big.total:
            raise ValueError(f"layer {big.index} ({big.name}) alone needs {big.total} bytes of optimizer-state "
                             f"buffer, more than ram_budget_bytes={budget}: raise the budget to at least "
                             f"{big.total} (2x for overlap) or split the layer (layers=...)")
        self.nslots = budget // self.slot_bytes if self.slot_bytes else 0
        self.ram_budget_bytes = budget
        self._free, self._made = [], 0  # layer buffers made and free
        self._cv = threading.Condition()
        self._error: OffloadError | None = None
        self._it = 0  # the open iteration: number of step() calls so far
        self._done = 0  # iterations whose layers are all updated and written: the completed step
        self._queue: dict[int, list[Layer]] = {}
        self._left: dict[int, int] = {}
        self._order: list[int] = [L.index for L in reversed(self.layers)]
        self._seen: list[int] = []
        self._counts: dict[int, int] = {}
        self._mode: str | None = None
        self.wait_s = self.compute_s = 0.0
        self._stop = self._paused = False
        self._handles: list[Any] = []
        if self.in_backward:  # the resolved default, not the argument (None: yes, except under DDP)
            for L in self.layers:
                for i, p in enumerate(L.params):
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda p, L=L, i=i: self._on_grad(L, i, p)))
        if overlap:
            self._prehooks()
        self._thread = threading.Thread(target=self._loop, name="hs-offload-stepper", daemon=True)
        self._thread.start()

    # -- construction ------------------------------------------------------------------------
    def _prehooks(self) -> None:
        layer_of = {id(p): L for L in self.layers for p in L.params}
        for m in self.model.modules():
            mine = list({id(layer_of[id(p)]): layer_of[id(p)] for p in m.parameters(recurse=False)
                         if id(p) in layer_of}.values())
            if mine:
                self._handles.append(m.register_forward_pre_hook(lambda m, a, mine=mine: self._wait(mine)))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "layers"):
            raise NotImplementedError("OffloadedAdamW: parameter groups are fixed at construction")
        super().add_param_group(param_group)

    # -- main-thread API -----------------------------------------------------------------------
    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside are not the last micro-batch: no layer is updated."""
        return self._as("accumulate")

    def final_micro_batch(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside are the last micro-batch, whatever ``accumulation_steps`` says."""
        return self._as("final")

    @contextlib.contextmanager
    def _as(self, mode: str) -> Iterator[None]:
        old, self._mode = self._mode, mode
        try:
            yield
        finally:
            self._mode = old

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _starting(self) -> None:
        if self._started != self._it:
            self._started = self._it
            for fn in self.on_update_start:  # outside the lock: they may wait for a snapshot's finish()
                fn()

    def _on_grad(self, L: Layer, i: int, p: torch.Tensor) -> None:
        if self._mode == "accumulate" or self._error is not None:
            return
        if self._mode != "final":
            n = self._counts[id(p)] = self._counts.get(id(p), 0) + 1
            if n < self.accumulation_steps:
                return
        self._starting()
        with self._cv:
            if L.pending is not None and L.pending < self._it:
                self._wait_locked([L])  # its previous update (a forward that skipped it)
            if L.queued_it == self._it:
                return  # a second "final" backward before step(): the update already started
            L.grads[i] = p.grad
            if len(L.grads) == L.trainable():
                self._enqueue(L)
                self._seen.append(L.index)

    def _enqueue(self, L: Layer) -> None:
        L.pending = L.queued_it = self._it
        L.hyper = [{k: g[k] for k in HYPER} for g in self.param_groups]
        self._queue.setdefault(self._it, []).append(L)
        self._left[self._it] = self._left.get(self._it, 0) + 1
        self._cv.notify_all()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Queue the layers the hooks did not; then wait for all (``overlap=False``) or return."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._raise()
        self._starting()
        t0 = time.perf_counter()
        with self._cv:
            t = self._it
            late = []
            for L in self.layers:
                if L.queued_it == t:
                    continue
                if L.pending is not None:  # still owes an earlier update (its forward never ran)
                    self._wait_locked([L])
                for i, p in enumerate(L.params):
                    if i not in L.grads and p.grad is not None:
                        L.grads[i] = p.grad
                if L.grads:
                    late.append(L)
            late.sort(key=lambda L: L.index if self.overlap else self._rank(L.index))
            for L in late:
                self._enqueue(L)
            q = self._queue.get(t, [])
            if self.overlap:  # started ones first (they hold buffers), the rest in forward order
                q.sort(key=lambda L: (L.state == S.IDLE, L.index if L.state == S.IDLE else 0))
            if self._seen:
                self._order, self._seen = self._seen, []
            self._counts.clear()
            self._it += 1
            self._advance()  # the hooks may have finished every layer already
            for L in self.layers:  # speculative reads of layers that got no gradient
                if L.pending is None and L.state == S.LOADED:
                    self._release(L)
            self._cv.notify_all()
            if not self.overlap:
                while self._done < self._it and self._error is None:
                    self._cv.wait()
        self.wait_s += time.perf_counter() - t0
        self._raise()
        return loss

    def _rank(self, index: int) -> int:
        try:
            return self._order.index(index)
        except ValueError:
            return len(self._order) + index

    def _wait(self, layers: list[Layer]) -> None:
        if self._error is None and all(L.pending is None or L.pending >= self._it for L in layers):
            return
        t0 = time.perf_counter()
        with self._cv:
            self._wait_locked(layers)
        self.wait_s += time.perf_counter() - t0
        self._raise()

    def _wait_locked(self, layers: list[Layer]) -> None:
        while self._error is None and any(L.pending is not None and L.pending < self._it for L in layers):
            self._cv.wait()

    def finish(self) -> None:
        """Wait until every stepped iteration's updates are applied and written."""
        t0 = time.perf_counter()
        with self._cv:
            while self._done < self._it and self._error is None:
                self._cv.wait()
        self.wait_s += time.perf_counter() - t0
        self._raise()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # pending updates read these very gradient tensors
            self.finish()
        super().zero_grad(set_to_none=set_to_none)

    @property
    def completed_step(self) -> int:
        """Optimizer steps whose state is completely written (what the files hold)."""
        return self._done

    def stats(self) -> dict[str, Any]:
        return {"wait_s": self.wait_s, "compute_s": self.compute_s, "io_busy_s": self.io.busy_s,
                "bytes_read": self.io.bytes_read, "bytes_written": self.io.bytes_written,
                "direct": self.io.direct, "buffers": self.nslots, "buffer_bytes": self.slot_bytes,
                "buffers_made": self._made, "layers": len(self.layers)}

    def close(self) -> None:
        """Finish pending updates (unless failed), stop the threads, close the files (they stay)."""
        with contextlib.suppress(OffloadError):
            if self._thread.is_alive():
                self.finish()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.io.shutdown()
        for L in self.layers:
            for v, fd in enumerate(L.fds):
                if fd is not None:
                    self.io.close(fd)
                    L.fds[v] = None
        if not self._lockf.closed:
            self._lockf.close()

    def __enter__(self) -> OffloadedAdamW:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the stepper thread (everything below runs there or on I/O threads) -------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                job = None
                while job is None:
                    if self._stop:
                        return
                    if self._error is None and not self._paused:
                        self._prefetch()
                        job = self._pick()
                    if job is None:
                        self._cv.wait()
                job.state = S.COMPUTING
            try:
                self._compute(job)
                self._write(job)
            except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
                self._fail(job, e, "updating")

    def _take(self) -> Buffer | None:
        if self._free:
            return self._free.pop()
        if self._made < self.nslots:
            self._made += 1
            return Buffer(self.slot_bytes)
        return None

    def _release(self, L: Layer) -> None:
        if L.slot is not None:
            self._free.append(L.slot)
        L.slot, L.state = None, S.IDLE

    def _prefetch(self) -> None:
        w = self._done
        todo = [L for L in self._queue.get(w, []) if L.state == S.IDLE]
        if w == self._it:  # backward of this iteration not over: guess the next layers
            todo += [self.layers[i] for i in self._order
                     if self.layers[i].queued_it != w and self.layers[i].state == S.IDLE]
        for L in todo:
            buf = self._take()
            if buf is None:
                return
            L.slot, L.state = buf, S.LOADING
            if L.cur < 0:
                buf.zero(L.header_len, L.total)
                L.state = S.LOADED
                continue
            try:
                self.io.read(self._fd(L, L.cur), buf, L.header_len, L.total, L.crcs[L.cur],
                             on_done=lambda b, L=L: self._loaded(L, b))
            except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
                self._fail(L, e, "reading")
                return

    def _loaded(self, L: Layer, batch: Any) -> None:
        if batch.error is not None:
            self._fail(L, batch.error, "reading")
            return
        with self._cv:
            L.state = S.LOADED
            if L.pending is None and self._done < self._it:  # speculative, and no gradient came
                self._release(L)
            self._cv.notify_all()

    def _pick(self) -> Layer | None:
        q = self._queue.get(self._done, [])
        for k, L in enumerate(q):
            if L.state == S.LOADED:
                return q.pop(k)
        return None

    @torch.no_grad()
    def _compute(self, L: Layer) -> None:
        t0 = time.perf_counter()
        assert L.slot is not None
        views = L.views(L.slot)
        for gi in sorted(set(L.groups)):
            idx = [i for i, g in enumerate(L.groups) if g == gi and i in L.grads]
            if not idx:
                continue
            h = L.hyper[gi]
            adam_fn([L.params[i] for i in idx], [L.grads[i] for i in idx],
                    [views["exp_avg"][i] for i in idx], [views["exp_avg_sq"][i] for i in idx],
                    [views["max_exp_avg_sq"][i] for i in idx] if h["amsgrad"] else [],
                    [L.steps[i] for i in idx], foreach=False, fused=False, capturable=False,
                    differentiable=False, has_complex=any(torch.is_complex(L.params[i]) for i in idx),
                    decoupled_weight_decay=True, amsgrad=h["amsgrad"], beta1=h["betas"][0],
                    beta2=h["betas"][1], lr=h["lr"], weight_decay=h["weight_decay"], eps=h["eps"],
                    maximize=h["maximize"])
        self.compute_s += time.perf_counter() - t0

    def _fd(self, L: Layer, v: int) -> int:
        fd = L.fds[v]
        if fd is None:
            fd = L.fds[v] = self.io.open(L.paths[v])
        return fd

    def _write(self, L: Layer) -> None:
        v = 0 if L.cur < 0 else 1 - L.cur
        gen = L.pending + 1 if L.pending is not None else self._it
        steps = [float(s) for s in L.steps]
        L.error_path = L.paths[v]
        new = L.fds[v] is None
        fd = self._fd(L, v)
        if new:
            try:
                os.posix_fallocate(fd, 0, L.total)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        assert L.slot is not None
        buf = L.slot
        with self._cv:
            L.state, L.pending, L.grads = S.WRITING, None, {}
            self._cv.notify_all()  # the layer's parameters are updated: its forward may run

        def header_done(b: Any, crcs: list[int]) -> None:
            with self._cv:
                if b.error is not None:
                    raise b.error
                L.cur, L.crcs[v], L.gens[v], L.state = v, crcs, gen, S.IDLE
                self._finished_one(gen - 1)

        def data_done(b: Any) -> None:
            with self._cv:
                if b.error is not None:
                    raise b.error
                self._free.append(buf)  # the header goes from its own small buffer: reads may go on
                L.slot = None
                self._cv.notify_all()
            if L.head is None:
                L.head = Buffer(L.header_len)
            L.head.view[:] = pack_header(L.header_meta(gen, self.io, b.crcs, steps), L.header_len)
            self.io.write(fd, L.head, 0, L.header_len, on_done=self._guard(L, lambda h: header_done(h, b.crcs)))

        self.io.write(fd, buf, L.header_len, L.total, on_done=self._guard(L, data_done))

    def _guard(self, L: Layer, fn: Any) -> Any:
        """An I/O callback whose failure stops the optimizer with a clear error (never a hang)."""
        def run(b: Any) -> None:
            try:
                fn(b)
            except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
                self._fail(L, e, "writing")
        return run

    def _finished_one(self, t: int) -> None:
        self._left[t] -= 1
        self._advance()

    def _advance(self) -> None:
        """Complete the finished iterations (closed by step(), every layer written)."""
        while self._done < self._it and self._left.get(self._done, 0) == 0:
            self._queue.pop(self._done, None)
            self._left.pop(self._done, None)
            self._done += 1
            try:
                self._write_manifest()
            except OSError as e:
                self._set_error(OffloadError(f"could not write {self.root / 'manifest.json'}: {e}; the layer files "
                                             f"hold step {self._done}: free space, then restore with load_from()"))
        self._cv.notify_all()
