"""The snapshot slot file format, readable without torch (agents serve these files).

    [0, 64)        control block: magic, state, step, seq, header_len, data_off, data_len
    [64, data_off) JSON header: tensor table (name, dtype, shape, offset, nbytes) + meta
    [data_off, )   raw tensor bytes, 64-byte aligned
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"HSSNAP01"
_CTRL = "<8sqqqqqq"  # magic, state, step, seq, header_len, data_off, data_len
CTRL_SIZE = 64
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

    def valid(self) -> bool:
        _, state, _, seq, *_ = struct.unpack_from(_CTRL, self.mm, 0)
        return state == COMPLETE and seq == self.seq

    def close(self) -> None:
        self.mm.close()


def open_slot(path: Path) -> SlotView | None:
    """Map a COMPLETE slot file (None if absent, not complete, or torn): zero-copy readers
    use it and check ``valid()`` after reading."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < CTRL_SIZE:
            return None
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    magic, state, _step, seq, hlen, doff, dlen = struct.unpack_from(_CTRL, mm, 0)
    if magic != MAGIC or state != COMPLETE or doff + dlen > size:
        mm.close()
        return None
    try:
        header = json.loads(bytes(mm[CTRL_SIZE : CTRL_SIZE + hlen]))
    except ValueError:
        mm.close()
        return None
    v = SlotView(path, mm, header, doff, dlen, seq)
    if not v.valid():
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


def slot_steps(path: Path) -> tuple[int, int] | None:
    """(state, step) of a slot file without mapping the data."""
    try:
        with open(path, "rb") as f:
            raw = f.read(struct.calcsize(_CTRL))
    except FileNotFoundError:
        return None
    if len(raw) < struct.calcsize(_CTRL):
        return None
    magic, state, step, *_ = struct.unpack(_CTRL, raw)
    return (state, step) if magic == MAGIC else None
