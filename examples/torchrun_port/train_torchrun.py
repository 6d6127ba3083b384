"""An ordinary torchrun training script: the "before" of docs/user-guide.md.

A small regression model on a synthetic TensorDataset, sharded with a DistributedSampler,
trained with DDP, AdamW, a cosine LR schedule, gradient clipping and gradient accumulation.
Run it with:

    torchrun --nproc-per-node 2 examples/torchrun_port/train_torchrun.py --steps 100

../ddp_train.py is the same script on hotspare, still with DDP (diff the two files).
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(n: int = 1024, features: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def make_model(features: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)  # per rank and micro-batch
    p.add_argument("--accum", type=int, default=2)  # micro-batches per optimizer step
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="model.pt")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    dataset = make_dataset(seed=args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size * args.accum, sampler=sampler, drop_last=True)
    model = DDP(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            total = 0.0
            for i, (xb, yb) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum), strict=True)):
                last = i == args.accum - 1
                with contextlib.nullcontext() if last else model.no_sync():  # all-reduce once per step
                    loss = F.mse_loss(model(xb), yb) / args.accum
                    loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {total:.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)
            step += 1
            if step == args.steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
