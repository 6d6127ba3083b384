"""The smallest hotspare job: every step allreduces a tensor across the group.

Used by the control-plane tests and benchmarks: it checks that every completed step
saw every rank (sum of ranks) and can sleep per step to model compute.
"""

import time

import torch


def train(session, step_sleep: float = 0.02, size: int = 1024):
    for step in session.steps():
        x = torch.full((size,), float(session.rank + 1))
        ok = session.allreduce(x)
        if ok:
            expected = session.world_size * (session.world_size + 1) / 2
            assert x[0].item() == expected, f"step {step}: got {x[0].item()}, want {expected}"
        session.log(value=float(x[0].item()))
        time.sleep(step_sleep)
