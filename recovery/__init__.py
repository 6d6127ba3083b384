"""The training process's library -- the Session API (:mod:`hotspare.recovery.session`), where state
comes from after a failure (:mod:`hotspare.recovery.restore`), state providers, lazy snapshots, the
reconfigurable process group -- plus the torch-free formats the agent shares with it: slot
files (:mod:`hotspare.recovery.slotfile`), replica frames and their client (:mod:`hotspare.recovery.wire`,
:mod:`hotspare.recovery.replica_client`) and persisted checkpoints (:mod:`hotspare.recovery.persist`,
:mod:`hotspare.recovery.checkpoint_store`, :mod:`hotspare.recovery.checkpoint_writer`).

Imports are lazy so that the agent can use the torch-free modules without importing torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Session": "hotspare.recovery.session",
    "Fenced": "hotspare.recovery.session",
    "Unrecoverable": "hotspare.recovery.session",
    "ReconfigurableProcessGroup": "hotspare.recovery.process_group",
    "ElasticSampler": "hotspare.recovery.sampler",
    "ElasticDataLoader": "hotspare.recovery.data",
    "UntrackedDataLoaderWarning": "hotspare.recovery.data",
    "StateProvider": "hotspare.recovery.state",
    "OffloadedAdamW": "hotspare.recovery.offload",
    "OffloadError": "hotspare.recovery.offload_io",
    "vertical_step": "hotspare.recovery.offload_vertical",
    "load_final": "hotspare.recovery.final",
    "load_checkpoint": "hotspare.recovery.final",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
