"""Asynchronous file I/O for :mod:`hotspare.recovery.offload`: aligned buffers, the layer-file
format, and a small thread pool doing ``os.preadv``/``os.pwritev`` (off the GIL) with O_DIRECT.

Backend choice (measured on this repository's CI-class VM: ext4 on a virtio disk, 2 cores,
1 GiB transfers, O_DIRECT, 4 MiB requests): ``os.preadv``/``os.pwritev`` on a thread pool reached
~1.5 GB/s reads and ~2.3-2.6 GB/s writes with 2-4 threads (1 thread: ~0.8-1.3 read, ~1.3-2.0
write); ``caio`` 0.12.10 (installable from PyPI here) reached 0.37 (linux_aio) to 0.83
(thread_aio) GB/s buffered, and its API takes ``bytes`` to write and returns new ``bytes`` from a
read, so it cannot do I/O into our own aligned buffers (no O_DIRECT, one extra copy each way).
Hence: a thread pool (default 4 threads) and O_DIRECT, falling back to buffered I/O where the file
system refuses O_DIRECT (tmpfs): ``IOBackend.direct`` says which one is in use.

O_DIRECT bypasses the page cache, so what is measured is the disk, and offloaded state never
turns into page-cache memory. It needs page-aligned buffers, offsets and lengths: buffers are
anonymous ``mmap``\\ s, and every region of a layer file is a multiple of :data:`ALIGN`.

A layer file (one per layer and version ``a``/``b``) is laid out exactly like its RAM buffer::

    [0, header_len)          header: MAGIC, u32 length, JSON {layer, gen, data_len, chunk,
                             crcs: checksum per chunk of the data, sum: its algorithm
                             (CHECKSUM), steps: per-parameter step}
    [header_len, +data_len)  the state tensors, packed, zero-padded to ALIGN

The data is written first (chunks in parallel, each chunk's checksum computed by the thread that
writes it) and the header last, so a header describes data that was completely written.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _get_scalar_dtype

log = logging.getLogger(__name__)

#: the checksum of every chunk, named in each file's header ("sum"; files without one: "crc32").
#: CRC-32C (the ``crc32c`` package: SSE4.2/ARMv8 instructions, the GIL released) checks 9.1 GB/s
#: here against zlib's CRC-32's 2.3 GB/s: at 0.54 GB moved per step that was 0.24 CPU seconds a
#: step on a 2-core machine, which the training's own threads needed
SUMS: dict[str, Callable[..., int]] = {"crc32": zlib.crc32}
try:
    from crc32c import crc32c as _crc32c

    SUMS["crc32c"] = _crc32c
    CHECKSUM = "crc32c"
except ImportError:  # pragma: no cover - a dependency; zlib's CRC-32 still checks every chunk
    CHECKSUM = "crc32"


def checksum_fn(name: str, path: str) -> Callable[..., int]:
    """The function of a header's ``sum``."""
    try:
        return SUMS[name]
    except KeyError:
        raise OffloadError(f"{path} was checked with {name!r}, which this installation lacks: "
                           f"pip install {name}") from None

ALIGN = 4096
MAGIC = b"HSOFFST1"
CHUNK = 4 << 20


class OffloadError(RuntimeError):
    """Offloaded optimizer state could not be read or written (disk full, a corrupt or
    truncated file, ...). The message names the file and what to do; the previous good version
    of the state is never destroyed by the failure."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Buffer:
    """A page-aligned anonymous mmap (usable for O_DIRECT) with tensor views into it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align(max(nbytes, ALIGN))
        self.mm = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self.mm)

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=offset)

    def zero(self, start: int, end: int) -> None:
        torch.frombuffer(self.mm, dtype=torch.uint8, count=end - start, offset=start).zero_()


PREFIX = len(MAGIC) + 8  # MAGIC, u32 header length, u32 JSON length


def pack_header(meta: dict[str, Any], size: int) -> bytes:
    body = json.dumps(meta, separators=(",", ":")).encode()
    if PREFIX + len(body) > size:
        raise ValueError(f"offload header of {len(body)} bytes does not fit in {size}")
    raw = MAGIC + struct.pack("<II", size, len(body)) + body
    return raw + bytes(size - len(raw))


def header_len(raw: bytes | memoryview, path: str) -> int:
    """The header length a file's first block declares (checking the magic)."""
    if len(raw) < PREFIX or bytes(raw[: len(MAGIC)]) != MAGIC:
        raise OffloadError(f"{path} is not an offloaded optimizer state file (bad magic: corrupt or "
                           "overwritten); restore the optimizer from a snapshot or checkpoint")
    size, _ = struct.unpack("<II", bytes(raw[len(MAGIC): PREFIX]))
    if size % ALIGN or size <= 0 or size > 1 << 30:
        raise OffloadError(f"{path}: its header is corrupt (length {size}); restore the optimizer "
                           "from a snapshot or checkpoint")
    return size


def unpack_header(raw: bytes | memoryview, path: str) -> dict[str, Any]:
    size = header_len(raw, path)
    _, n = struct.unpack("<II", bytes(raw[len(MAGIC): PREFIX]))
    if PREFIX + n > min(size, len(raw)):
        raise OffloadError(f"{path}: its header is corrupt or truncated; restore the optimizer "
                           "from a snapshot or checkpoint")
    try:
        return json.loads(bytes(raw[PREFIX: PREFIX + n]))
    except ValueError as e:
        raise OffloadError(f"{path}: its header is corrupt ({e}); restore the optimizer from a "
                           "snapshot or checkpoint") from None


class Batch:
    """One read or write of a byte range, split into chunks run on the pool; ``on_done(batch)``
    runs on the I/O thread that finishes the last chunk, with ``error`` set if any failed."""

    def __init__(self, n: int, on_done: Callable[[Batch], None] | None) -> None:
        self.left = n
        self.error: BaseException | None = None
        self.crcs: list[int] = [0] * n
        self.on_done = on_done
        self.done = threading.Event()
        self._lock = threading.Lock()

    def _finish_one(self, i: int, crc: int, err: BaseException | None) -> None:
        with self._lock:
            self.crcs[i] = crc
            if err is not None and self.error is None:
                self.error = err
            self.left -= 1
            last = self.left == 0
        if last:
            try:
                if self.on_done is not None:
                    self.on_done(self)
            except BaseException:  # an owner's callback must not fail silently on a pool thread
                log.exception("offload I/O completion callback failed")
                raise
            finally:
                self.done.set()

    def wait(self) -> Batch:
        self.done.wait()
        return self


class IOBackend:
    """``os.preadv``/``os.pwritev`` on ``threads`` threads in ``chunk``-byte requests, O_DIRECT
    when ``direct`` and the file system allows it. Counts bytes and *busy* time (wall time with
    at least one request in flight) for the benchmark's bandwidth and overlap figures."""

    def __init__(self, threads: int = 4, chunk: int = CHUNK, direct: bool = True, verify: bool = True) -> None:
        if chunk % ALIGN:
            raise ValueError(f"chunk must be a multiple of {ALIGN}")
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="hs-offload-io")
        self.chunk = chunk
        self.direct = direct
        self.verify = verify
        self.sum = CHECKSUM  # what this backend's writes are checked with (SUMS)
        self.paths: dict[int, str] = {}
        self.bytes_read = self.bytes_written = 0
        self.busy_s = 0.0
        self._inflight = 0
        self._since = 0.0
        self._lock = threading.Lock()

    # -- files ---------------------------------------------------------------------------
    def open(self, path: str, create: bool = True) -> int:
        flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
        fd = -1
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # e.g. tmpfs: buffered from now on, for every file
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        self.paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        self.paths.pop(fd, None)
        os.close(fd)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)

    # -- I/O -------------------------------------------------------------------------------
    def _begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def _end(self, nbytes: int, write: bool) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.busy_s += time.perf_counter() - self._since
            if write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes

    def _ranges(self, start: int, end: int) -> list[tuple[int, int]]:
        return [(o, min(o + self.chunk, end)) for o in range(start, end, self.chunk)]

    def write(self, fd: int, buf: Buffer, start: int, end: int,
              on_done: Callable[[Batch], None] | None = None) -> Batch:
        """Write ``buf[start:end]`` to the same offsets of ``fd``; ``batch.crcs``: CRC32 per
        chunk (when verifying)."""
        ranges = self._ranges(start, end)
        batch = Batch(len(ranges), on_done)
        for i, (a, b) in enumerate(ranges):
            self._begin()
            self.pool.submit(self._write_chunk, fd, buf, a, b, batch, i)
        return batch

    def read(self, fd: int, buf: Buffer, start: int, end: int, crcs: list[int] | None = None,
             on_done: Callable[[Batch], None] | None = None, algo: str | None = None) -> Batch:
        """Read ``[start, end)`` of ``fd`` into the same offsets of ``buf``, checking each chunk
        against ``crcs`` when given (and verifying) with the checksum ``algo`` (a header's ``sum``;
        None: this backend's own, :attr:`sum`)."""
        fn = checksum_fn(algo or self.sum, self.paths.get(fd, str(fd))) if crcs is not None and self.verify else None
        ranges = self._ranges(start, end)
        if crcs is not None and self.verify and len(crcs) != len(ranges):
            raise OffloadError(f"{self.paths.get(fd, fd)}: its header lists {len(crcs)} chunk CRCs, "
                               f"the layer has {len(ranges)} chunks: the file is of another layout")
        batch = Batch(len(ranges), on_done)
        for i, (a, b) in enumerate(ranges):
            self._begin()
            want = crcs[i] if crcs is not None and self.verify else None
            self.pool.submit(self._read_chunk, fd, buf, a, b, want, batch, i, fn)
        return batch

    def _write_chunk(self, fd: int, buf: Buffer, a: int, b: int, batch: Batch, i: int) -> None:
        crc, err = 0, None
        try:
            view = buf.view[a:b]
            if self.verify:
                crc = SUMS[self.sum](view)
            done = 0
            while done < b - a:
                n = os.pwritev(fd, [view[done:]], a + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"pwritev wrote {n} bytes")
                done += n
        except BaseException as e:  # noqa: BLE001 - handed to the batch's owner
            err = e
        finally:
            self._end(b - a, True)
        batch._finish_one(i, crc, err)

    def _read_chunk(self, fd: int, buf: Buffer, a: int, b: int, want: int | None, batch: Batch,
                    i: int, fn: Callable[..., int] | None = None) -> None:
        crc, err = 0, None
        path = self.paths.get(fd, str(fd))
        try:
            view = buf.view[a:b]
            done = 0
            while done < b - a:
                n = os.preadv(fd, [view[done:]], a + done)
                if n == 0:
                    raise OffloadError(f"{path} is truncated: it ends at byte {a + done}, the layer's state "
                                       f"needs {b} bytes; restore the optimizer from a snapshot or checkpoint")
                done += n
            if want is not None and fn is not None:
                crc = fn(view)
                if crc != want:
                    raise OffloadError(f"{path} is corrupt: checksum mismatch in bytes [{a}, {b}) (read {crc:#010x}, "
                                       f"written {want:#010x}); restore the optimizer from a snapshot or checkpoint")
        except BaseException as e:  # noqa: BLE001 - handed to the batch's owner
            err = e
        finally:
            self._end(b - a, False)
        batch._finish_one(i, crc, err)

    # -- synchronous helpers (restore, tests, the naive baseline) ---------------------------
    def read_header(self, fd: int) -> dict[str, Any]:
        """A layer file's header, read synchronously."""
        path = self.paths.get(fd, str(fd))
        buf = Buffer(ALIGN)
        self._sync(self.read(fd, buf, 0, ALIGN))
        size = header_len(buf.view, path)
        if size > ALIGN:
            buf = Buffer(size)
            self._sync(self.read(fd, buf, 0, size))
        return unpack_header(buf.view[:size], path)

    @staticmethod
    def _sync(batch: Batch) -> Batch:
        batch.wait()
        if batch.error is not None:
            raise batch.error
        return batch


class S:
    """A Layer's state."""

    IDLE, LOADING, LOADED, COMPUTING, WRITING = range(5)


class Layer:
    """One layer's parameters, the layout of its state in a buffer/file, and its progress."""

    def __init__(self, index: int, name: str, params: list[nn.Parameter], names: list[str],
                 groups: list[int], keys: tuple[str, ...], root: Path, chunk: int) -> None:
        self.index, self.name, self.params, self.names, self.groups = index, name, params, names, groups
        self.keys = keys
        self.offsets: dict[tuple[str, int], int] = {}
        off = 0
        for k in keys:
            for i, p in enumerate(params):
                self.offsets[(k, i)] = off
                off += (p.numel() * p.element_size() + 63) // 64 * 64
        self.data_len = align(off)
        self.header_len = align(PREFIX + 512 + len(name) + 48 * len(params) + 12 * (self.data_len // chunk + 1))
        self.total = self.header_len + self.data_len
        self.paths = [str(root / f"layer{index:05d}.{v}") for v in "ab"]
        self.fds: list[int | None] = [None, None]
        self.crcs: list[list[int] | None] = [None, None]
        self.gens = [0, 0]
        self.cur = -1  # the version holding the last written state (-1: none, moments are zero)
        self.steps = [torch.tensor(0.0, dtype=_get_scalar_dtype()) for _ in params]
        self.state = S.IDLE
        self.slot: Buffer | None = None
        self.head: Buffer | None = None  # the header's own buffer (written after the data)
        self.pending: int | None = None  # the iteration whose gradients are captured, until computed
        self.queued_it = -1  # the last iteration the layer was queued for
        self.grads: dict[int, torch.Tensor] = {}
        self.hyper: list[dict[str, Any]] = []
        self.error_path = ""

    def views(self, buf: Buffer) -> dict[str, list[torch.Tensor]]:
        return {k: [buf.tensor(self.header_len + self.offsets[(k, i)], p.numel(), p.dtype).view(p.shape)
                    for i, p in enumerate(self.params)] for k in self.keys}

    def header_meta(self, gen: int, io: IOBackend, crcs: list[int], steps: list[float]) -> dict[str, Any]:
        return {"layer": self.index, "name": self.name, "gen": gen, "data_len": self.data_len,
                "header_len": self.header_len, "chunk": io.chunk, "numels": [p.numel() for p in self.params],
                "keys": list(self.keys), "crcs": crcs if io.verify else None,
                "sum": io.sum if io.verify else None, "steps": steps}

    def trainable(self) -> int:
        return sum(p.requires_grad for p in self.params)


def build_layers(model: nn.Module, param_groups: list[dict[str, Any]], layers: Sequence[nn.Module] | None,
                 keys: tuple[str, ...], root: Path, chunk: int) -> list[Layer]:
    """The layers of ``model``'s optimized parameters: each module's direct ones, or each of
    ``layers``' (recursively); a parameter belongs to the first layer that has it."""
    group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    if missing := [p for p in group_of if p not in names]:
        raise ValueError(f"{len(missing)} optimized parameter(s) are not parameters of the model")
    if layers is None:
        cand = [(n or type(model).__name__, list(m.parameters(recurse=False)))
                for n, m in model.named_modules()]
    else:
        mod_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        cand = [(mod_names.get(id(m), type(m).__name__), list(m.parameters())) for m in layers]
    out: list[Layer] = []
    taken: set[int] = set()
    for name, ps in cand:
        ps = [p for p in ps if id(p) in group_of and id(p) not in taken and not taken.add(id(p))]
        if ps:
            out.append(Layer(len(out), name, ps, [names[id(p)] for p in ps],
                             [group_of[id(p)] for p in ps], keys, root, chunk))
    if left := [names[p] for p in group_of if p not in taken]:
        raise ValueError(f"parameters in no layer: {left[:5]} (layers= must cover every optimized parameter)")
    for L in out:
        for p in L.params:
            if p.is_sparse or not p.is_contiguous() or p.device.type != "cpu":
                raise ValueError(f"{L.names[0]}: only dense contiguous CPU parameters can be offloaded")
    return out
