"""The baseline for benchmarks/lost_time.py: the GPT demo workload under plain torchrun.

Started by ``python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts R]
benchmarks/torchrun_worker.py ...``. It trains exactly what hotspare trains with
``examples/gpt.py:train``: the same ``build(...)`` (same seed, so the same initial weights
and data order), one torch thread per process, deterministic algorithms, Python/NumPy RNGs
seeded with ``seed + rank``, gradients averaged with one ``all_reduce`` on a flat buffer
(the same arithmetic as ``Session.allreduce_grads``), gradient clipping at 1.0, AdamW and
the warmup-cosine schedule.

Fault tolerance is what a careful torchrun user writes by hand:

* ``--ckpt-dir D --K K``: after every K-th step each rank ``torch.save``s its model,
  optimizer, scheduler, data position and torch/Python/NumPy RNG states to its own file
  ``D/ckpt-<step>-rank<r>.pt`` (written to a temporary name, then renamed: a file that
  exists is complete). Each rank keeps its two newest files.
* On start, every rank loads the newest step for which all ``WORLD_SIZE`` rank files
  exist and resumes after it; so a run is bit-for-bit the same with or without restarts.
* ``--fail-step S --fail-rank R``: in the first attempt only (``TORCHELASTIC_RESTART_COUNT``
  is ``0``), rank R SIGKILLs itself at the start of step S, exactly where hotspare's
  ``kill-rank`` chaos fires (before the step's work). torchrun then tears down the whole
  worker group and starts a fresh one (``--max-restarts``), which reloads the checkpoint
  and recomputes the steps since.

Without ``--ckpt-dir`` it is plain training with no fault tolerance at all.

Timestamps (``time.time()``, wall clock, the same clock hotspare's events use) go to
``--out`` as small JSON files, one per rank and attempt: ``a<attempt>-r<rank>-start.json``
when the training loop is about to run its first step (process group built, workload built,
checkpoint loaded), ``a0-r<rank>-kill.json`` just before the self-kill and
``a<attempt>-r<rank>-end.json`` after the last step (with the final loss), and
``a<attempt>-r<rank>-exit.json`` after ``destroy_process_group`` (the rest of a whole-command
wall time is interpreter teardown and torchrun's own shutdown).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import gpt  # noqa: E402  (examples/gpt.py: the workload)

CKPT_RE = re.compile(r"ckpt-(\d+)-rank(\d+)\.pt$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPT demo workload under torchrun (lost-time baseline)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True, help="directory for the timestamp records")
    p.add_argument("--ckpt-dir", help="checkpoint directory (omit: no checkpoints, plain training)")
    p.add_argument("--K", type=int, default=20, help="checkpoint every K steps")
    p.add_argument("--fail-step", type=int, default=-1, help="self-SIGKILL at the start of this step (-1: never)")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (a bigger model)")
    p.add_argument("--final-dir", help="after the last step (outside the timed span) save each rank's model "
                   "state_dict to DIR/rank<r>.pt, to check the workload against hotspare's final state")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (hotspare's default: 1)")
    # examples/gpt.py build() arguments; defaults are gpt.py's
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--decay-steps", type=int, default=2000)
    return p.parse_args(argv)


def record(out: Path, name: str, **data: object) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, out / name)


def allreduce_grads(model: torch.nn.Module, world: int, buf: torch.Tensor | None) -> torch.Tensor | None:
    """Average gradients over the group in one flat bucket (as hotspare's Session does)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return buf
    n = sum(g.numel() for g in grads)
    if buf is None or buf.numel() != n or buf.dtype != grads[0].dtype:
        buf = torch.empty(n, dtype=grads[0].dtype, device=grads[0].device)
    torch.cat([g.reshape(-1) for g in grads], out=buf)
    dist.all_reduce(buf)
    buf.div_(world)
    off = 0
    for g in grads:
        g.copy_(buf[off : off + g.numel()].view_as(g))
        off += g.numel()
    return buf


def checkpoints(ckpt_dir: Path) -> dict[int, set[int]]:
    """step -> ranks that have a complete file for it."""
    found: dict[int, set[int]] = {}
    for f in glob.glob(str(ckpt_dir / "ckpt-*-rank*.pt")):
        m = CKPT_RE.search(f)
        if m:
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return found


def newest_complete(ckpt_dir: Path, world: int) -> int | None:
    full = [s for s, ranks in checkpoints(ckpt_dir).items() if ranks >= set(range(world))]
    return max(full) if full else None


def save(ckpt_dir: Path, step: int, rank: int, model, opt, sched, data) -> None:
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "data": data.state_dict(),
        "rng_torch": torch.get_rng_state(),
        "rng_python": random.getstate(),
        # numpy's state as plain values and a tensor: the checkpoint loads with weights_only=True
        "rng_numpy": (lambda n, k, p, g, c: (n, torch.from_numpy(k.astype(np.int64)), p, g, c))(*np.random.get_state()),
    }
    final = ckpt_dir / f"ckpt-{step:08d}-rank{rank}.pt"
    tmp = ckpt_dir / f".tmp-{step:08d}-rank{rank}-{os.getpid()}.pt"
    torch.save(state, tmp)
    os.replace(tmp, final)
    for old in sorted(s for s, ranks in checkpoints(ckpt_dir).items() if rank in ranks)[:-2]:
        try:
            os.unlink(ckpt_dir / f"ckpt-{old:08d}-rank{rank}.pt")
        except FileNotFoundError:
            pass


def load(ckpt_dir: Path, step: int, rank: int, model, opt, sched, data) -> None:
    state = torch.load(ckpt_dir / f"ckpt-{step:08d}-rank{rank}.pt", weights_only=True)  # never unpickle code
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    data.load_state_dict(state["data"])
    torch.set_rng_state(state["rng_torch"])
    random.setstate(state["rng_python"])
    name, keys, pos, has_gauss, cached = state["rng_numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def main(argv: list[str] | None = None) -> int:
    t_proc = time.time()
    a = parse_args(argv)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(a.ckpt_dir) if a.ckpt_dir else None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    t_pg = time.time()
    torch.use_deterministic_algorithms(True)
    random.seed(a.seed + rank)
    np.random.seed(a.seed + rank)
    model, opt, sched, data = gpt.build(
        n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, block_size=a.block_size,
        batch_size=a.batch_size, lr=a.lr, seed=a.seed, dropout=a.dropout,
        warmup_steps=a.warmup_steps, decay_steps=a.decay_steps, rank=rank, world_size=world,
    )
    start = 0
    resumed_from = None
    if ckpt_dir is not None:
        resumed_from = newest_complete(ckpt_dir, world)
        if resumed_from is not None:
            load(ckpt_dir, resumed_from, rank, model, opt, sched, data)
            start = resumed_from + 1
    record(out, f"a{attempt}-r{rank}-start.json", t=time.time(), t_proc=t_proc, t_pg=t_pg,
           start_step=start, resumed_from=resumed_from, pid=os.getpid())

    buf = None
    loss_v = float("nan")
    for step in range(start, a.steps):
        if step == a.fail_step and rank == a.fail_rank and attempt == 0:
            record(out, f"a{attempt}-r{rank}-kill.json", t=time.time(), step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = data.next_batch()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        buf = allreduce_grads(model, world, buf)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = loss.item()
        if a.step_sleep > 0:
            time.sleep(a.step_sleep)
        if ckpt_dir is not None and (step + 1) % a.K == 0 and step + 1 < a.steps:
            save(ckpt_dir, step, rank, model, opt, sched, data)
    record(out, f"a{attempt}-r{rank}-end.json", t=time.time(), steps=a.steps, start_step=start,
           final_loss=loss_v, pid=os.getpid())
    if a.final_dir:
        Path(a.final_dir).mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), Path(a.final_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
    record(out, f"a{attempt}-r{rank}-exit.json", t=time.time())
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: a gloo/c10d destructor at exit aborted workers now and
    # then ("terminate called without an active exception", exit -6), which torchrun takes
    # for a failure and restarts (an extra attempt; see ddp_torchrun_worker.py)
    os._exit(rc)
