"""What a job spec is: the frozen dataclasses every process shares, and their JSON form.

Part of :mod:`hotspare.orchestrator.spec` (import the names from there). Split out so that the field
validators (:mod:`hotspare.orchestrator.spec_fields`) can build these types while ``spec`` keeps the
loading API: the chain is ``spec_model`` <- ``spec_fields`` <- ``spec``, with no cycle.
Standard library only.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: What the controller does when a node dies and no spare node is left.
ON_NO_SPARE_POLICIES: tuple[str, ...] = ("wait", "shrink", "fail")
#: What the controller does when the training function raises (a code failure).
ON_CODE_ERROR_POLICIES: tuple[str, ...] = ("fail", "retry")
#: Where worker nodes come from.
BACKENDS: tuple[str, ...] = ("local", "slurm", "kubernetes", "ray")
#: Options of each backend's section (``slurm:``, ``kubernetes:``, ``ray:``): name -> (type, help).
#: Types: str, int, float, strlist (list of strings), strmap (mapping of string to string),
#: strfloat (mapping of string to a number).
BACKEND_OPTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "slurm": {
        "partition": ("str", "partition to submit to (sbatch --partition)"),
        "account": ("str", "account to charge (sbatch --account)"),
        "qos": ("str", "quality of service (sbatch --qos)"),
        "time": ("str", "time limit, e.g. '02:00:00' (sbatch --time)"),
        "cpus_per_node": ("int", "CPUs to request per node (sbatch --cpus-per-task)"),
        "gpus_per_node": ("int", "GPUs to request per node (sbatch --gpus-per-node)"),
        "sbatch_args": ("strlist", "extra sbatch options, e.g. ['--exclusive']"),
        "setup": ("str", "shell lines run first on every node, e.g. 'source ~/venv/bin/activate'"),
        "python": ("str", "python that has hotspare installed (default: the submitting one)"),
    },
    "kubernetes": {
        "namespace": ("str", "namespace to create the job's objects in (default: default)"),
        "image": ("str", "container image with hotspare (see docker/; default: hotspare:cpu)"),
        "image_pull_policy": ("str", "Always, IfNotPresent or Never (default: IfNotPresent)"),
        "cpu": ("str", "CPU request/limit per agent pod, e.g. '4'"),
        "memory": ("str", "memory request/limit per agent pod, e.g. '16Gi'"),
        "gpus": ("int", "nvidia.com/gpu per agent pod"),
        "shm_size": ("str", "size of the /dev/shm volume for snapshots (default: 2Gi)"),
        "node_selector": ("strmap", "node labels agent pods must run on"),
        "etcd_image": ("str", "image of the in-cluster etcd (when the spec names no etcd)"),
        "output_pvc": ("str", "PersistentVolumeClaim mounted at output_dir (default: emptyDir)"),
    },
    "ray": {
        "address": ("str", "Ray cluster address (default: auto, i.e. the running cluster)"),
        "namespace": ("str", "Ray namespace of the job's actors (default: hotspare-<name>)"),
        "num_cpus": ("float", "CPUs each agent actor reserves (default: 1)"),
        "resources": ("strfloat", "custom resources each agent actor needs, e.g. {trainer: 1}"),
    },
}


class SpecError(ValueError):
    """A job spec is invalid; the message names the field, the bad value and the fix.

    It subclasses ``ValueError`` so generic callers can treat it as bad input, while the CLI can
    catch it specifically and print just the message (no traceback): the message is written to be
    the whole user-facing explanation. ``field`` and ``source`` are kept separately so that tools
    can highlight the offending field or file without re-parsing the text.
    """

    def __init__(self, reason: str, *, field: str | None = None, source: str | None = None) -> None:
        self.reason = reason
        self.field = field
        self.source = source
        super().__init__(": ".join(p for p in (source, field, reason) if p))

    def with_source(self, source: str) -> SpecError:
        """Return the same error attributed to ``source`` (a file path), unless it already is."""
        if self.source is not None:
            return self
        return SpecError(self.reason, field=self.field, source=source)



# --------------------------------------------------------------------------------------------
# Dataclasses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosEntry:
    """One scheduled fault: at training step ``at_step`` do ``action`` to a rank / node / service.

    Faults are part of the spec (rather than a separate tool) so a recovery demo or benchmark is
    reproducible from a single file.
    """

    at_step: int
    action: str
    rank: int | None = None
    node: str | None = None
    #: Duration for hang-rank / partition-node (``None``: until recovery kicks in);
    #: for slow-rank, the extra delay added to every step.
    seconds: float | None = None
    #: A recovery phase (:data:`hotspare.orchestrator.chaos.PHASES`): fire inside the first
    #: recovery that reaches it at or after ``at_step`` instead of at the start of that step.
    during: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; every field is present so ``from_dict`` needs no defaults."""
        return {
            "at_step": self.at_step,
            "action": self.action,
            "rank": self.rank,
            "node": self.node,
            "seconds": self.seconds,
            "during": self.during,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChaosEntry:
        """Rebuild from :meth:`to_dict` output without re-validating (trusted input)."""
        return cls(**_known_kwargs(cls, d, "chaos"))


@dataclass(frozen=True)
class EtcdConfig:
    """Where the coordination store lives; no endpoints means the controller embeds its own.

    Embedded is the default so that ``hotspare run`` works on a laptop with zero setup; a real
    cluster points at an external, replicated etcd so the control plane itself survives faults.
    """

    endpoints: tuple[str, ...] = ()
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    # Kept out of repr so that logging a spec does not leak the credential.
    password: str | None = field(default=None, repr=False)

    @property
    def embedded(self) -> bool:
        """True when the controller should start (and own) an etcd of its own."""
        return not self.endpoints

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (endpoints as a list); every field is present."""
        return {
            "endpoints": list(self.endpoints),
            "ca_cert": self.ca_cert,
            "cert": self.cert,
            "key": self.key,
            "user": self.user,
            "password": self.password,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EtcdConfig:
        """Rebuild from :meth:`to_dict` output without re-validating (trusted input)."""
        kwargs = _known_kwargs(cls, d, "etcd")
        if "endpoints" in kwargs:
            kwargs["endpoints"] = tuple(kwargs["endpoints"])
        return cls(**kwargs)


@dataclass(frozen=True)
class JobSpec:
    """A validated job. Build it with :func:`load_spec` / :func:`parse_spec`, not directly.

    Paths (``entrypoint`` file, ``output_dir``, etcd TLS files) are already absolute, so the spec
    means the same thing on every host and in every working directory it is shipped to.
    """

    name: str
    entrypoint: str
    ranks: int
    steps: int
    spares: int = 1
    ranks_per_node: int = 1
    args: dict[str, Any] = field(default_factory=dict)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    lease_ttl: float = 5.0
    hang_timeout: float = 60.0
    on_no_spare: str = "wait"
    min_ranks: int = 1
    #: A Python exception in the training function is a *code* failure: ``fail`` ends the job
    #: at once with the traceback; ``retry`` restores the rank on a spare up to
    #: ``code_error_retries`` times in the job's life, then fails.
    on_code_error: str = "fail"
    code_error_retries: int = 2
    #: Crash-loop guards, for every kind of failure: more than ``max_failures`` failures within
    #: ``failure_window`` seconds fail the job, and so does one seat failing at the same step
    #: ``crash_loop_limit`` times in a row (each restore leading to the same failure).
    max_failures: int = 20
    failure_window: float = 3600.0
    crash_loop_limit: int = 3
    replicas: int = 1
    #: Replication points: candidate steps are every ``replicate_every``-th; of those, the
    #: ranks replicate the first that comes ``replicate_interval`` seconds or more after the
    #: previous point (default 5; 0: every candidate). A node loss rolls back to the last point (a
    #: worker crash only to its last step), so this weighs the work a node loss loses (about
    #: max(replicate_every steps, replicate_interval)) against what replicating costs (a copy
    #: over the network and agent CPU per point).
    replicate_every: int = 10
    replicate_interval: float = 5.0
    #: Persistent tier: every N steps (a multiple of replicate_every; 0 = off) each rank's
    #: snapshot is flushed to persist_path (default <output_dir>/checkpoints), through
    #: persist_local_dir (fast local disk) if set; the newest persist_keep are kept.
    persist_every: int = 0
    persist_path: str | None = None
    persist_local_dir: str | None = None
    persist_keep: int = 2
    #: Bytes of shared memory (the snapshot directory, /dev/shm) one node's snapshots and
    #: replicas may take; None: as much as the filesystem has free. A job that would need
    #: more fails at its start (hotspare.recovery.shm_budget).
    shm_budget: int | None = None
    straggler_threshold: float = 2.0
    on_straggler: str = "report"
    output_dir: str | None = None
    backend: str = "local"
    env: dict[str, str] = field(default_factory=dict)
    chaos: tuple[ChaosEntry, ...] = ()
    #: Backend options (only the section of the chosen backend is used); see BACKEND_OPTIONS.
    slurm: dict[str, Any] = field(default_factory=dict)
    kubernetes: dict[str, Any] = field(default_factory=dict)
    ray: dict[str, Any] = field(default_factory=dict)
    #: Set by ``submit``, never by the user (not accepted in YAML): the id of this submission
    #: of the job name, which processes, replicas and checkpoints of the run are keyed on ...
    run_id: str = ""
    #: ... and the run whose newest complete persisted checkpoint this one starts from
    #: (``hotspare run --resume``); "" starts from step 0.
    resume_from: str = ""

    @property
    def nodes(self) -> int:
        """Active nodes needed to host all ranks (the last one may be partly filled)."""
        return -(-self.ranks // self.ranks_per_node)

    @property
    def total_nodes(self) -> int:
        """Nodes to provision: the active ones plus the hot spares."""
        return self.nodes + self.spares

    @property
    def replication_enabled(self) -> bool:
        """``replicas: 0`` turns off replication points, and with them the persistent tier
        (a point is what the agent persists)."""
        return self.replicas > 0

    @property
    def point_every(self) -> int:
        """Steps between replication points; 0 when replication is off."""
        return self.replicate_every if self.replication_enabled else 0

    @property
    def persist_base(self) -> str:
        """Where every run's checkpoints live: ``persist_path``, else ``<output_dir>/checkpoints``."""
        return self.persist_path or str(Path(self.output_dir or ".") / "checkpoints")

    @property
    def persist_root(self) -> str:
        """This run's checkpoints: ``<persist_base>/<run_id>`` (the base itself for a spec
        without a run id). A run writes, prunes and restores only here, never another run's."""
        return _under(self.persist_base, self.run_id) if self.run_id else self.persist_base

    @property
    def resume_root(self) -> str | None:
        """The checkpoints of the run this one resumes (``resume_from``), or None."""
        return _under(self.persist_base, self.resume_from) if self.resume_from else None

    @property
    def log_dir(self) -> Path:
        """Agents' and workers' log files: ``<output_dir>/logs``."""
        return Path(self.output_dir or ".") / "logs"

    def __getitem__(self, key: str) -> Any:
        """Deprecated: ``session.spec`` used to be a dict. Read attributes (``spec.steps``)."""
        warnings.warn(f"spec[{key!r}] is deprecated: the spec is a JobSpec, read spec.{key}",
                      DeprecationWarning, stacklevel=2)
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return self.to_dict()[key]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict that :meth:`from_dict` turns back into an equal spec."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "etcd":
                value = value.to_dict()
            elif f.name == "chaos":
                value = [c.to_dict() for c in value]
            elif f.name in ("args", "env", "slurm", "kubernetes", "ray"):
                value = copy.deepcopy(value)
            out[f.name] = value
        return out

    def to_json(self, indent: int | None = None) -> str:
        """The spec as JSON, the form in which it is stored in etcd and handed to agents."""
        return json.dumps(self.to_dict(), indent=indent)

    def digest(self) -> str:
        """SHA-256 of the spec's canonical JSON: what a launcher hands its agents so that they
        run the spec that was validated at submit, not whatever etcd holds by then."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobSpec:
        """The spec as stored in etcd (:meth:`to_json`) back as a ``JobSpec``."""
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobSpec:
        """Rebuild from :meth:`to_dict` output.

        The input is trusted (it was validated where it was produced), so nothing is re-checked
        and paths are kept as they are -- an entrypoint file that exists on the submitting host
        need not exist on the host decoding the spec.
        """
        kwargs = _known_kwargs(cls, d, "spec")
        if isinstance(kwargs.get("etcd"), Mapping):
            kwargs["etcd"] = EtcdConfig.from_dict(kwargs["etcd"])
        if "chaos" in kwargs:
            kwargs["chaos"] = tuple(
                c if isinstance(c, ChaosEntry) else ChaosEntry.from_dict(c) for c in kwargs["chaos"]
            )
        if "args" in kwargs:
            kwargs["args"] = copy.deepcopy(dict(kwargs["args"]))
        for key in ("env", "slurm", "kubernetes", "ray"):
            if key in kwargs:
                kwargs[key] = copy.deepcopy(dict(kwargs[key]))
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise SpecError(f"from_dict: missing field {missing[0]!r}")
        return cls(**kwargs)


def _known_kwargs(cls: type, d: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Reject keys the dataclass does not have: in trusted input they mean version skew."""
    if not isinstance(d, Mapping):
        raise SpecError(f"from_dict: {what} must be a mapping, got {yaml_shape(d)}")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in d:
        if key not in names:
            raise SpecError(f"from_dict: unknown {what} field {key!r}")
    return dict(d)


def yaml_shape(value: Any) -> str:
    """Short description of a value's YAML shape, for "expected X, got Y" messages."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _under(base: str, name: str) -> str:
    """``base/name`` for a directory or an fsspec URL."""
    return f"{base.rstrip('/')}/{name}" if "://" in base else str(Path(base) / name)
