"""An ordinary torchrun FSDP2 script: the "before" of examples/fsdp_train.py.

A small MLP on a synthetic TensorDataset, each Linear layer sharded with FSDP2
(``fully_shard``) over a CPU device mesh, trained with AdamW, a warm-up + cosine LR schedule,
gradient clipping and gradient accumulation. Run it with:

    torchrun --nproc-per-node 2 examples/torchrun_port/fsdp_torchrun.py --steps 100
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(n: int = 1024, features: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def make_model(features: int = 16, hidden: int = 64, layers: int = 3) -> nn.Sequential:
    dims = [features] + [hidden] * layers
    blocks = [nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims, dims[1:], strict=False)]
    return nn.Sequential(*blocks, nn.Linear(hidden, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)  # per rank and micro-batch
    p.add_argument("--accum", type=int, default=2)  # micro-batches per optimizer step
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    dataset = make_dataset(seed=args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size * args.accum, sampler=sampler, drop_last=True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[10])

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            total = 0.0
            for i, (xb, yb) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum), strict=True)):
                model.set_requires_gradient_sync(i == args.accum - 1)  # reduce-scatter once per step
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

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
