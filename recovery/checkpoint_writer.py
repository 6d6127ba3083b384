"""Writing one rank's file of a persisted checkpoint, in the node agent (torch-free).

:func:`write_rank` streams a snapshot slot from ``/dev/shm`` -- starting while the training
process is still copying it there, following the slot's ``copied`` mark -- with gathered
``writev`` calls (many small tensors, few large writes), computing a CRC32 on the way. The
file counts only if the slot then turned COMPLETE with the same sequence number. It goes
to a local directory first (``persist_local_dir``, fast local SSD) and then to the shared
path; its record (``rank<r>.json``) is written once the file is durable. The format is
described in :mod:`hotspare.recovery.persist`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from .checkpoint_store import rank_file, rank_record, step_dir, step_name, tier_for
from .slotfile import DTYPES, SlotView

#: snapshot dtype names -> safetensors dtype codes
ST_DTYPES: dict[str, str] = {name: d.safetensors for name, d in DTYPES.items()}
_IOV_MAX = 512
STALL_S = 60.0  # a slot being filled that makes no progress this long is given up on


def _st_header(tensors: list[dict], meta: dict) -> tuple[bytes, list[tuple[int, int]]]:
    """safetensors header for the tensors laid end to end (no holes), and each one's
    (offset, nbytes) in the slot's data area."""
    head: dict = {"__metadata__": meta}
    pos, spans = 0, []
    for t in tensors:
        head[t["name"]] = {"dtype": ST_DTYPES[t["dtype"]], "shape": list(t["shape"]),
                           "data_offsets": [pos, pos + t["nbytes"]]}
        pos += t["nbytes"]
        spans.append((t["offset"], t["nbytes"]))
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, spans


def _write_all(fd: int, bufs: list) -> None:
    while bufs:
        n = os.writev(fd, bufs[:_IOV_MAX])
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0


def _overwritten(view: SlotView, step: int) -> InterruptedError:
    return InterruptedError(f"snapshot slot {view.path} was overwritten while persisting step {step}")


def _stream(fd: int, view: SlotView, head: bytes, spans: list[tuple[int, int]], step: int) -> int:
    """Write the header, then each tensor's bytes as soon as the snapshot writer has copied
    them into the slot (its ``copied`` mark), gathered into few large ``writev`` calls.
    Returns the CRC32 of everything written."""
    data = memoryview(view.mm)[view.data_off:]
    crc, bufs, i = zlib.crc32(head), [head], 0
    idle_since, pause = time.monotonic(), 0.0005
    try:
        while True:
            copied = view.copied()
            if copied < 0:
                raise _overwritten(view, step)
            while i < len(spans) and spans[i][0] + spans[i][1] <= copied:
                off, n = spans[i]
                piece = data[off: off + n]
                crc = zlib.crc32(piece, crc)
                bufs.append(piece)
                i += 1
            if bufs:
                _write_all(fd, bufs)
                idle_since, pause = time.monotonic(), 0.0005
            if i == len(spans):
                return crc
            if time.monotonic() - idle_since > STALL_S or view.replaced():
                raise InterruptedError(f"snapshot slot {view.path} stopped filling while persisting step {step}")
            time.sleep(pause)  # the writer is still copying: follow it
            pause = min(2 * pause, 0.01)
    finally:
        bufs.clear()
        piece = None  # noqa: F841 - release the mmap exports before the view is closed
        data.release()


def _await_complete(view: SlotView, step: int) -> None:
    """Everything streamed must also have been the finished snapshot: COMPLETE, same seq."""
    deadline = time.monotonic() + STALL_S
    while not view.valid():
        if view.copied() < 0 or time.monotonic() > deadline or view.replaced():
            raise _overwritten(view, step)
        time.sleep(0.001)


def _write_file(view: SlotView, path: Path, head: bytes, spans: list[tuple[int, int]], step: int) -> int:
    """Stream the slot into ``path`` (a temporary name until the slot proved COMPLETE and
    the bytes are durable). Returns the file's CRC32; leaves nothing behind on failure."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a leftover (or a planted link: unlink does not follow it)
        # O_EXCL | O_NOFOLLOW: never write through a link someone put at the temporary name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            crc = _stream(fd, view, head, spans, step)
            os.fsync(fd)
        finally:
            os.close(fd)
        _await_complete(view, step)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return crc


def write_rank(view: SlotView, root: str | Path, *, rank: int, job: str, timeline: int,
               world_size: int, local_dir: str | Path | None = None, run_id: str = "") -> dict:
    """Stream one rank's snapshot slot into ``root`` (via ``local_dir`` first, if given).

    ``timeline`` (the epoch whose restore the state descends from) and ``world_size`` go
    into the rank record: :func:`hotspare.recovery.persist.try_finish` joins only records of one
    timeline and size. ``run_id`` keeps the staging directory of one run apart from another's.

    Returns the rank record (also written as ``rank<r>.json``). Raises OSError (ENOSPC, ...)
    after removing its temporary files; nothing of an earlier checkpoint is touched.
    """
    h = view.header
    step = int(h["step"])
    meta = {"hotspare.meta": json.dumps(h["meta"], separators=(",", ":")), "hotspare.rank": str(rank),
            "hotspare.step": str(step), "hotspare.job": job, "hotspare.run_id": run_id}
    head, spans = _st_header(h["tensors"], meta)
    tier = tier_for(root)
    private = None
    if not tier.local and not local_dir:  # an object store: stage on local disk first, in a
        # directory of our own (0700): a shared, predictable /tmp path could be pre-created
        # by another local user with links in it (security review F5)
        local_dir = private = tempfile.mkdtemp(prefix="hotspare-persist-")
    try:
        return _write_and_upload(view, tier, root, local_dir, job=job, run_id=run_id, rank=rank, step=step,
                                 head=head, spans=spans, timeline=timeline, world_size=world_size)
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def _write_and_upload(view: SlotView, tier: Any, root: str | Path, local_dir: str | Path | None, *, job: str,
                      run_id: str, rank: int, step: int, head: bytes, spans: list[tuple[int, int]],
                      timeline: int, world_size: int) -> dict:
    d = step_dir(Path(local_dir) / job / run_id if local_dir else Path(root), step)
    d.mkdir(parents=True, exist_ok=True)
    name = rank_file(rank)
    t0 = time.perf_counter()
    crc = _write_file(view, d / name, head, spans, step)
    rec = {"rank": rank, "step": step, "timeline": timeline, "world_size": world_size, "file": name,
           "bytes": len(head) + sum(n for _, n in spans), "crc32": crc,
           "write_s": round(time.perf_counter() - t0, 4)}
    if local_dir:  # local SSD -> shared path
        try:
            tier.put(d / name, step_name(step), name)
        finally:
            (d / name).unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:
                pass
    else:
        tier.sync(step_name(step))
    tier.write_json(rec, step_name(step), rank_record(rank))
    return rec


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
