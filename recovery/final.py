"""A finished job's state on disk: ``<output_dir>/final/rank<r>.safetensors`` + manifest.

Plain safetensors files (load them with ``safetensors.torch.load_file``); tensor names are
``component/key`` (``model.params/wte.weight``, ``optimizer/state.0.exp_avg``,
``rng/torch``...) and each file's metadata holds the components' JSON state under
``hotspare.meta``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


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
    tmp = d / f".rank{rank}.{os.getpid()}.tmp"
    save_file(
        {k: v.detach().clone().contiguous() for k, v in tensors.items()},
        str(tmp),
        metadata={"hotspare.rank": str(rank), "hotspare.step": str(step), "hotspare.meta": json.dumps(meta)},
    )
    os.replace(tmp, path)
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
    tmp = d / f".manifest.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, d / "manifest.json")
    return d / "manifest.json"


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
