"""Launchers start a job's controller, agents (and, where needed, etcd) on some cluster.

Backends are registered by name; each backend's module is imported only when used, so the
Slurm, Kubernetes and Ray libraries stay optional. A launcher is given the resolved spec
(a :class:`~hotspare.orchestrator.spec.JobSpec` whose ``output_dir`` is filled in and whose etcd
password is dropped) and the etcd endpoints:

* endpoints given (``--etcd``, ``$HOTSPARE_ETCD``, the spec's ``etcd.endpoints``, or the
  embedded etcd for the local backend): the CLI has already registered the job in that etcd;
  the launcher only starts processes.
* ``endpoints == []``: the backend brings etcd up itself (inside the Slurm allocation, as a
  StatefulSet in Kubernetes, ...). The job is then registered from inside the cluster by
  ``hotspare controller --register SPEC.json`` and the launcher says where the endpoints will
  appear (``info["endpoints_file"]``, a path the allocation writes, or ``info["endpoints"]``).

``launch`` returns a JSON-able ``info`` dict that the CLI keeps in
``<state-dir>/launched/<job>.json`` and passes back to ``describe`` / ``cancel``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ..spec import JobSpec
from ..util import atomic_write

#: What a job that brought its own etcd leaves in its output_dir as it ends (`hotspare status
#: --json` and `hotspare events --json`), so that status, events and wait still answer once
#: the allocation and its etcd are gone.
LEFT_BEHIND = ("final-status.json", "final-events.json")


class LaunchError(Exception):
    """The backend could not start the job (a missing tool, a scheduler refusal, ...)."""


class Launcher(Protocol):
    #: True if the backend can start its own etcd when the spec names none.
    brings_etcd: bool

    def render(self, spec: JobSpec, endpoints: list[str]) -> str:
        """What ``hotspare submit --dry-run`` prints: the script / manifests, human-readable."""

    def launch(self, spec: JobSpec, endpoints: list[str]) -> dict:
        """Start the job's processes; returns ``info`` (scheduler ids, log dir, ...)."""

    def describe(self, info: dict) -> str | None:
        """One line of scheduler-side state (``squeue``, pod phases, ...), or None."""

    def ended(self, info: dict) -> bool:
        """True once the scheduler-side job is gone (finished, failed, cancelled)."""

    def cancel(self, info: dict) -> str | None:
        """Release the scheduler's resources (after etcd was told to cancel); says what it did."""

    # optional, for a backend whose agents are processes of this machine (local):
    # exited(info) -> {node: the last line of its log} of the agents that have exited


_REGISTRY: dict[str, str | Callable[[], Launcher]] = {
    "local": "hotspare.orchestrator.launchers.local:LocalLauncher",
    "slurm": "hotspare.orchestrator.launchers.slurm:SlurmLauncher",
    "kubernetes": "hotspare.orchestrator.launchers.kubernetes:KubernetesLauncher",
    "ray": "hotspare.orchestrator.launchers.ray:RayLauncher",
}


def register(name: str, create: str | Callable[[], Launcher]) -> None:
    _REGISTRY[name] = create


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> Launcher:
    if name not in _REGISTRY:
        raise KeyError(
            f"backend {name!r} is not registered (known: {', '.join(sorted(_REGISTRY))}). "
            "Did you forget to call hotspare.orchestrator.launchers.register?"
        )
    create = _REGISTRY[name]
    if isinstance(create, str):
        mod, _, attr = create.partition(":")
        create = getattr(importlib.import_module(mod), attr)
    return create()


# -- where launched jobs are remembered (so status/logs/cancel find them later) --------------
def record_path(state_dir: Path, job: str) -> Path:
    return state_dir / "launched" / f"{job}.json"


def save_record(state_dir: Path, job: str, record: dict) -> None:
    p = record_path(state_dir, job)
    p.parent.mkdir(parents=True, exist_ok=True)
    # whole or absent: `hotspare status` may read it while `submit` writes (mode as write_text's)
    atomic_write(p, json.dumps(record, indent=1, sort_keys=True), fsync=False, mode=0o666)


def load_record(state_dir: Path, job: str) -> dict | None:
    p = record_path(state_dir, job)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def record_endpoints(record: dict) -> list[str]:
    """The etcd endpoints of a launched job: given at submit, or written by the allocation."""
    if record.get("endpoints"):
        return list(record["endpoints"])
    f = record.get("info", {}).get("endpoints_file")
    if f:
        try:
            return [e for e in Path(f).read_text().strip().split(",") if e]
        except OSError:
            return []
    return []


def left_behind(record: dict | None, name: str) -> dict | None:
    """One of LEFT_BEHIND for a launched job, or None (absent, or cut short as it was written)."""
    if record is None:
        return None
    try:
        data = json.loads((Path(record["output_dir"]) / name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
