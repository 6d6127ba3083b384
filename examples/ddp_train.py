"""The torchrun script torchrun_port/train_torchrun.py on hotspare, still with DDP: the
"after" of docs/user-guide.md.

Run it with:

    hotspare run examples/ddp_train.yaml

Diff it against torchrun_port/train_torchrun.py to see the port: the arguments become the
function's keyword arguments (set in ddp_train.yaml), DDP takes the session's process group,
the DistributedSampler + DataLoader become session.data_loader, the state is tracked, and
the final weights are written for you (hotspare.load_final(output_dir)).
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset


def make_dataset(n: int = 1024, features: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def make_model(features: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 1))


def train(session, batch_size: int = 16, accum: int = 2, lr: float = 1e-2, seed: int = 0,
          offload_dir: str | None = None) -> None:
    rank = dist.get_rank()
    torch.manual_seed(seed)

    dataset = make_dataset(seed=seed)
    loader = session.data_loader(dataset, batch_size=batch_size * accum, shuffle=True, seed=seed, drop_last=True)
    model = DDP(make_model(), process_group=session.process_group)
    if offload_dir:  # AdamW's moments on disk, bit-identical results (docs/user-guide.md, section 8)
        from hotspare import OffloadedAdamW

        opt = OffloadedAdamW(model, path=f"{offload_dir}/{session.node}-rank{rank}", lr=lr, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=session.total_steps)
    session.track(model=model, optimizer=opt, scheduler=sched)

    for step, (x, y) in zip(session.steps(), loader, strict=False):  # the loader is endless
        opt.zero_grad()
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            last = i == accum - 1
            with contextlib.nullcontext() if last else model.no_sync():  # all-reduce once per step
                loss = F.mse_loss(model(xb), yb) / accum
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        session.log(loss=total, lr=sched.get_last_lr()[0])
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {total:.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)
