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

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"HSSNAP01"
_CTRL = "<8sqqqqqqq"  # magic, state, step, seq, header_len, data_off, data_len, copied
CTRL_SIZE = 64
_COPIED_OFF = 56  # where ``copied`` sits in the control block
EMPTY, WRITING, COMPLETE = 0, 1, 2


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
        _, state, _, seq, *_ = struct.unpack_from(_CTRL, self.mm, 0)
        return state == COMPLETE and seq == self.seq

    def copied(self) -> int:
        """Bytes of the data area filled so far; -1 once the slot is reused (or torn).
        All of it once COMPLETE."""
        _, state, _, seq, _, _, dlen, copied = struct.unpack_from(_CTRL, self.mm, 0)
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
    magic, state, _step, seq, hlen, doff, dlen, copied = struct.unpack_from(_CTRL, mm, 0)
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
            raw = f.read(struct.calcsize(_CTRL))
    except FileNotFoundError:
        return None
    if len(raw) < struct.calcsize(_CTRL):
        return None
    magic, state, step, seq, *_ = struct.unpack(_CTRL, raw)
    return (state, step, seq) if magic == MAGIC else None


def slot_steps(path: Path) -> tuple[int, int] | None:
    """(state, step) of a slot file without mapping the data."""
    c = slot_ctrl(path)
    return None if c is None else (c[0], c[1])


# -- replication confirmations -------------------------------------------------------------
# ``rank<r>.replicated`` holds "<step> <seq>": the agent confirms one *write* of a point (a
# new worker of the same rank writes the same step again, with another seq), never a step.

def write_confirmation(path: Path, step: int, seq: int) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    tmp.write_text(f"{step} {seq}")
    os.replace(tmp, path)


def read_confirmation(path: Path) -> tuple[int, int]:
    """(step, seq) confirmed; (-2, 0) if none (or unreadable)."""
    try:
        step, seq = path.read_text().split()
        return int(step), int(seq)
    except (FileNotFoundError, ValueError):
        return -2, 0
