"""The persistent tier: snapshots flushed from host memory to disk, off the training path.

Layout under the persist path (a directory; ``persist_path`` in the spec)::

    step00000040/rank0.safetensors   one plain safetensors file per rank
    step00000040/rank0.json          {"bytes", "crc32", ...}: written after the data is durable
    step00000040/manifest.json       written last, atomically, once every rank's file is there

A step directory without ``manifest.json`` is never taken for a checkpoint. Tensor names are
the snapshot's ``component/key`` names and each file's metadata holds the components' JSON
state under ``hotspare.meta`` -- the same convention as ``final/``, so
``safetensors.torch.load_file`` reads them and :func:`load_checkpoint` restores them.

The writer (:func:`write_rank`) runs in the node agent: it streams a snapshot slot from
``/dev/shm`` -- starting while the training process is still copying it there, following
the slot's ``copied`` mark -- with gathered ``writev`` calls (many small tensors, few large
writes), computing a CRC32 on the way; the file counts only if the slot then turned
COMPLETE with the same sequence number, into a local directory first (``persist_local_dir``, fast
local SSD) and then to the shared path. Torch-free: the agent never imports torch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import time
import zlib
from pathlib import Path

from .slotfile import SlotView, open_slot

__all__ = ["CheckpointError", "SlotView", "open_slot", "write_rank", "try_finish", "prune",
           "complete_steps", "read_manifest", "load_rank", "load_checkpoint", "checkpoint_path"]

#: snapshot dtype names -> safetensors dtype codes
ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_STEP_DIR = re.compile(r"^step(\d{8})$")
_IOV_MAX = 512
_COPY_CHUNK = 64 << 20
STALL_S = 60.0  # a slot being filled that makes no progress this long is given up on


class CheckpointError(Exception):
    """A persisted checkpoint is missing, incomplete, truncated or corrupt (the message names the file)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step{step:08d}"


def _remote(root: str | Path):
    """(fsspec filesystem, path) when ``root`` is a URL (s3://, gs://, memory://, file://...),
    else None: plain directories use the os module directly (atomic renames, fsync)."""
    if not isinstance(root, str) or "://" not in root:
        return None
    try:
        import fsspec
    except ImportError as e:
        raise CheckpointError(f"{root}: persist_path is a URL, which needs fsspec "
                              "(pip install fsspec plus the filesystem's package, e.g. s3fs)") from e
    return fsspec.core.url_to_fs(root)


def checkpoint_path(root: str | Path, step: int) -> str:
    """Where step's checkpoint lives, as text (a directory or a URL)."""
    return _join(root, step_dir("", step).name)


def _join(root: str | Path, *parts: str) -> str:
    """Display/URL form of a path under root."""
    return "/".join([str(root).rstrip("/"), *parts])


def _read(root: str | Path, *parts: str) -> bytes:
    rem = _remote(root)
    if rem is None:
        return Path(root, *parts).read_bytes()
    fs, base = rem
    try:
        return fs.cat_file(_join(base, *parts))
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - each filesystem has its own errors
        raise OSError(str(e)) from e


def _exists(root: str | Path, *parts: str) -> bool:
    rem = _remote(root)
    if rem is None:
        return Path(root, *parts).exists()
    fs, base = rem
    return fs.exists(_join(base, *parts))


def _write_small(root: str | Path, data: dict, *parts: str) -> None:
    """A JSON record: atomically (rename) on a directory, one PUT on an object store."""
    rem = _remote(root)
    if rem is None:
        _atomic_json(Path(root, *parts), data)
        return
    fs, base = rem
    fs.pipe_file(_join(base, *parts), json.dumps(data, indent=1, sort_keys=True).encode())


def _step_names(root: str | Path) -> list[str]:
    rem = _remote(root)
    if rem is None:
        try:
            return [p.name for p in Path(root).iterdir()]
        except OSError:
            return []
    fs, base = rem
    try:
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
    except (FileNotFoundError, OSError):
        return []


# -- writing (agent side) -----------------------------------------------------------------
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


def _atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_rank(view: SlotView, root: str | Path, *, rank: int, job: str, timeline: int,
               world_size: int, local_dir: str | Path | None = None) -> dict:
    """Stream one rank's snapshot slot into ``root`` (via ``local_dir`` first, if given).

    ``timeline`` (the epoch whose restore the state descends from) and ``world_size`` go
    into the rank record: :func:`try_finish` joins only records of one timeline and size.

    Returns the rank record (also written as ``rank<r>.json``). Raises OSError (ENOSPC, ...)
    after removing its temporary files; nothing of an earlier checkpoint is touched.
    """
    h = view.header
    step = int(h["step"])
    meta = {"hotspare.meta": json.dumps(h["meta"], separators=(",", ":")), "hotspare.rank": str(rank),
            "hotspare.step": str(step), "hotspare.job": job}
    head, spans = _st_header(h["tensors"], meta)
    rem = _remote(root)
    if rem is not None and not local_dir:  # an object store: stage on local disk first
        import tempfile

        local_dir = Path(tempfile.gettempdir()) / "hotspare-persist"
    first = Path(local_dir) / job if local_dir else Path(root)
    d = step_dir(first, step)
    d.mkdir(parents=True, exist_ok=True)
    name = f"rank{rank}.safetensors"
    tmp = d / f".{name}.{os.getpid()}.tmp"
    t0 = time.perf_counter()
    crc = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            crc = _stream(fd, view, head, spans, step)
            os.fsync(fd)
        finally:
            os.close(fd)
        _await_complete(view, step)
        os.replace(tmp, d / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    size = len(head) + sum(n for _, n in spans)
    rec = {"rank": rank, "step": step, "timeline": timeline, "world_size": world_size, "file": name,
           "bytes": size, "crc32": crc,
           "write_s": round(time.perf_counter() - t0, 4)}
    if local_dir:  # local SSD -> shared path
        sub = step_dir("", step).name
        try:
            if rem is not None:
                fs, base = rem
                fs.makedirs(_join(base, sub), exist_ok=True)
                fs.put_file(str(d / name), _join(base, sub, name))
            else:
                dst = step_dir(root, step)
                dst.mkdir(parents=True, exist_ok=True)
                _copy(d / name, dst / name)
                _fsync_dir(dst)
        finally:
            (d / name).unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:
                pass
    else:
        _fsync_dir(d)
    _write_small(root, rec, step_dir("", step).name, f"rank{rank}.json")
    return rec


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            shutil.copyfileobj(fi, fo, _COPY_CHUNK)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def try_finish(root: str | Path, step: int, world_size: int, job: str) -> bool:
    """Write the manifest if every rank's record is there, all of one world size and one
    timeline (whoever completes the set does it; two writers write the same content
    atomically). True if this call completed it.

    Records of another world size were written before a shrink/grow renumbered the ranks;
    records of another timeline hold the step as computed before a rollback, and the
    ranks that rolled back write theirs again: either way, not one checkpoint (yet)."""
    sub = step_dir("", step).name
    if _exists(root, sub, "manifest.json"):
        return False
    recs = {}
    for r in range(world_size):
        try:
            recs[str(r)] = json.loads(_read(root, sub, f"rank{r}.json"))
        except (OSError, ValueError):
            return False
        if recs[str(r)].get("world_size") != world_size:
            return False
    if len({rec.get("timeline") for rec in recs.values()}) != 1:
        return False
    _write_small(root, {"job": job, "step": step, "world_size": world_size, "files": recs,
                        "time": time.time(), "format": "hotspare-ckpt-1"}, sub, "manifest.json")
    if _remote(root) is None:
        _fsync_dir(step_dir(root, step))
    return True


def prune(root: str | Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete step dirs older
    than the newest complete one. Returns the steps removed."""
    complete = complete_steps(root)
    if not complete:
        return []
    newest, keep_set = complete[-1], set(complete[-keep:])
    gone = []
    rem = _remote(root)
    for name in _step_names(root):
        m = _STEP_DIR.match(name)
        if not m:
            continue
        s = int(m.group(1))
        if s in keep_set or s > newest:
            continue
        if rem is None:
            shutil.rmtree(Path(root, name), ignore_errors=True)
        else:
            try:
                rem[0].rm(_join(rem[1], name), recursive=True)
            except (FileNotFoundError, OSError):
                pass
        gone.append(s)
    return sorted(gone)


# -- reading -------------------------------------------------------------------------------
def complete_steps(root: str | Path) -> list[int]:
    """Steps with a manifest (complete checkpoints), oldest first."""
    out = []
    for name in _step_names(root):
        m = _STEP_DIR.match(name)
        if m and _exists(root, name, "manifest.json"):
            out.append(int(m.group(1)))
    return sorted(out)


def read_manifest(root: str | Path, step: int) -> dict:
    sub = step_dir("", step).name
    f = _join(root, sub, "manifest.json")
    try:
        m = json.loads(_read(root, sub, "manifest.json"))
        _check_manifest(m, step)
        return m
    except FileNotFoundError as e:
        raise CheckpointError(f"{f}: missing (step {step} is not a complete checkpoint)") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from e


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest(m, step: int) -> None:
    """Every field a reader relies on, with its type; file names are plain names in the step
    directory (a manifest never points outside it)."""
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
        raise ValueError("not a hotspare checkpoint manifest (no 'files' mapping)")
    ws = m.get("world_size")
    if not _is_int(ws) or ws < 1:
        raise ValueError(f"world_size must be a positive integer, got {ws!r}")
    if m.get("step") != step:
        raise ValueError(f"it describes step {m.get('step')!r}, not {step}")
    if set(m["files"]) != {str(r) for r in range(ws)}:
        raise ValueError(f"files must name ranks 0..{ws - 1}, got {sorted(m['files'])}")
    for r, rec in m["files"].items():
        if not isinstance(rec, dict):
            raise ValueError(f"files[{r}] must be a mapping")
        name = rec.get("file")
        if not isinstance(name, str) or not re.fullmatch(r"rank\d+\.safetensors", name):
            raise ValueError(f"files[{r}].file must be rank<r>.safetensors, got {name!r}")
        for key in ("bytes", "crc32"):
            if not _is_int(rec.get(key)) or rec[key] < 0:
                raise ValueError(f"files[{r}].{key} must be a non-negative integer, got {rec.get(key)!r}")


def read_rank_bytes(root: str | Path, step: int, rank: int, manifest: dict | None = None) -> tuple[dict, bytes]:
    """(safetensors header, file bytes) of one rank, verified against the manifest: size and
    CRC32. Raises CheckpointError naming the file."""
    m = manifest or read_manifest(root, step)
    rec = m["files"].get(str(rank))
    if rec is None:
        raise CheckpointError(f"{_join(root, step_dir('', step).name, 'manifest.json')}: no entry for "
                              f"rank {rank} (world size {m['world_size']})")
    f = _join(root, step_dir("", step).name, rec["file"])
    mf = _join(root, step_dir("", step).name, "manifest.json")
    try:
        raw = _read(root, step_dir("", step).name, rec["file"])
    except OSError as e:
        raise CheckpointError(f"{f}: {e.strerror or e}") from e
    if len(raw) != rec["bytes"]:
        raise CheckpointError(f"{f}: truncated or padded: {len(raw)} bytes, {mf} says "
                              f"{rec['bytes']}; this checkpoint cannot be used")
    if zlib.crc32(raw) != rec["crc32"]:
        raise CheckpointError(f"{f}: corrupt: CRC32 mismatch with {mf}; this checkpoint "
                              "cannot be used")
    try:
        (hlen,) = struct.unpack_from("<Q", raw, 0)
        header = json.loads(raw[8: 8 + hlen])
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{f}: not a safetensors file ({e})") from e
    return header, raw


def load_rank(root: str | Path, step: int, rank: int, manifest: dict | None = None):
    """(tensors, meta) of one rank's persisted state: tensors are ``component/key`` names."""
    from safetensors.torch import load as st_load

    header, raw = read_rank_bytes(root, step, rank, manifest)
    try:
        tensors = st_load(raw)
        meta = json.loads(header["__metadata__"]["hotspare.meta"])
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        f = _join(root, step_dir("", step).name, f"rank{rank}.safetensors")
        raise CheckpointError(f"{f}: unreadable safetensors data ({e})") from e
    return tensors, meta


def load_checkpoint(root: str | Path, step: int | None = None):
    """Every rank's state of a complete persisted checkpoint (the newest unless ``step``),
    as a :class:`recovery.final.FinalState`."""
    from .final import FinalState

    if step is None:
        steps = complete_steps(root)
        if not steps:
            raise CheckpointError(f"{root}: no complete checkpoint (no step*/manifest.json)")
        step = steps[-1]
    m = read_manifest(root, step)
    ranks, meta = {}, {}
    for r in range(int(m["world_size"])):
        ranks[r], meta[r] = load_rank(root, step, r, m)
    return FinalState(manifest=m, ranks=ranks, meta=meta)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
