"""One agent per node: lease, worker supervision, warm hot spares, chaos execution.

The agent (:mod:`hotspare.agents.agent`) and its helpers (``agents.node_*``, :mod:`hotspare.agents.replica`,
:mod:`hotspare.agents.persist`) are the node's process; :mod:`hotspare.agents.worker` is the training
process it starts, and :mod:`hotspare.agents.worker_link` the contract between the two. ``Agent`` is
imported on first use, so that a worker (``python -m hotspare.agents.worker``) never loads the
agent's code.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hotspare.orchestrator.store import Store

    from .agent import Agent

__all__ = ["Agent", "store_from_env"]


def _store_from_env(env: dict[str, str] | None = None) -> Store:
    from hotspare.orchestrator.store import Store

    return Store.from_env(env=env)


def __getattr__(name: str) -> Any:
    if name == "Agent":
        from .agent import Agent

        return Agent
    if name == "store_from_env":
        warnings.warn("agents.store_from_env is deprecated: use hotspare.orchestrator.store.Store.from_env",
                      DeprecationWarning, stacklevel=2)
        return _store_from_env
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
