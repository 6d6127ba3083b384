"""A job's state on disk, read and written with torch: the final state and the persisted
checkpoints.

The final state is ``<output_dir>/final/rank<r>.safetensors`` + ``manifest.json``. Plain
safetensors files (load them with ``safetensors.torch.load_file``); tensor names are
``component/key`` (``model.params/wte.weight``, ``optimizer/state.0.exp_avg``,
``rng/torch``...) and each file's metadata holds the components' JSON state under
``hotspare.meta``. Persisted checkpoints (:mod:`hotspare.recovery.persist`, torch-free) follow the
same convention; :func:`load_rank` and :func:`load_checkpoint` read them back as tensors.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hotspare.orchestrator.util import atomic_target, atomic_write

from .checkpoint_store import join, step_name
from .persist import (
    CheckpointError,
    complete_steps,
    rank_file,
    read_manifest,
    read_rank_bytes,
    resolve_root,
)


@dataclass
class FinalState:
    manifest: dict
    ranks: dict[int, dict[str, torch.Tensor]]
    meta: dict[int, dict]


def write_rank(output_dir: str | Path, rank: int, step: int, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    from safetensors.torch import save_file

    d = Path(output_dir) / "final"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank{rank}.safetensors"
    with atomic_target(path) as tmp:  # streamed to disk: no second copy of the state in memory
        save_file(
            {k: v.detach().clone().contiguous() for k, v in tensors.items()},  # clones: no shared storage
            str(tmp),
            metadata={"hotspare.rank": str(rank), "hotspare.step": str(step), "hotspare.meta": json.dumps(meta)},
        )
    return path


def write_manifest(output_dir: str | Path, job: str, world_size: int, steps: int, epoch: int) -> Path:
    d = Path(output_dir) / "final"
    manifest = {
        "job": job,
        "world_size": world_size,
        "steps": steps,
        "epoch": epoch,
        "files": {str(r): f"rank{r}.safetensors" for r in range(world_size)},
        "time": time.time(),
    }
    return atomic_write(d / "manifest.json", json.dumps(manifest, indent=1), fsync=False, mode=0o666)


def load_final(output_dir: str | Path) -> FinalState:
    """Every rank's final tracked state. Raises FileNotFoundError naming what is missing."""
    from safetensors import safe_open

    d = Path(output_dir) / "final"
    mpath = d / "manifest.json"
    if not mpath.exists():
        raise FileNotFoundError(f"{mpath}: no manifest (did the job finish?)")
    manifest = json.loads(mpath.read_text())
    ranks, meta = {}, {}
    for r, name in manifest["files"].items():
        path = d / name
        if not path.exists():
            raise FileNotFoundError(f"{path}: listed in {mpath} but missing")
        with safe_open(str(path), framework="pt") as f:
            ranks[int(r)] = {k: f.get_tensor(k) for k in f.keys()}
            meta[int(r)] = json.loads((f.metadata() or {}).get("hotspare.meta", "{}"))
    return FinalState(manifest, ranks, meta)


# -- persisted checkpoints -----------------------------------------------------------------
def load_rank(root: str | Path, step: int, rank: int,
              manifest: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of one rank's persisted state, verified against the manifest (size,
    CRC32): tensors are ``component/key`` names. Raises CheckpointError naming the file."""
    from safetensors.torch import load as st_load

    header, raw = read_rank_bytes(root, step, rank, manifest)
    try:
        tensors = st_load(raw)
        meta = json.loads(header["__metadata__"]["hotspare.meta"])
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{join(root, step_name(step), rank_file(rank))}: unreadable safetensors "
                              f"data ({e})") from e
    return tensors, meta


def load_checkpoint(root: str | Path, step: int | None = None) -> FinalState:
    """Every rank's state of a complete persisted checkpoint (the newest unless ``step``).
    ``root`` is a run's checkpoint directory, or the persist path holding every run's (then
    the newest run with a complete checkpoint is read)."""
    root = resolve_root(root)
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
