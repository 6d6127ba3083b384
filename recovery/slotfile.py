"""The snapshot slot file format, readable without torch (agents serve these files).

    [0, 64)        control block: magic, state, step, seq, header_len, data_off, data_len, copied
    [64, data_off) JSON header: tensor table (name, dtype, shape, offset, nbytes) + meta
    [data_off, )   raw tensor bytes, 64-byte aligned

``copied`` is how far the writer has filled the data area, from its start, while the slot is
WRITING: -1 until the header is written, then the end of the last tensor copied (tensors are
laid out and copied in offset order). A streaming reader (the persister) writes those bytes
out while the rest is still being copied; it must still see the slot COMPLETE, with the same
``seq``, at the end.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from hotspare.orchestrator.util import atomic_write

MAGIC = b"HSSNAP01"
CTRL_FORMAT = "<8sqqqqqqq"  # magic, state, step, seq, header_len, data_off, data_len, copied
CTRL_SIZE = 64
COPIED_OFFSET = 56  # where ``copied`` sits in the control block (the writer, hotspare.recovery.slots, sets it)
EMPTY, WRITING, COMPLETE = 0, 1, 2
#: replicas an agent keeps per sid it holds for a buddy (the newest; one more while the next arrives)
REPLICAS_KEPT = 3


@dataclass(frozen=True)
class DType:
    """One element type a snapshot may hold: its size and its safetensors code. The torch
    dtype of the same name is ``getattr(torch, name)`` (see :mod:`hotspare.recovery.slots`)."""

    name: str
    itemsize: int
    safetensors: str


#: The one dtype table: snapshot headers, the wire's checks and the persisted format use it.
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", 4, "F32"), DType("float64", 8, "F64"), DType("float16", 2, "F16"),
    DType("bfloat16", 2, "BF16"), DType("int64", 8, "I64"), DType("int32", 4, "I32"),
    DType("int16", 2, "I16"), DType("int8", 1, "I8"), DType("uint8", 1, "U8"),
    DType("bool", 1, "BOOL"),
)}


class SlotDir:
    """The names of the files in an agent's run directory (``/dev/shm/hotspare-...``), in
    one place. Every name carries a *sid* (the seat's state id, see
    :class:`hotspare.orchestrator.store.Seat`), not a rank: a shrink renumbers ranks, never sids.

    * ``rank<sid>.slot<k>``   ring slot k (the newest steps)
    * ``rank<sid>.point<k>``  replication point slot k
    * ``rank<sid>.replicated`` the agent's confirmation of one point write, ``"<step> <seq>"``
    * ``<heartbeat>.fatal``   why a worker cannot go on (:func:`hotspare.agents.worker_link.fatal_path`)
    * ``checkpoint.request``  the step ``hotspare checkpoint`` asked for, as the agent last saw it

    (The ``rank`` spelling predates sids and stays: the files are read across versions.)"""

    SLOT_RE = re.compile(r"^rank(\d+)\.(slot|point)(\d+)\Z")

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def slot(self, sid: int, k: int) -> Path:
        return self.root / f"rank{sid}.slot{k}"

    def point(self, sid: int, k: int) -> Path:
        return self.root / f"rank{sid}.point{k}"

    def points(self, sid: int, n: int = 2) -> list[Path]:
        return [self.point(sid, k) for k in range(n)]

    def confirmation(self, sid: int) -> Path:
        return self.root / f"rank{sid}.replicated"

    @property
    def checkpoint_request(self) -> Path:
        return self.root / "checkpoint.request"

    def files(self, sid: int) -> list[Path]:
        """Every slot file of ``sid`` (ring and point), sorted by name."""
        return sorted(p for p in self.root.glob(f"rank{sid}.*") if self.SLOT_RE.match(p.name))

    @classmethod
    def parse(cls, name: str) -> tuple[int, str, int] | None:
        """(sid, "slot"|"point", k) for a slot file's name, else None."""
        m = cls.SLOT_RE.match(name)
        return (int(m[1]), m[2], int(m[3])) if m else None

    def sids(self) -> set[int]:
        """The sids that have slot files here."""
        return {parsed[0] for p in self.root.iterdir() if (parsed := self.parse(p.name))}


@dataclass
class SlotView:
    """A COMPLETE slot file mapped read-only; ``valid()`` says it was not overwritten since."""

    path: Path
    mm: mmap.mmap
    header: dict
    data_off: int
    data_len: int
    seq: int
    ino: int = 0

    def valid(self) -> bool:
        _, state, _, seq, *_ = struct.unpack_from(CTRL_FORMAT, self.mm, 0)
        return state == COMPLETE and seq == self.seq

    def copied(self) -> int:
        """Bytes of the data area filled so far; -1 once the slot is reused (or torn).
        All of it once COMPLETE."""
        _, state, _, seq, _, _, dlen, copied = struct.unpack_from(CTRL_FORMAT, self.mm, 0)
        if seq != self.seq or state not in (WRITING, COMPLETE):
            return -1
        return dlen if state == COMPLETE else copied

    def replaced(self) -> bool:
        """The writer swapped a new file in under this path (a bigger layout)."""
        try:
            return os.stat(self.path).st_ino != self.ino
        except OSError:
            return True

    def close(self) -> None:
        self.mm.close()


def open_slot(path: Path, writing: bool = False) -> SlotView | None:
    """Map a COMPLETE slot file (None if absent, not complete, or torn): zero-copy readers
    use it and check ``valid()`` after reading. ``writing``: also a slot still being
    filled once its header is written (streaming readers follow ``copied()``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size < CTRL_SIZE:
            return None
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    magic, state, _step, seq, hlen, doff, dlen, copied = struct.unpack_from(CTRL_FORMAT, mm, 0)
    ok = state == COMPLETE or (writing and state == WRITING and copied >= 0)
    if magic != MAGIC or not ok or doff + dlen > st.st_size:
        mm.close()
        return None
    try:
        header = json.loads(bytes(mm[CTRL_SIZE : CTRL_SIZE + hlen]))
    except ValueError:
        mm.close()
        return None
    v = SlotView(path, mm, header, doff, dlen, seq, st.st_ino)
    if v.copied() < 0 or not (writing or v.valid()):  # reused while we read the header
        v.close()
        return None
    return v


def reserve(fd: int, size: int) -> None:
    """Allocate the file's ``size`` bytes now: a full filesystem then says ENOSPC here, instead
    of a ``SIGBUS`` when a page of a mapped, sparse tmpfs file is first written (or an ENOSPC
    halfway through a write). A filesystem that cannot preallocate is left as it is."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def read_slot(path: Path) -> tuple[dict, bytes | memoryview, int] | None:
    """(header, data bytes, seq) of a COMPLETE slot file, consistent, or None."""
    v = open_slot(path)
    if v is None:
        return None
    try:
        used = v.header.get("data_len", v.data_len)
        data = bytes(v.mm[v.data_off : v.data_off + used])
        if not v.valid():
            return None  # overwritten while we read
        return v.header, data, v.seq
    finally:
        v.close()


def slot_ctrl(path: Path) -> tuple[int, int, int] | None:
    """(state, step, seq) of a slot file without mapping the data."""
    try:
        with open(path, "rb") as f:
            raw = f.read(struct.calcsize(CTRL_FORMAT))
    except FileNotFoundError:
        return None
    if len(raw) < struct.calcsize(CTRL_FORMAT):
        return None
    magic, state, step, seq, *_ = struct.unpack(CTRL_FORMAT, raw)
    return (state, step, seq) if magic == MAGIC else None


def slot_steps(path: Path) -> tuple[int, int] | None:
    """(state, step) of a slot file without mapping the data."""
    c = slot_ctrl(path)
    return None if c is None else (c[0], c[1])


# -- replication confirmations -------------------------------------------------------------
# ``rank<r>.replicated`` holds "<step> <seq>": the agent confirms one *write* of a point (a
# new worker of the same rank writes the same step again, with another seq), never a step.

def write_confirmation(path: Path, step: int, seq: int) -> None:
    atomic_write(path, f"{step} {seq}", fsync=False)  # shared memory: nothing to make durable


def read_confirmation(path: Path) -> tuple[int, int]:
    """(step, seq) confirmed; (-2, 0) if none (or unreadable)."""
    try:
        step, seq = path.read_text().split()
        return int(step), int(seq)
    except (FileNotFoundError, ValueError):
        return -2, 0
