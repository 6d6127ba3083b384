"""The torchrun side of benchmarks/ddp_overhead.py: ``examples/ddp_train.py``'s training under
plain torchrun, with hand-written checkpoint/resume.

Started by ``python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts R]
benchmarks/ddp_torchrun_worker.py ...``. Each step is exactly the one ``examples/ddp_train.py``
runs under hotspare (and ``examples/torchrun_port/train_torchrun.py`` under torchrun): the
batch split in ``--accum`` micro-batches, DDP's all-reduce skipped (``no_sync``) on all but
the last, clipping at 1.0, AdamW (weight decay 0.01), the cosine schedule over ``--steps``.
The model is :func:`ddp_workload.make_model` (``--width``, ``--depth``; 64 x 1 is the
example's) built after ``torch.manual_seed(seed)`` as in the example, one torch thread per
process (hotspare's default).

Data: the example's ``make_dataset`` read through hotspare's ``ElasticDataLoader`` used
stand-alone (``rank=``, ``world_size=``; no session): the same per-rank batches as
``session.data_loader`` in the example, and a loader whose position is a ``state_dict`` (the
torchdata ``StatefulDataLoader`` convention a careful torchrun script would use to resume
mid-epoch). So every run of the benchmark, hotspare's and torchrun's, trains on the same
batches and can be compared bit for bit.

Fault tolerance, records and the self-kill are ``benchmarks/torchrun_worker.py``'s (the GPT
baseline of lost_time.py), whose helpers this script uses:

* ``--ckpt-dir D --K K``: after every K-th step each rank ``torch.save``s model, optimizer,
  scheduler, data position and torch/Python/NumPy RNG states to ``D/ckpt-<step>-rank<r>.pt``
  (temporary name, then rename); each rank keeps its two newest. On start every rank loads
  the newest step that all ``WORLD_SIZE`` ranks have and resumes after it.
* ``--fail-step S --fail-rank R``: in the first attempt only, rank R SIGKILLs itself at the
  start of step S (where hotspare's ``kill-rank`` chaos fires); torchrun (``--max-restarts``)
  starts a fresh group, which resumes from the newest checkpoint.
* Records in ``--out``: ``a<attempt>-r<rank>-start.json`` right before the first step (group
  built, model built, checkpoint loaded), ``a0-r<rank>-kill.json``, ``a<attempt>-r<rank>-end.json``
  after the last step (final loss), ``a<attempt>-r<rank>-exit.json`` after
  ``destroy_process_group``.
* ``--buckets param-order``: DDP's gradient buckets are built in parameter order before the
  first step and never rebuilt, which is what hotspare does at every join so that every rank
  reduces the same layout (``hotspare.recovery.frameworks``); torch's own (``ready-order``, the
  default) rebuilds them after the first step in the order the gradients became ready, so
  that the all-reduce of the last layers overlaps the backward pass of the first.
* ``--final-dir D``: after the last step (outside the timed span) each rank saves
  ``{"model": model.module.state_dict(), "optimizer": opt.state_dict()}`` to ``D/rank<r>.pt``.

Without ``--ckpt-dir`` it is plain DDP training with no fault tolerance at all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from ddp_workload import ddp_train, make_model  # noqa: E402  (examples/ddp_train.py + the sized model)
from torchrun_worker import load, newest_complete, record, save  # noqa: E402  (lost_time's baseline)

from hotspare import ElasticDataLoader  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="examples/ddp_train.py's training under plain torchrun (ddp_overhead)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True, help="directory for the timestamp records")
    p.add_argument("--ckpt-dir", help="checkpoint directory (omit: no checkpoints, plain training)")
    p.add_argument("--K", type=int, default=20, help="checkpoint every K steps")
    p.add_argument("--fail-step", type=int, default=-1, help="self-SIGKILL at the start of this step (-1: never)")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--final-dir", help="after the last step save each rank's model and optimizer state to "
                   "DIR/rank<r>.pt (outside the timed span), to compare runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (hotspare's default: 1)")
    p.add_argument("--buckets", choices=("ready-order", "param-order"), default="ready-order",
                   help="DDP's gradient buckets: torch's own (rebuilt after the first step in the order the "
                   "gradients became ready) or fixed in parameter order before the first step, as hotspare sets them")
    # the model's size (ddp_workload.make_model) and examples/ddp_train.py train()'s arguments
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16, help="per rank and micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


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

    # examples/ddp_train.py train(), line for line (session.data_loader -> the same loader, stand-alone)
    torch.manual_seed(a.seed)
    dataset = ddp_train.make_dataset(seed=a.seed)
    loader = ElasticDataLoader(dataset, a.batch_size * a.accum, shuffle=True, seed=a.seed, drop_last=True,
                               rank=rank, world_size=world)
    model = DDP(make_model(width=a.width, depth=a.depth))
    if a.buckets == "param-order":  # what hotspare does at every join (hotspare.recovery.frameworks.after_join)
        model.reducer._push_all_rebuilt_params()
        model.reducer._rebuild_buckets()  # collective: rank 0's layout on every rank
        model._has_rebuilt_buckets = True  # DDP never rebuilds them after the first step
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)

    start = 0
    resumed_from = None
    if ckpt_dir is not None:
        resumed_from = newest_complete(ckpt_dir, world)
        if resumed_from is not None:
            load(ckpt_dir, resumed_from, rank, model, opt, sched, loader)
            start = resumed_from + 1
    record(out, f"a{attempt}-r{rank}-start.json", t=time.time(), t_proc=t_proc, t_pg=t_pg,
           start_step=start, resumed_from=resumed_from, pid=os.getpid())

    total = float("nan")
    for step in range(start, a.steps):
        if step == a.fail_step and rank == a.fail_rank and attempt == 0:
            record(out, f"a{attempt}-r{rank}-kill.json", t=time.time(), step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(loader)
        opt.zero_grad()
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(a.accum), y.chunk(a.accum), strict=True)):
            last = i == a.accum - 1
            with contextlib.nullcontext() if last else model.no_sync():  # all-reduce once per step
                loss = F.mse_loss(model(xb), yb) / a.accum
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {total:.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)
        if ckpt_dir is not None and (step + 1) % a.K == 0 and step + 1 < a.steps:
            save(ckpt_dir, step, rank, model, opt, sched, loader)
    record(out, f"a{attempt}-r{rank}-end.json", t=time.time(), steps=a.steps, start_step=start,
           final_loss=total, pid=os.getpid())
    if a.final_dir:
        Path(a.final_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()},
                   Path(a.final_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
    record(out, f"a{attempt}-r{rank}-exit.json", t=time.time())
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: with the DDP wrapper still alive, it aborted 1 worker in
    # ~3 smoke runs here ("terminate called without an active exception", exit -6), which
    # torchrun takes for a failure and restarts -- a second attempt in a no-failure run
    os._exit(rc)
