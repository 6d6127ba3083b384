"""hotspare: fault-tolerant elastic training for PyTorch -- hot spares, in-memory replicas, no
restarts.

The one import package. A training script needs only this module::

    from hotspare import Session, ElasticSampler, load_final

    def train(session: Session, lr: float = 1e-3) -> None:
        ...
        loader = session.data_loader(dataset, batch_size=32, shuffle=True, num_workers=2)
        session.track(model=model, optimizer=opt)
        for step, batch in zip(session.steps(), loader):
            ...

The implementation lives in ``hotspare.orchestrator`` (control plane, CLI, launchers),
``hotspare.agents`` (node agent, worker process) and ``hotspare.recovery`` (the training
process's library and the formats): under one name that cannot collide with a user's own
``agents.py`` or ``recovery/``. Exports are lazy: ``import hotspare`` loads neither torch
nor etcd's client, so the CLI starts fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Session": "hotspare.recovery.session",
    "Fenced": "hotspare.recovery.session",
    "Unrecoverable": "hotspare.recovery.session",
    "ElasticSampler": "hotspare.recovery.sampler",
    "ElasticDataLoader": "hotspare.recovery.data",
    "UntrackedDataLoaderWarning": "hotspare.recovery.data",
    "StateProvider": "hotspare.recovery.state",
    "ReconfigurableProcessGroup": "hotspare.recovery.process_group",
    "OffloadedAdamW": "hotspare.recovery.offload",
    "OffloadError": "hotspare.recovery.offload_io",
    "vertical_step": "hotspare.recovery.offload_vertical",
    "load_final": "hotspare.recovery.final",
    "load_checkpoint": "hotspare.recovery.final",
    "JobSpec": "hotspare.orchestrator.spec",
    "load_spec": "hotspare.orchestrator.spec",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hotspare' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
