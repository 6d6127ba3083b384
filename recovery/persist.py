"""The persistent tier's format: which steps are checkpoints, completing and pruning them,
and reading a rank's file back verified. Torch-free: the agent and the CLI use it.

Layout under the persist path (a directory or an fsspec URL; ``persist_path`` in the spec),
one directory per run (its run id: a run writes, prunes and restores only its own; ``hotspare
run --resume`` reads the previous run's), each holding::

    step00000040/rank0.safetensors   one plain safetensors file per rank
    step00000040/rank0.json          {"bytes", "crc32", ...}: written after the data is durable
    step00000040/manifest.json       written last, atomically, once every rank's file is there

A step directory without ``manifest.json`` is never taken for a checkpoint. Tensor names are
the snapshot's ``component/key`` names and each file's metadata holds the components' JSON
state under ``hotspare.meta`` -- the same convention as ``final/``, so
``safetensors.torch.load_file`` reads them and :func:`hotspare.recovery.final.load_checkpoint`
restores them.

Who does what: :mod:`hotspare.recovery.checkpoint_writer` writes a rank's file and record (in the node
agent, streaming from a snapshot slot); :mod:`hotspare.recovery.checkpoint_store` is where the files
live (a directory or an object store) and what they are called; this module decides when a
step is a checkpoint (:func:`try_finish`), prunes old ones and reads them back
(:func:`read_rank_bytes`); the torch-side loaders are in :mod:`hotspare.recovery.final`.
"""

from __future__ import annotations

import json
import re
import struct
import time
import zlib
from pathlib import Path
from typing import Any

from .checkpoint_store import (
    MANIFEST,
    STEP_RE,
    CheckpointError,
    checkpoint_path,
    join,
    rank_file,
    rank_record,
    step_dir,
    step_name,
    tier_for,
)
from .checkpoint_writer import ST_DTYPES, STALL_S, is_disk_full, write_rank
from .slotfile import SlotView, open_slot

__all__ = ["CheckpointError", "SlotView", "open_slot", "write_rank", "try_finish", "prune",
           "complete_steps", "runs", "resumable", "resolve_root", "read_manifest", "read_rank_bytes", "checkpoint_path", "step_dir",
           "rank_file", "is_disk_full", "ST_DTYPES", "STALL_S"]

FORMAT = "hotspare-ckpt-1"

#: a run's directory under the persist base: its run id (``20261203-154330-3fa2``)
RUN_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]+\Z")


def try_finish(root: str | Path, step: int, world_size: int, job: str, run_id: str = "") -> bool:
    """Write the manifest if every rank's record is there, all of one world size and one
    timeline (whoever completes the set does it; two writers write the same content
    atomically). True if this call completed it.

    Records of another world size were written before a shrink/grow renumbered the ranks;
    records of another timeline hold the step as computed before a rollback, and the
    ranks that rolled back write theirs again: either way, not one checkpoint (yet)."""
    tier, sub = tier_for(root), step_name(step)
    if tier.exists(sub, MANIFEST):
        return False
    recs = {}
    for r in range(world_size):
        try:
            recs[str(r)] = json.loads(tier.read(sub, rank_record(r)))
        except (OSError, ValueError):
            return False
        if recs[str(r)].get("world_size") != world_size:
            return False
    if len({rec.get("timeline") for rec in recs.values()}) != 1:
        return False
    tier.write_json({"job": job, "run_id": run_id, "step": step, "world_size": world_size, "files": recs,
                     "time": time.time(), "format": FORMAT}, sub, MANIFEST)
    tier.sync(sub)
    return True


def prune(root: str | Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete step dirs older
    than the newest complete one. Returns the steps removed."""
    complete = complete_steps(root)
    if not complete:
        return []
    newest, keep_set = complete[-1], set(complete[-keep:])
    gone = []
    tier = tier_for(root)
    for name in tier.ls():
        m = STEP_RE.match(name)
        if not m:
            continue
        s = int(m.group(1))
        if s in keep_set or s > newest:
            continue
        tier.rm(name)
        gone.append(s)
    return sorted(gone)


# -- reading -------------------------------------------------------------------------------
def complete_steps(root: str | Path) -> list[int]:
    """Steps with a manifest (complete checkpoints), oldest first."""
    tier = tier_for(root)
    out = []
    for name in tier.ls():
        m = STEP_RE.match(name)
        if m and tier.exists(name, MANIFEST):
            out.append(int(m.group(1)))
    return sorted(out)


def runs(base: str | Path) -> list[str]:
    """The run directories under a persist base (each a run id), oldest first."""
    return sorted(n for n in tier_for(base).ls() if RUN_RE.match(n))


def resumable(base: str | Path, world_size: int, before: str = "") -> tuple[str, int] | None:
    """(run id, step) of the newest run under ``base`` (older than run ``before``, if given)
    that has a complete checkpoint of ``world_size`` ranks, and its newest such step; None:
    nothing to resume. Raises CheckpointError for the layout before run ids (step
    directories right under ``base``), which no run id names."""
    if not runs(base) and complete_steps(base):
        raise CheckpointError(
            f"{base} holds checkpoints in the layout before run ids (step directories right under "
            f"it); to resume from them, move them into a run directory: mkdir "
            f"{join(base, '00000000-000000-0')} && mv {join(base, 'step*')} {join(base, '00000000-000000-0')}/")
    for run in reversed([r for r in runs(base) if not before or r < before]):
        root = join(base, run)
        for step in reversed(complete_steps(root)):
            try:
                if int(read_manifest(root, step)["world_size"]) == world_size:
                    return run, step
            except CheckpointError:
                continue
    return None


def resolve_root(root: str | Path) -> str | Path:
    """What a reader given a persist base means: ``root`` itself if it holds checkpoints
    (a run's directory, or the layout before run ids), else its newest run that does."""
    if complete_steps(root):
        return root
    for run in reversed(runs(root)):
        sub = join(root, run)
        if complete_steps(sub):
            return sub
    return root


def read_manifest(root: str | Path, step: int) -> dict:
    sub = step_name(step)
    f = join(root, sub, MANIFEST)
    try:
        m = json.loads(tier_for(root).read(sub, MANIFEST))
        _check_manifest(m, step)
        return m
    except FileNotFoundError as e:
        raise CheckpointError(f"{f}: missing (step {step} is not a complete checkpoint)") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from e


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest(m: Any, step: int) -> None:
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
    sub = step_name(step)
    rec = m["files"].get(str(rank))
    mf = join(root, sub, MANIFEST)
    if rec is None:
        raise CheckpointError(f"{mf}: no entry for rank {rank} (world size {m['world_size']})")
    f = join(root, sub, rec["file"])
    try:
        raw = tier_for(root).read(sub, rec["file"])
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


_MOVED = {"load_checkpoint": "hotspare.recovery.final", "load_rank": "hotspare.recovery.final"}


def __getattr__(name: str) -> object:
    # The torch-using readers left this torch-free module (the agent imports it); importing
    # them from here would make the format depend on the training side. Say where they went.
    if name in _MOVED:
        raise AttributeError(f"hotspare.recovery.persist.{name} moved to {_MOVED[name]}.{name} "
                             f"(or `from recovery import {name}`)")
    raise AttributeError(f"module 'hotspare.recovery.persist' has no attribute {name!r}")
