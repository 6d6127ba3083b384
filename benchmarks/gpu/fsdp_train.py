"""examples/fsdp_train.py on a GPU, for benchmarks/gpu_check.py: the smallest diff (diff the
two files): a ``device`` argument ("cuda", or "cpu" for the check's --dry mode), the model and
each batch moved there; the session's mesh is a "cuda" mesh when the job's backend is NCCL.
Which GPU a rank uses: gpu_device.py.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gpu_device import pick_device
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset


def make_dataset(n: int = 1024, features: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def make_model(features: int = 16, hidden: int = 64, layers: int = 3) -> nn.Sequential:
    dims = [features] + [hidden] * layers
    blocks = [nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims, dims[1:], strict=False)]
    return nn.Sequential(*blocks, nn.Linear(hidden, 1))


def train(session, batch_size: int = 16, accum: int = 2, lr: float = 1e-2, seed: int = 0,
          device: str = "cuda") -> None:
    rank = dist.get_rank()
    dev = pick_device(device)
    torch.manual_seed(seed)

    dataset = make_dataset(seed=seed)
    loader = session.data_loader(dataset, batch_size=batch_size * accum, shuffle=True, seed=seed, drop_last=True)
    mesh = session.device_mesh
    assert mesh.device_type == dev.type, (mesh.device_type, dev)  # nccl <-> cuda, gloo <-> cpu
    model = make_model().to(dev)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=session.total_steps)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[10])
    session.track(model=model, optimizer=opt, scheduler=sched)

    for step, (x, y) in zip(session.steps(), loader, strict=False):  # the loader is endless
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            model.set_requires_gradient_sync(i == accum - 1)  # reduce-scatter once per step
            loss = F.mse_loss(model(xb), yb) / accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        session.log(loss=total, lr=sched.get_last_lr()[0])
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {total:.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)
