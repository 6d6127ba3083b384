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
from pathlib import Path

MAGIC = b"HSSNAP01"
_CTRL = "<8sqqqqqq"  # magic, state, step, seq, header_len, data_off, data_len
CTRL_SIZE = 64
EMPTY, WRITING, COMPLETE = 0, 1, 2


def read_slot(path: Path) -> tuple[dict, bytes | memoryview, int] | None:
    """(header, data bytes, seq) of a COMPLETE slot file, consistent, or None."""
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
    try:
        magic, state, step, seq, hlen, doff, dlen = struct.unpack_from(_CTRL, mm, 0)
        if magic != MAGIC or state != COMPLETE or doff + dlen > size:
            return None
        header = json.loads(bytes(mm[CTRL_SIZE : CTRL_SIZE + hlen]))
        used = header.get("data_len", dlen)
        data = bytes(mm[doff : doff + used])
        if struct.unpack_from(_CTRL, mm, 0)[3] != seq or struct.unpack_from(_CTRL, mm, 0)[1] != COMPLETE:
            return None  # overwritten while we read
        return header, data, seq
    finally:
        mm.close()


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
