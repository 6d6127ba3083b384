"""Launchers start a job's agents on some cluster. Registered by name; each backend's
module is imported only when used, so Slurm/Kubernetes/Ray libraries are optional."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol


class Launcher(Protocol):
    def launch(self, spec: dict, endpoints: list[str]) -> dict: ...


_REGISTRY: dict[str, str | Callable[[], Launcher]] = {"local": "orchestrator.launchers.local:LocalLauncher"}


def register(name: str, create: str | Callable[[], Launcher]) -> None:
    _REGISTRY[name] = create


def get(name: str) -> Launcher:
    if name not in _REGISTRY:
        raise KeyError(
            f"backend {name!r} is not registered (known: {', '.join(sorted(_REGISTRY))}). "
            "Did you forget to call orchestrator.launchers.register?"
        )
    create = _REGISTRY[name]
    if isinstance(create, str):
        mod, _, attr = create.partition(":")
        create = getattr(importlib.import_module(mod), attr)
    return create()
