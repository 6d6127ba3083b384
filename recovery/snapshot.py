"""Lazy asynchronous snapshots into shared-memory slots (DataStates-style).

At the end of step ``s`` the engine captures small state (RNG, data position, buffers,
JSON) synchronously and starts copying parameters and optimizer state into a slot in a
background thread, while the next step's forward and backward run. Those tensors only
change inside ``optimizer.step()``, whose pre-hook waits for the copy if it is still
running — that is the only place training can ever wait.

Slots are files in the agent's shared-memory directory (``/dev/shm``): a worker that
crashes leaves its last complete snapshots behind for its agent to serve. A slot is

    [0, 64)        control block: magic, state, step, seq, header_len, data_off, data_len, copied
    [64, data_off) JSON header: tensor table (name, dtype, shape, offset, nbytes) + meta
    [data_off, )   raw tensor bytes, 64-byte aligned

``state`` is WRITING while a copy is in flight and COMPLETE after it; ``seq`` changes on
every write, so a reader (the agent's replicator) can detect a slot reused under it.
The newest complete slot is never the one a copy writes into. The format is
:mod:`hotspare.recovery.slotfile`'s; the mapped slots and their preparation are :mod:`hotspare.recovery.slots`.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .bell import AGENT_BELL, Bell, Ringer, confirm_bell
from .errors import Unrecoverable
from .shm_budget import no_room
from .slotfile import (
    COMPLETE,
    CTRL_SIZE,
    EMPTY,
    WRITING,
    SlotDir,
    open_slot,
    read_confirmation,
    read_slot,
)
from .slots import DTYPE_NAMES, DTYPES, Slot, SlotPreparer, TensorInfo, plan, slot_size

__all__ = ["SnapshotEngine", "Slot", "TensorInfo", "plan", "restore", "tensors_from_bytes",
           "DTYPES", "DTYPE_NAMES", "STREAM_CHUNK"]

log = logging.getLogger(__name__)

#: how often (bytes of the data area) the writer publishes its progress to streaming readers
STREAM_CHUNK = 8 << 20


class SnapshotEngine:
    """Snapshot files of one seat (its *sid*) under ``directory``: a ring of recent steps,
    plus the last two *replication points*.

    Every step is snapshotted into the ring (``rank<sid>.slot<k>``). Every
    ``replicate_every``-th step (and the initial state, step -1) goes to a point slot
    (``rank<sid>.point<k>``) instead; the agent ships only points to the buddies. All ranks
    use the same point steps, so a lost rank's replicated step is one every survivor still
    holds. Before writing a new point the engine waits until the agent has confirmed the
    previous one replicated (``rank<sid>.replicated``), so the two point slots always hold a
    replicated step. The wait is normally zero: a point is shipped in far less time than
    ``replicate_every`` steps take.

    ``test_delay`` holds every background copy open that many seconds, so that a test's
    failure reliably lands while a snapshot is in flight; never set in production.
    """

    #: asked (data and slot bytes, slots per rank) before the first slot of a layout bigger than any
    #: before is made: raises ShmTooSmall if the node lacks room for them (the session sets it)
    admit: Callable[[int, int, int], None] = staticmethod(lambda data_len, slot_bytes, slots: None)
    _admitted = -1  # the largest data length admitted

    def __init__(
        self,
        directory: Path,
        sid: int,
        slots: int = 2,
        replicate_every: int = 0,
        beat: Callable[[], object] = lambda: None,
        replication_timeout: float = 120.0,
        test_delay: float = 0.0,
    ) -> None:
        self.sid = int(sid)
        self.files = SlotDir(directory)
        self.dir = self.files.root
        self.dir.mkdir(parents=True, exist_ok=True)
        self.nring = max(2, slots)
        self.every = replicate_every
        n = self.nring + (2 if self.every else 0)
        self._slots: list[Slot | None] = [None] * n
        self._steps = [-2] * n  # complete step per slot (-2: none)
        self._seqs = [0] * n  # the write (seq) each slot's step came from
        # every write's seq is unique on this node, across engines too (a new worker of the
        # same sid writes the same step again): the agent confirms a point by (step, seq),
        # so a confirmation of the previous worker's copy never passes for ours
        self._seq = time.time_ns()
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._layout_key: tuple = ()
        self._layout_val: tuple[list[TensorInfo], str] = ([], "[]")
        self._views: dict[int, list[torch.Tensor]] = {}  # slot -> views for the layout
        self.providers: list[tuple[str, Any]] = []
        self.last_capture_s = self.last_wait_s = self.replication_wait_s = 0.0
        self._last_point: tuple[int, int] | None = None  # (step, seq) of the newest point
        self._stream: Any = None
        self._ready: Any = None  # CUDA event recorded on the training stream at capture()
        self._pinned: set[int] = set()  # base addresses registered with CUDA
        self._preparer = SlotPreparer(self._slots, self.path, name=f"slot-prepare-rank{self.sid}")
        self._beat = beat
        self.replication_timeout = replication_timeout
        self.test_delay = test_delay
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
        # a marker left by an earlier worker of this sid on this node says nothing about us
        self.files.confirmation(self.sid).unlink(missing_ok=True)
        # the agent's doorbell, rung when a point starts and completes (its replicator and
        # persister wait on it), and ours, which it rings when it confirms a point
        self._agent_bell = Ringer(self.dir / AGENT_BELL)
        self._confirm_bell = Bell(self.dir / confirm_bell(self.sid)) if self.every else None
        self._thread = threading.Thread(target=self._run, name=f"snapshot-rank{self.sid}", daemon=True)
        self._thread.start()

    @property
    def rank(self) -> int:
        """Deprecated name of :attr:`sid` (the files are named by sid, not by the current rank)."""
        return self.sid

    def path(self, k: int) -> Path:
        if k < self.nring:
            return self.files.slot(self.sid, k)
        return self.files.point(self.sid, k - self.nring)

    def is_candidate(self, step: int) -> bool:
        """Whether ``step`` is a point *candidate*: the initial state, or a multiple of
        ``replicate_every``. Which candidates become points the ranks agree on
        (``capture(point=...)``: the session's vote, paced by ``replicate_interval``); a
        state restored at a candidate step is kept as a point (every rank restores the
        same step, so they agree on that too)."""
        return bool(self.every) and (step == -1 or step % self.every == 0)

    def requested_point(self) -> int | None:
        """The step ``hotspare checkpoint`` asked to be persisted, as this node's agent last
        wrote it into the snapshot directory (None: no request)."""
        try:
            return int(self.files.checkpoint_request.read_text())
        except (OSError, ValueError):
            return None

    def confirmed(self) -> tuple[int, int]:
        """(step, seq) of the newest point the agent confirmed replicated to every buddy
        ((-2, 0): none)."""
        return read_confirmation(self.files.confirmation(self.sid))

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
                                prev[0], self.sid, self.replication_timeout)
                    break
                if self._confirm_bell is not None:
                    self._confirm_bell.wait(0.5)  # rung by the agent; the timeout re-checks the epoch
                else:
                    time.sleep(0.005)
            return True
        finally:
            self.replication_wait_s += time.monotonic() - t0

    # -- capture --------------------------------------------------------------------------
    def capture(self, step: int, timeline: int | None = None, point: bool | None = None) -> None:
        """Snapshot the providers as of the end of ``step``.

        ``timeline`` overrides the lineage's for a state restored from elsewhere (a replica,
        a peer): it keeps the timeline of the state it copies. ``point``: whether the step
        goes to a point slot (the ranks' agreement on a candidate); None: every candidate.

        On the training thread only the small, step-mutable state is taken (RNG, data
        position, buffers, JSON; cloned) and references to the parameters and optimizer
        state (providers cache them: a walk only when the set of tensors changed). Everything
        else — the layout, the header, waiting for the previous replication point, the big
        copy — happens on the engine's own thread, before the next ``optimizer.step()``.
        """
        t0 = time.perf_counter()
        self.wait()
        sync: dict[str, torch.Tensor] = {}
        lazy: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for name, p in self.providers:
            if p.async_ok:
                # references only, taken here and copied later: FSDP2 swaps a module's
                # registered parameters for unsharded ones (their storage freed after the
                # forward) while the next step runs, so a walk of the module from the engine's
                # thread could copy a tensor whose memory is being freed (a SIGSEGV seen in the
                # FSDP runs) or the wrong tensors
                for key, t in p.tensors().items():
                    lazy[f"{name}/{key}"] = t
                continue
            with torch.no_grad():
                for key, t in p.tensors().items():
                    sync[f"{name}/{key}"] = t.detach().clone()
            meta[name] = p.meta()
        lineage = dict(self.lineage)
        if timeline is not None:
            lineage["timeline"] = timeline
        self._ready = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the training thread's stream, now: the background copy of parameters and
            # optimizer state is ordered after the step that produced them, and only that
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream())
        self._idle.clear()
        point = self.is_candidate(step) if point is None else point and self.is_candidate(step)
        self._jobs.put((step, sync, lazy, meta, lineage, point))
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
    def _write(self, step: int, sync: dict[str, torch.Tensor], lazy: dict[str, torch.Tensor],
               meta: dict[str, Any], lineage: dict[str, int] | None = None, point: bool = False) -> None:
        if self.test_delay:
            time.sleep(self.test_delay)
        for name, p in self.providers:
            if p.async_ok:
                meta[name] = p.meta()
        tensors = {**sync, **lazy}
        infos, table = self._layout(tensors)
        data_len = (infos[-1].offset + infos[-1].nbytes) if infos else 0
        head = json.dumps({"rank": self.sid, "step": step, "time": time.time(), "data_len": data_len,
                           **(lineage or {}), "meta": meta}, separators=(",", ":"))
        hb = (head[:-1] + ',"tensors":' + table + "}").encode()
        if point and not self._await_replication():
            log.warning("point %d of rank %d dropped: a new epoch began while point %d waited for "
                        "its replication", step, self.sid, self._last_point[0] if self._last_point else -2)
            return
        k = self._pick_slot(point)
        slot, created = self._slot_for(k, len(hb), data_len)
        self._seq += 1
        seq = self._seq
        self._steps[k] = -2
        if point:
            self._last_point = (step, seq)
        slot.set_ctrl(WRITING, step, seq, len(hb))
        slot.mm[CTRL_SIZE : CTRL_SIZE + len(hb)] = hb
        slot.set_copied(0)  # header in place: a streaming reader may start
        if point:
            self._agent_bell.ring()  # the persister may stream it as the copy goes on
        views = self._views.get(k)
        if views is None:
            views = self._views[k] = [slot.view(info) for info in infos]
        pairs = list(zip(views, tensors.values(), strict=True))
        self._fill(tensors, pairs)
        on_gpu = self._launch_device_copies(slot, pairs)
        published = 0
        for i, ((dst, src), info) in enumerate(zip(pairs, infos, strict=True)):
            if src.is_meta:
                pass  # filled by its provider (above)
            elif src.is_cuda:
                on_gpu[i].synchronize()  # device -> pinned host copy on the side stream
            else:
                dst.copy_(src)
            end = info.offset + info.nbytes
            if end - published >= STREAM_CHUNK or i == len(pairs) - 1:
                slot.set_copied(end)
                published = end
        slot.set_ctrl(COMPLETE, step, seq, len(hb), data_len)
        self._steps[k], self._seqs[k] = step, seq
        if point:
            self._agent_bell.ring()  # the replicator pushes it now
        if created:
            # then the other slots, once this copy is done: not competing with it
            self._preparer.prepare_others(len(hb), data_len)

    def _fill(self, tensors: dict[str, torch.Tensor], pairs: list) -> None:
        """Placeholders on the ``meta`` device: their provider writes the bytes itself
        (``fill({key: destination})``), e.g. an offloaded optimizer reading its files."""
        wanted: dict[str, dict[str, torch.Tensor]] = {}
        for name, (dst, src) in zip(tensors, pairs, strict=True):
            if src.is_meta:
                comp, key = name.split("/", 1)
                wanted.setdefault(comp, {})[key] = dst
        if wanted:
            by_name = dict(self.providers)
            for comp, dsts in wanted.items():
                by_name[comp].fill(dsts)

    def _slot_for(self, k: int, header_len: int, data_len: int) -> tuple[Slot, bool]:
        """Slot ``k`` (and whether it was made anew: it could not hold this layout). A layout bigger
        than any before is checked first (:attr:`admit`); a full filesystem is a ShmTooSmall."""
        slot = self._slots[k]
        if slot is not None and slot.fits(header_len, data_len):
            return slot, False
        if data_len > self._admitted:
            self.admit(data_len, slot_size(header_len, data_len), len(self._slots))
            self._admitted = data_len
        try:
            slot = self._preparer.take(k, header_len, data_len)
        except OSError as e:
            full = no_room(self.dir, slot_size(header_len, data_len), f"a snapshot slot of sid {self.sid}", e)
            if full is None:
                raise
            raise full from e
        self._views.pop(k, None)
        return slot, True

    def _launch_device_copies(self, slot: Slot, jobs: list) -> dict[int, Any]:
        """GPU tensors: copy into the (pinned) slot on a side stream, ordered after the work
        already queued on the current stream. Returns {index in jobs: event recorded after
        that tensor's copy}, so the slot's ``copied`` mark (and a streaming reader) can
        follow the copies one by one. Written for the NCCL path; not yet run on a GPU (one
        device per rank assumed: the side stream is on the first GPU tensor's device)."""
        cuda = [i for i, (_, s) in enumerate(jobs) if s.is_cuda]
        if not cuda:
            return {}
        base = slot.data.data_ptr()
        if base not in self._pinned:  # each mapping once (a new layout maps a new file)
            torch.cuda.cudart().cudaHostRegister(base, slot.data.numel(), 0)
            self._pinned.add(base)
        device = jobs[cuda[0]][1].device
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)  # the tensors' device, not device 0
        if self._ready is not None:
            self._stream.wait_event(self._ready)
        else:
            self._stream.wait_stream(torch.cuda.default_stream(device))
        events = {}
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
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
            if isinstance(e, Unrecoverable):  # no room for the snapshots: the job ends with its sentence
                raise e
            raise RuntimeError(f"snapshot failed: {e}") from e

    def _pick_slot(self, point: bool) -> int:
        # the oldest (or empty) slot of its kind; never the newest complete one
        ks = range(self.nring, len(self._slots)) if point else range(self.nring)
        return min(ks, key=lambda k: self._steps[k])

    # -- restore --------------------------------------------------------------------------
    def available(self) -> list[int]:
        self.wait()
        return sorted(s for s in self._steps if s >= -1)

    def timeline_of(self, step: int) -> int | None:
        """The timeline written into this engine's complete snapshot of ``step`` (None: no
        such snapshot, or its header says none)."""
        self.wait()
        if step not in self._steps:
            return None
        view = open_slot(self.path(self._steps.index(step)))
        if view is None:
            return None
        try:
            tl = view.header.get("timeline")
            return tl if isinstance(tl, int) and view.valid() else None
        finally:
            view.close()

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
            raise RuntimeError(f"snapshot of step {step} (sid {self.sid}) is not readable")
        return got[0], bytes(got[1])

    def close(self) -> None:
        self.wait()
        self._jobs.put(None)
        self._preparer.close()
        self._agent_bell.close()
        if self._confirm_bell is not None:
            self._confirm_bell.close()
        for s in self._slots:
            if s is not None:
                s.close()


def restore(providers: list[tuple[str, Any]], tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Load every provider from a flat ``component/key`` tensor map plus per-component meta."""
    for name, p in providers:
        if name not in meta:
            raise KeyError(f"snapshot has no component {name!r} (tracked: {[n for n, _ in providers]})")
        pre = f"{name}/"
        p.load({k[len(pre):]: t for k, t in tensors.items() if k.startswith(pre)}, meta[name])


def tensors_from_bytes(header: dict, data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensor views over a received snapshot body (copy before keeping them): over the body
    itself when it is writable (a ``bytearray``, a slot), over a copy of read-only ``bytes``."""
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    buf = torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8) if len(data) else \
        torch.empty(0, dtype=torch.uint8)
    out = {}
    for i in header["tensors"]:
        raw = buf[i["offset"] : i["offset"] + i["nbytes"]]
        out[i["name"]] = raw.view(DTYPES[i["dtype"]]).view(tuple(i["shape"]))
    return out
