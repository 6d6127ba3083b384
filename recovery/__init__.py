"""In the training process: the Session API, state providers, lazy snapshots, the
reconfigurable process group, and the replica wire protocol.

Imports are lazy so that the agent can use :mod:`recovery.wire` without importing torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Session": "recovery.session",
    "Fenced": "recovery.session",
    "ReconfigurableProcessGroup": "recovery.process_group",
    "StateProvider": "recovery.state",
    "load_final": "recovery.final",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
