"""Lazy asynchronous snapshots into shared-memory slots (DataStates-style).

At the end of step ``s`` the engine captures small state (RNG, data position, buffers,
JSON) synchronously and starts copying parameters and optimizer state into a slot in a
background thread, while the next step's forward and backward run. Those tensors only
change inside ``optimizer.step()``, whose pre-hook waits for the copy if it is still
running — that is the only place training can ever wait.

Slots are files in the agent's shared-memory directory (``/dev/shm``): a worker that
crashes leaves its last complete snapshots behind for its agent to serve. A slot is

    [0, 64)        control block: magic, state, step, seq, header_len, data_off, data_len
    [64, data_off) JSON header: tensor table (name, dtype, shape, offset, nbytes) + meta
    [data_off, )   raw tensor bytes, 64-byte aligned

``state`` is WRITING while a copy is in flight and COMPLETE after it; ``seq`` changes on
every write, so a reader (the agent's replicator) can detect a slot reused under it.
The newest complete slot is never the one a copy writes into.
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .slotfile import (
    _COPIED_OFF,
    _CTRL,
    COMPLETE,
    CTRL_SIZE,
    EMPTY,
    MAGIC,
    WRITING,
    read_confirmation,
    read_slot,
)

log = logging.getLogger(__name__)

# Fault-injection knob for tests: hold every background copy open this many seconds, so
# that a failure reliably lands while a snapshot is in flight. Never set in production.
_TEST_DELAY = float(os.environ.get("HOTSPARE_TEST_SNAPSHOT_DELAY", "0") or 0)
#: how often (bytes of the data area) the writer publishes its progress to streaming readers
STREAM_CHUNK = 8 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


_STAGE_IDS = itertools.count()  # slot files being created get names of their own


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # relative to data_off
    nbytes: int


def plan(tensors: Mapping[str, torch.Tensor]) -> list[TensorInfo]:
    out, off = [], 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name}: dtype {t.dtype} is not supported in snapshots")
        nbytes = t.numel() * t.element_size()
        out.append(TensorInfo(name, DTYPE_NAMES[t.dtype], tuple(t.shape), off, nbytes))
        off = _align(off + nbytes)
    return out


class Slot:
    """One snapshot file, memory-mapped."""

    def __init__(self, path: Path, header_cap: int, data_len: int, create: bool = True,
                 staged: bool = False) -> None:
        """``create``: a new file (else map the existing one). ``staged``: create it aside,
        with every page faulted in now (``MAP_POPULATE``), and put it in place only on
        ``install()`` -- a slot prepared off the critical path, so that its first snapshot
        copies at full speed instead of paying page faults (about 0.8 s per GB here)."""
        self.path = path
        self.data_off = _align(CTRL_SIZE + header_cap, 4096)
        self.size = self.data_off + max(data_len, 1)
        self._staged: Path | None = None
        src = path
        if create:
            # a fresh inode, swapped in whole: a reader (the agent) that has the old file
            # mapped keeps reading the old bytes instead of faulting on a truncated file
            src = path.with_name(f".{path.name}.{os.getpid()}.{next(_STAGE_IDS)}.{'ready' if staged else 'new'}")
            with open(src, "wb") as f:
                f.truncate(self.size)
        fd = os.open(src, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if staged else 0)
            self.mm = mmap.mmap(fd, self.size, flags=flags)
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.data_off,
                                     count=self.size - self.data_off)
        self.header_cap = self.data_off - CTRL_SIZE
        if create:
            self.set_ctrl(EMPTY, -2, 0, 0)
            self._staged = src
            if not staged:
                self.install()

    def fits(self, header_len: int, data_len: int) -> bool:
        return self.header_cap >= header_len and self.size - self.data_off >= data_len

    def install(self) -> None:
        """Put a created slot in place under its path."""
        if self._staged is not None:
            os.replace(self._staged, self.path)
            self._staged = None

    def ctrl(self) -> tuple[int, int, int, int, int, int]:
        magic, state, step, seq, hlen, doff, dlen, _copied = struct.unpack_from(_CTRL, self.mm, 0)
        return state, step, seq, hlen, doff, dlen

    def set_ctrl(self, state: int, step: int, seq: int, hlen: int, copied: int = -1) -> None:
        struct.pack_into(_CTRL, self.mm, 0, MAGIC, state, step, seq, hlen, self.data_off,
                         self.size - self.data_off, copied)

    def set_copied(self, n: int) -> None:
        """Publish that the data area is filled up to ``n`` (streaming readers follow it)."""
        struct.pack_into("<q", self.mm, _COPIED_OFF, n)

    def view(self, info: TensorInfo) -> torch.Tensor:
        raw = self.data[info.offset : info.offset + info.nbytes]
        return raw.view(DTYPES[info.dtype]).view(info.shape)

    def close(self) -> None:
        self.data = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass
        if self._staged is not None:  # prepared but never used
            self._staged.unlink(missing_ok=True)
            self._staged = None


class SnapshotEngine:
    """Per-rank snapshot files under ``directory``: a ring of recent steps, plus the last
    two *replication points*.

    Every step is snapshotted into the ring (``rank<r>.slot<k>``). Every
    ``replicate_every``-th step (and the initial state, step -1) goes to a point slot
    (``rank<r>.point<k>``) instead; the agent ships only points to the buddies. All ranks
    use the same point steps, so a lost rank's replicated step is one every survivor still
    holds. Before writing a new point the engine waits until the agent has confirmed the
    previous one replicated (``rank<r>.replicated``), so the two point slots always hold a
    replicated step. The wait is normally zero: a point is shipped in far less time than
    ``replicate_every`` steps take.
    """

    def __init__(
        self,
        directory: Path,
        rank: int,
        slots: int = 2,
        replicate_every: int = 0,
        beat: Any = lambda: None,
        replication_timeout: float = 120.0,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.nring = max(2, slots)
        self.every = replicate_every
        n = self.nring + (2 if self.every else 0)
        self._slots: list[Slot | None] = [None] * n
        self._steps = [-2] * n  # complete step per slot (-2: none)
        self._seqs = [0] * n  # the write (seq) each slot's step came from
        # every write's seq is unique on this node, across engines too (a new worker of the
        # same rank writes the same step again): the agent confirms a point by (step, seq),
        # so a confirmation of the previous worker's copy never passes for ours
        self._seq = time.time_ns()
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._layout_key: tuple = ()
        self._layout_val: tuple[list[TensorInfo], str] = ([], "[]")
        self._views: dict[int, list[torch.Tensor]] = {}  # slot -> views for the layout
        self._thread = threading.Thread(target=self._run, name=f"snapshot-rank{rank}", daemon=True)
        self._thread.start()
        self.providers: list[tuple[str, Any]] = []
        self.last_capture_s = 0.0
        self.last_wait_s = 0.0
        self.replication_wait_s = 0.0
        self._last_point: tuple[int, int] | None = None  # (step, seq) of the newest point
        self._stream: Any = None
        self._pinned: set[int] = set()  # base addresses registered with CUDA
        # slots prepared (created, pages faulted in) by a background thread before first use
        self._ready: dict[int, Slot] = {}
        self._preparing: int | None = None
        self._prep_cond = threading.Condition()
        self._prep_thread: threading.Thread | None = None
        self._prep_running = False
        self._prep_want = (0, 0)  # (header, data) bytes the prepared slots must hold
        self._prep_failed: set[int] = set()
        self._closing = False
        self._beat = beat
        self.replication_timeout = replication_timeout
        #: True once the job has moved to a newer epoch (set by the session): a point still
        #: waiting for its predecessor's replication is then dropped, not written -- this
        #: step will be rolled back anyway, and writing it would overwrite the replicated
        #: point the new epoch's restore may need
        self.superseded: Callable[[], bool] = lambda: False
        #: written into every header: the rank and world size this state belongs to, and its
        #: timeline -- the epoch whose restore the state descends from. A step computed twice
        #: (before and after a rollback) has two timelines; the persistent tier never mixes
        #: them in one checkpoint. Set by the session when it joins an epoch.
        self.lineage: dict[str, int] = {}
        # a marker left by an earlier worker of this rank on this node says nothing about us
        (self.dir / f"rank{rank}.replicated").unlink(missing_ok=True)

    def path(self, k: int) -> Path:
        if k < self.nring:
            return self.dir / f"rank{self.rank}.slot{k}"
        return self.dir / f"rank{self.rank}.point{k - self.nring}"

    def is_point(self, step: int) -> bool:
        return bool(self.every) and (step == -1 or step % self.every == 0)

    def confirmed(self) -> tuple[int, int]:
        """(step, seq) of the newest point the agent confirmed replicated to every buddy
        ((-2, 0): none)."""
        return read_confirmation(self.dir / f"rank{self.rank}.replicated")

    def replicated(self) -> int:
        """Step of the newest point the agent confirmed replicated (-2: none)."""
        return self.confirmed()[0]

    def _is_replicated(self, point: tuple[int, int]) -> bool:
        # exactly this write: a confirmation the agent was still writing for a dead
        # predecessor's newer point must not pass for ours
        return self.confirmed() == point

    def _await_replication(self) -> bool:
        """Wait until the previous point is confirmed replicated. False: the job moved to a
        newer epoch meanwhile (the caller drops its point)."""
        prev = self._last_point
        if prev is None or self._is_replicated(prev):
            return True
        t0 = time.monotonic()
        try:
            while not self._is_replicated(prev):
                if self.superseded():
                    return False
                if time.monotonic() - t0 > self.replication_timeout:  # noqa: SIM102
                    log.warning("point %d of rank %d not replicated after %.0fs; going on unprotected",
                                prev[0], self.rank, self.replication_timeout)
                    break
                time.sleep(0.005)
            return True
        finally:
            self.replication_wait_s += time.monotonic() - t0

    # -- capture --------------------------------------------------------------------------
    def capture(self, step: int, timeline: int | None = None) -> None:
        """Snapshot the providers as of the end of ``step``.

        ``timeline`` overrides the lineage's for a state restored from elsewhere (a replica,
        a peer): it keeps the timeline of the state it copies.

        On the training thread only the small, step-mutable state is taken (RNG, data
        position, buffers, JSON; cloned). Everything else — walking the optimizer's state,
        the layout, the header, waiting for the previous replication point, the big copy —
        happens on the engine's own thread, before the next ``optimizer.step()``.
        """
        t0 = time.perf_counter()
        self.wait()
        sync: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for name, p in self.providers:
            if p.async_ok:
                continue
            with torch.no_grad():
                for key, t in p.tensors().items():
                    sync[f"{name}/{key}"] = t.detach().clone()
            meta[name] = p.meta()
        lineage = dict(self.lineage)
        if timeline is not None:
            lineage["timeline"] = timeline
        self._idle.clear()
        self._jobs.put((step, sync, meta, lineage))
        self.last_capture_s = time.perf_counter() - t0

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._write(*job)
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e
            finally:
                self._idle.set()

    def _layout(self, tensors: dict[str, torch.Tensor]) -> tuple[list[TensorInfo], str]:
        key = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
        if key != self._layout_key:
            infos = plan(tensors)
            table = json.dumps([i.__dict__ for i in infos], separators=(",", ":"))
            self._layout_key, self._layout_val = key, (infos, table)
            self._views.clear()
        return self._layout_val

    @torch.no_grad()
    def _write(self, step: int, sync: dict[str, torch.Tensor], meta: dict[str, Any],
               lineage: dict[str, int] | None = None) -> None:
        if _TEST_DELAY:
            time.sleep(_TEST_DELAY)
        lazy: dict[str, torch.Tensor] = {}
        for name, p in self.providers:
            if p.async_ok:
                for key, t in p.tensors().items():
                    lazy[f"{name}/{key}"] = t
                meta[name] = p.meta()
        tensors = {**sync, **lazy}
        infos, table = self._layout(tensors)
        data_len = (infos[-1].offset + infos[-1].nbytes) if infos else 0
        head = json.dumps({"rank": self.rank, "step": step, "time": time.time(), "data_len": data_len,
                           **(lineage or {}), "meta": meta}, separators=(",", ":"))
        hb = (head[:-1] + ',"tensors":' + table + "}").encode()
        point = self.is_point(step)
        if point and not self._await_replication():
            log.warning("point %d of rank %d dropped: a new epoch began while point %d waited for "
                        "its replication", step, self.rank, self._last_point[0] if self._last_point else -2)
            return
        k = self._pick_slot(point)
        slot = self._slots[k]
        created = slot is None or not slot.fits(len(hb), data_len)
        if created:
            slot = self._new_slot(k, len(hb), data_len)
        self._seq += 1
        seq = self._seq
        self._steps[k] = -2
        if point:
            self._last_point = (step, seq)
        slot.set_ctrl(WRITING, step, seq, len(hb))
        slot.mm[CTRL_SIZE : CTRL_SIZE + len(hb)] = hb
        slot.set_copied(0)  # header in place: a streaming reader may start
        views = self._views.get(k)
        if views is None:
            views = self._views[k] = [slot.view(info) for info in infos]
        pairs = list(zip(views, tensors.values(), strict=True))
        on_gpu = self._launch_device_copies(slot, pairs)
        published = 0
        for i, ((dst, src), info) in enumerate(zip(pairs, infos, strict=True)):
            if src.is_cuda:
                on_gpu[i].synchronize()  # device -> pinned host copy on the side stream
            else:
                dst.copy_(src)
            end = info.offset + info.nbytes
            if end - published >= STREAM_CHUNK or i == len(pairs) - 1:
                slot.set_copied(end)
                published = end
        slot.set_ctrl(COMPLETE, step, seq, len(hb), data_len)
        self._steps[k], self._seqs[k] = step, seq
        if created:
            self._prepare_others(len(hb), data_len)

    def _new_slot(self, k: int, header_len: int, data_len: int) -> Slot:
        """Slot ``k`` for a layout it cannot hold: the prepared one if there is one (waiting
        if it is being prepared right now), else created here. Then prepares, in the
        background (once this write is complete: not competing with its copy), every other
        slot that cannot hold the layout either."""
        # under the lock throughout: the preparer must never see slot k as missing while it
        # is being replaced here (it would prepare k a second time)
        with self._prep_cond:
            while self._preparing == k:
                self._prep_cond.wait()
            ready = self._ready.pop(k, None)
            if ready is not None and not ready.fits(header_len, data_len):
                ready.close()
                ready = None
            old = self._slots[k]
            if old is not None:
                old.close()
            if ready is not None:
                ready.install()
                slot = ready
            else:
                slot = Slot(self.path(k), max(65536, 2 * header_len), data_len)
            self._slots[k] = slot
        self._views.pop(k, None)
        return slot

    def _prepare_others(self, header_len: int, data_len: int) -> None:
        with self._prep_cond:
            if (header_len, data_len) != self._prep_want:
                self._prep_failed.clear()  # a new layout: try every slot again
            self._prep_want = (header_len, data_len)
            if self._prep_running or not self._missing():
                return  # a running preparer re-reads what is missing before each slot
            self._prep_running = True
        self._prep_thread = threading.Thread(target=self._prepare_run, name=f"slot-prepare-rank{self.rank}",
                                             daemon=True)
        self._prep_thread.start()

    def _missing(self) -> list[int]:
        h, d = self._prep_want
        return [j for j, s in enumerate(self._slots)
                if not (s is not None and s.fits(h, d)) and j not in self._prep_failed
                and not (j in self._ready and self._ready[j].fits(h, d))]

    def _prepare_run(self) -> None:
        while True:
            with self._prep_cond:
                missing = [] if self._closing else self._missing()
                if not missing:
                    self._prep_running = False
                    return
                j, (h, d) = missing[0], self._prep_want
                self._preparing = j
            try:
                prepared: Slot | None = Slot(self.path(j), max(65536, 2 * h), d, staged=True)
            except OSError as e:  # /dev/shm full: the engine creates it when it needs it
                log.warning("could not prepare snapshot slot %s: %s", self.path(j).name, e)
                prepared = None
            with self._prep_cond:
                self._preparing = None
                if prepared is None:
                    self._prep_failed.add(j)
                else:
                    stale = self._ready.pop(j, None)
                    if stale is not None:
                        stale.close()
                    self._ready[j] = prepared
                self._prep_cond.notify_all()

    def _launch_device_copies(self, slot: Slot, jobs: list) -> dict[int, Any]:
        """GPU tensors: copy into the (pinned) slot on a side stream, ordered after the work
        already queued on the current stream. Returns {index in jobs: event recorded after
        that tensor's copy}, so the slot's ``copied`` mark (and a streaming reader) can
        follow the copies one by one. Written for the NCCL path; not yet run on a GPU."""
        cuda = [i for i, (_, s) in enumerate(jobs) if s.is_cuda]
        if not cuda:
            return {}
        base = slot.data.data_ptr()
        if base not in self._pinned:  # each mapping once (a new layout maps a new file)
            torch.cuda.cudart().cudaHostRegister(base, slot.data.numel(), 0)
            self._pinned.add(base)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.default_stream())
        events = {}
        with torch.cuda.stream(self._stream):
            for i in cuda:
                dst, src = jobs[i]
                dst.copy_(src, non_blocking=True)
                events[i] = torch.cuda.Event()
                events[i].record(self._stream)
        return events

    def wait(self) -> None:
        """Block until the snapshot in flight (if any) is complete."""
        if not self._idle.is_set():
            t0 = time.perf_counter()
            while not self._idle.wait(0.5):
                self._beat()  # still alive: waiting for replication or a big copy
            self.last_wait_s = time.perf_counter() - t0
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"snapshot failed: {e}") from e

    def _pick_slot(self, point: bool) -> int:
        # the oldest (or empty) slot of its kind; never the newest complete one
        ks = range(self.nring, len(self._slots)) if point else range(self.nring)
        return min(ks, key=lambda k: self._steps[k])

    # -- restore --------------------------------------------------------------------------
    def available(self) -> list[int]:
        self.wait()
        return sorted(s for s in self._steps if s >= -1)

    def invalidate_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (after a rollback they are another future)."""
        for k, s in enumerate(self._steps):
            if s > step and self._slots[k] is not None:
                self._slots[k].set_ctrl(EMPTY, -2, 0, 0)
                self._steps[k] = -2
        points = [(s, self._seqs[k]) for k, s in enumerate(self._steps) if k >= self.nring and s >= -1]
        self._last_point = max(points) if points else None

    def load_local(self, step: int, skip: set[str] = frozenset()) -> None:
        self.wait()
        k = self._steps.index(step)
        slot = self._slots[k]
        assert slot is not None
        state, _, _, hlen, _, _ = slot.ctrl()
        header = json.loads(bytes(slot.mm[CTRL_SIZE : CTRL_SIZE + hlen]))
        infos = [TensorInfo(**{**i, "shape": tuple(i["shape"])}) for i in header["tensors"]]
        restore(
            [(n, p) for n, p in self.providers if n not in skip],
            {i.name: slot.view(i) for i in infos},
            header["meta"],
        )

    def read(self, step: int) -> tuple[dict, bytes]:
        """Header and body of the complete local snapshot of ``step``, to send to a peer."""
        self.wait()
        got = read_slot(self.path(self._steps.index(step)))
        if got is None:
            raise RuntimeError(f"snapshot of step {step} (sid {self.rank}) is not readable")
        return got[0], bytes(got[1])

    def close(self) -> None:
        self.wait()
        self._jobs.put(None)
        with self._prep_cond:
            self._closing = True
        if self._prep_thread is not None:
            self._prep_thread.join()
        for s in [*self._slots, *self._ready.values()]:
            if s is not None:
                s.close()
        self._ready.clear()


def restore(providers: list[tuple[str, Any]], tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Load every provider from a flat ``component/key`` tensor map plus per-component meta."""
    for name, p in providers:
        if name not in meta:
            raise KeyError(f"snapshot has no component {name!r} (tracked: {[n for n, _ in providers]})")
        pre = f"{name}/"
        p.load({k[len(pre):]: t for k, t in tensors.items() if k.startswith(pre)}, meta[name])


def tensors_from_bytes(header: dict, data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensor views over a received snapshot body (copy before keeping them)."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    out = {}
    for i in header["tensors"]:
        raw = buf[i["offset"] : i["offset"] + i["nbytes"]]
        out[i["name"]] = raw.view(DTYPES[i["dtype"]]).view(tuple(i["shape"]))
    return out
