"""The workload of benchmarks/ddp_overhead.py: ``examples/ddp_train.py`` with a bigger model.

``examples/ddp_train.py:train`` is run *unchanged* (DDP on ``session.process_group``,
``no_sync`` gradient accumulation, AdamW, cosine schedule, clipping, ``session.data_loader``);
only the model it builds is wider and deeper, so that a step takes tens of milliseconds
instead of one. :func:`make_model` with ``width=64, depth=1`` is the example's own model,
layer for layer (the same parameters from the same seed).

* hotspare: the job's entrypoint is ``benchmarks/ddp_workload.py:train`` with
  ``args: {width, depth, batch_size, accum, lr, seed}``; :func:`train` swaps
  ``ddp_train.make_model`` for :func:`make_model` of that size while the example's
  ``train`` runs (a hotspare worker runs one job, so nothing else sees the swap).
* torchrun: ``benchmarks/ddp_torchrun_worker.py`` imports :func:`make_model` from here and
  ``make_dataset`` from the example, and does the example's training step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.nn as nn

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import ddp_train  # noqa: E402  (examples/ddp_train.py: the training loop and the dataset)

FEATURES = 16  # ddp_train.make_dataset's default: the inputs' width


def make_model(features: int = FEATURES, width: int = 64, depth: int = 1) -> nn.Module:
    """``depth`` hidden layers of ``width`` units (ReLU) and one output: ddp_train's
    ``make_model`` for ``width=64, depth=1``. Layers are created in the example's order, so
    the same seed gives the same initial weights."""
    layers: list[nn.Module] = [nn.Linear(features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def n_params(width: int, depth: int, features: int = FEATURES) -> int:
    return sum(p.numel() for p in make_model(features, width, depth).parameters())


@contextmanager
def sized_model(width: int, depth: int) -> Iterator[None]:
    """While inside, ``ddp_train.make_model()`` builds :func:`make_model` of this size."""
    original = ddp_train.make_model

    def sized(features: int = FEATURES) -> nn.Module:
        return make_model(features, width, depth)

    ddp_train.make_model = sized
    try:
        yield
    finally:
        ddp_train.make_model = original


def train(session: Any, width: int = 64, depth: int = 1, **args: Any) -> None:
    """The hotspare entrypoint: ``examples/ddp_train.py:train(session, **args)`` with a model of
    ``width`` x ``depth``."""
    with sized_model(width, depth):
        ddp_train.train(session, **args)
