"""Snapshot slots in memory: a slot file mapped as a torch tensor, the tensor layout in it,
and the background preparation of slots before their first use.

The file format (control block, JSON header, raw bytes) is :mod:`hotspare.recovery.slotfile`'s, which
the agent reads without torch; this is the writer's side, used by
:class:`hotspare.recovery.snapshot.SnapshotEngine`.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import slotfile
from .slotfile import COPIED_OFFSET, CTRL_FORMAT, CTRL_SIZE, EMPTY, MAGIC

log = logging.getLogger(__name__)

#: snapshot dtype names -> torch dtypes (the names are the one table's, slotfile.DTYPES)
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in slotfile.DTYPES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_STAGE_IDS = itertools.count()  # slot files being created get names of their own
MIN_HEADER_CAP = 65536  # bytes kept for a slot's JSON header (twice the header, at least this)


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def header_cap(header_len: int) -> int:
    """Room for a header that may grow a little (metadata changes) without a new slot."""
    return max(MIN_HEADER_CAP, 2 * header_len)


def slot_size(header_len: int, data_len: int) -> int:
    """Bytes of a slot file made for this layout (control block, header room, data)."""
    return _align(CTRL_SIZE + header_cap(header_len), 4096) + max(data_len, 1)


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
            try:
                with open(src, "wb") as f:
                    f.truncate(self.size)
                    slotfile.reserve(f.fileno(), self.size)  # a full /dev/shm: ENOSPC now, not SIGBUS later
            except OSError:
                src.unlink(missing_ok=True)
                raise
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
        magic, state, step, seq, hlen, doff, dlen, _copied = struct.unpack_from(CTRL_FORMAT, self.mm, 0)
        return state, step, seq, hlen, doff, dlen

    def set_ctrl(self, state: int, step: int, seq: int, hlen: int, copied: int = -1) -> None:
        struct.pack_into(CTRL_FORMAT, self.mm, 0, MAGIC, state, step, seq, hlen, self.data_off,
                         self.size - self.data_off, copied)

    def set_copied(self, n: int) -> None:
        """Publish that the data area is filled up to ``n`` (streaming readers follow it)."""
        struct.pack_into("<q", self.mm, COPIED_OFFSET, n)

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


class SlotPreparer:
    """Creates slots for a new layout on a background thread, before their first use.

    The first write of a layout creates its own slot on the way (paying its page faults
    during the copy). Right after it, this creates every other slot that cannot hold the
    layout -- aside, with its pages faulted in -- and :meth:`take` puts a prepared one in
    place at its first write, so no later step pays page faults. The preparation runs after
    that first write, not during it: competing with its copy made the copy several times
    slower.

    ``slots`` is the engine's list of slots in use (index k -> Slot or None), read and
    replaced under this object's lock; ``path(k)`` names slot k's file.
    """

    def __init__(self, slots: list[Slot | None], path: Callable[[int], Path], name: str) -> None:
        self._slots = slots
        self._path = path
        self._name = name
        self.ready: dict[int, Slot] = {}  # k -> prepared, not yet in place
        self.thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._preparing: int | None = None
        self._running = False
        self._want = (0, 0)  # (header, data) bytes the prepared slots must hold
        self._failed: set[int] = set()
        self._closing = False

    def take(self, k: int, header_len: int, data_len: int) -> Slot:
        """Slot ``k`` for a layout it cannot hold: the prepared one if there is one (waiting
        if it is being prepared right now), else created here."""
        # under the lock throughout: the preparer must never see slot k as missing while it
        # is being replaced here (it would prepare k a second time)
        with self._cond:
            while self._preparing == k:
                self._cond.wait()
            ready = self.ready.pop(k, None)
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
                slot = Slot(self._path(k), header_cap(header_len), data_len)
            self._slots[k] = slot
        return slot

    def prepare_others(self, header_len: int, data_len: int) -> None:
        """Prepare, in the background, every slot that cannot hold this layout (called once
        the write that created a slot for it is complete)."""
        with self._cond:
            if (header_len, data_len) != self._want:
                self._failed.clear()  # a new layout: try every slot again
            self._want = (header_len, data_len)
            if self._running or not self._missing():
                return  # a running preparer re-reads what is missing before each slot
            self._running = True
        self.thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop preparing (after the slot in hand) and remove every prepared, unused slot."""
        with self._cond:
            self._closing = True
        if self.thread is not None:
            self.thread.join()
        for s in self.ready.values():
            s.close()
        self.ready.clear()

    def _missing(self) -> list[int]:
        h, d = self._want
        return [j for j, s in enumerate(self._slots)
                if not (s is not None and s.fits(h, d)) and j not in self._failed
                and not (j in self.ready and self.ready[j].fits(h, d))]

    def _run(self) -> None:
        while True:
            with self._cond:
                missing = [] if self._closing else self._missing()
                if not missing:
                    self._running = False
                    return
                j, (h, d) = missing[0], self._want
                self._preparing = j
            try:
                prepared: Slot | None = Slot(self._path(j), header_cap(h), d, staged=True)
            except OSError as e:  # /dev/shm full: the engine creates it when it needs it
                log.warning("could not prepare snapshot slot %s: %s", self._path(j).name, e)
                prepared = None
            with self._cond:
                self._preparing = None
                if prepared is None:
                    self._failed.add(j)
                else:
                    stale = self.ready.pop(j, None)
                    if stale is not None:
                        stale.close()
                    self.ready[j] = prepared
                self._cond.notify_all()
