"""The training process's library -- the Session API (:mod:`recovery.session`), where state
comes from after a failure (:mod:`recovery.restore`), state providers, lazy snapshots, the
reconfigurable process group -- plus the torch-free formats the agent shares with it: slot
files (:mod:`recovery.slotfile`), replica frames and their client (:mod:`recovery.wire`,
:mod:`recovery.replica_client`) and persisted checkpoints (:mod:`recovery.persist`,
:mod:`recovery.checkpoint_store`, :mod:`recovery.checkpoint_writer`).

Imports are lazy so that the agent can use the torch-free modules without importing torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Session": "recovery.session",
    "Fenced": "recovery.session",
    "Unrecoverable": "recovery.session",
    "ReconfigurableProcessGroup": "recovery.process_group",
    "StateProvider": "recovery.state",
    "load_final": "recovery.final",
    "load_checkpoint": "recovery.final",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
