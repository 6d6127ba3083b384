"""A DDP job that uses the options a plain example does not: ``find_unused_parameters``
(a branch that skips a layer on odd steps), ``gradient_as_bucket_view``, and a BatchNorm
whose running statistics DDP broadcasts from rank 0 before each forward
(``broadcast_buffers``). Used by tests/e2e/test_frameworks.py."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.norm = nn.BatchNorm1d(32)
        self.skip = nn.Linear(32, 32)  # unused on odd steps
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, use_skip: bool) -> torch.Tensor:
        h = F.relu(self.norm(self.inp(x)))
        if use_skip:
            h = h + self.skip(h)
        return self.out(h)


def train(session, batch_size: int = 8, lr: float = 1e-2) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = session.data_loader(data, batch_size=batch_size, shuffle=True, seed=0, drop_last=True)
    model = DDP(Net(), process_group=session.process_group, find_unused_parameters=True,
                gradient_as_bucket_view=True, broadcast_buffers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    session.track(model=model, optimizer=opt)
    for step, (xb, yb) in zip(session.steps(), loader, strict=False):
        opt.zero_grad()
        loss = F.mse_loss(model(xb, use_skip=step % 2 == 0), yb)
        loss.backward()
        opt.step()
        session.log(loss=loss.item())
