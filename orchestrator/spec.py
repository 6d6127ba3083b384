"""Job specification: the one YAML file a user writes to describe a fault-tolerant training job.

Why this module exists and looks the way it does:

* Every other component (controller, node agents, chaos injector, CLI) needs the same validated
  view of the job, so the spec is parsed once, here, into frozen dataclasses and shipped around as
  JSON (``to_dict``/``to_json``/``from_dict``) instead of being re-parsed from YAML on each host.
* A mistake in the spec should fail fast on the user's laptop, not minutes later on a cluster, so
  validation is strict (unknown keys are errors) and every :class:`SpecError` says which field is
  wrong, what value it had and how to fix it.
* It must be importable by light-weight processes (the controller, the CLI) that never touch a
  GPU, so it depends only on the standard library and PyYAML -- never on torch.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import keyword
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "BACKENDS",
    "CHAOS_ACTIONS",
    "NODE_ACTIONS",
    "ON_NO_SPARE_POLICIES",
    "RANK_ACTIONS",
    "ChaosEntry",
    "EtcdConfig",
    "JobSpec",
    "SpecError",
    "load_spec",
    "parse_overrides",
    "parse_spec",
]

#: Every fault the chaos injector knows how to cause, in the spelling used in YAML.
CHAOS_ACTIONS: tuple[str, ...] = (
    "kill-rank",
    "kill-node",
    "hang-rank",
    "slow-rank",
    "partition-node",
    "kill-controller",
    "restart-etcd",
    "corrupt-checkpoint",
)
#: Actions aimed at one training process; they need ``rank``. corrupt-checkpoint damages
#: that rank's file in the newest complete persisted checkpoint (spec-only: for testing
#: that recovery refuses it and falls back to an older one).
RANK_ACTIONS: tuple[str, ...] = ("kill-rank", "hang-rank", "slow-rank", "corrupt-checkpoint")
#: Actions aimed at a whole node; it is named directly (``node``) or via a rank it hosts (``rank``).
NODE_ACTIONS: tuple[str, ...] = ("kill-node", "partition-node")
#: Actions aimed at the control plane; they take no target.
CONTROL_ACTIONS: tuple[str, ...] = ("kill-controller", "restart-etcd")
#: Actions for which ``seconds`` means something (a duration, or for slow-rank a per-step delay).
_TIMED_ACTIONS: tuple[str, ...] = ("hang-rank", "slow-rank", "partition-node")

#: What the controller does when a node dies and no spare node is left.
ON_NO_SPARE_POLICIES: tuple[str, ...] = ("wait", "shrink", "fail")
#: Where worker nodes come from.
BACKENDS: tuple[str, ...] = ("local", "slurm", "kubernetes", "ray")
#: Options of each backend's section (``slurm:``, ``kubernetes:``, ``ray:``): name -> (type, help).
#: Types: str, int, float, strlist (list of strings), strmap (mapping of string to string).
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

# DNS-label rules: the name ends up in etcd keys, k8s object names and Slurm job names, and this is
# the strictest of those.
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_EXAMPLE_ENDPOINT = "http://127.0.0.1:2379"


class _Missing:
    """Sentinel type so that ``None`` can be told apart from "key absent"."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; every field is present so ``from_dict`` needs no defaults."""
        return {
            "at_step": self.at_step,
            "action": self.action,
            "rank": self.rank,
            "node": self.node,
            "seconds": self.seconds,
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
    replicas: int = 1
    replicate_every: int = 10
    #: Persistent tier: every N steps (a multiple of replicate_every; 0 = off) each rank's
    #: snapshot is flushed to persist_path (default <output_dir>/checkpoints), through
    #: persist_local_dir (fast local disk) if set; the newest persist_keep are kept.
    persist_every: int = 0
    persist_path: str | None = None
    persist_local_dir: str | None = None
    persist_keep: int = 2
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
    def persist_root(self) -> str:
        """Where complete checkpoints live: ``persist_path``, else ``<output_dir>/checkpoints``."""
        return self.persist_path or str(Path(self.output_dir or ".") / "checkpoints")

    @property
    def log_dir(self) -> Path:
        """Agents' and workers' log files: ``<output_dir>/logs``."""
        return Path(self.output_dir or ".") / "logs"

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
        raise SpecError(f"from_dict: {what} must be a mapping, got {_kind(d)}")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in d:
        if key not in names:
            raise SpecError(f"from_dict: unknown {what} field {key!r}")
    return dict(d)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which PyYAML would otherwise silently resolve
    to the last one (a second ``ranks:`` further down a file is a classic hard-to-see bug)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable key: let SafeLoader report it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (keep only one)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_spec(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """Read, override and validate a YAML job spec.

    Relative paths inside the file are resolved against the file's own directory, so a spec works
    the same whichever directory ``hotspare`` is started from. ``overrides`` (from the CLI's
    ``--set key=value``) are applied to the raw mapping before validation so they are checked
    exactly like values written in the file; dotted keys (``args.lr``) reach into mappings.
    Every error message starts with the file path.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise SpecError("no such file", source=source) from None
    except IsADirectoryError:
        raise SpecError("is a directory, expected a YAML file", source=source) from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"not UTF-8 text ({exc.reason})", source=source) from None
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror or exc}", source=source) from None

    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds no objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "syntax error"
        raise SpecError(f"invalid YAML{where}: {problem}", source=source) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"invalid YAML: {exc}", source=source) from None

    if data is None:
        raise SpecError(
            "file is empty; expected a mapping with at least name, entrypoint, ranks and steps",
            source=source,
        )
    if not isinstance(data, Mapping):
        raise SpecError(
            f"top level must be a mapping of field: value, got {_kind(data)}", source=source
        )
    if overrides:
        try:
            data = _apply_overrides(data, overrides)
        except SpecError as exc:
            raise exc.with_source(source) from None
    base_dir = os.path.dirname(os.path.abspath(source))
    return parse_spec(data, base_dir=base_dir, source=source)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Turn CLI ``--set key=value`` strings into an overrides mapping for :func:`load_spec`.

    Values are parsed as YAML so ``ranks=8`` gives an int and ``chaos=[]`` a list, exactly as if
    written in the file; text that is not valid YAML is kept as a plain string.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(f"--set {item!r}: expected key=value, e.g. --set ranks=8")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        out[key] = value
    return out


def _apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``data`` with overrides set; ``a.b`` sets key ``b`` inside mapping ``a``."""
    result: dict[str, Any] = copy.deepcopy(dict(data))
    for dotted, value in overrides.items():
        if not isinstance(dotted, str) or not dotted or any(not p for p in dotted.split(".")):
            raise SpecError(f"override key must be a non-empty dotted name, got {dotted!r}")
        parts = dotted.split(".")
        target: dict[str, Any] = result
        for depth, part in enumerate(parts[:-1]):
            child = target.get(part)
            if child is None:
                child = {}
            elif isinstance(child, Mapping):
                child = dict(child)
            else:
                prefix = ".".join(parts[: depth + 1])
                raise SpecError(
                    f"override {dotted!r}: {prefix} is {child!r}, not a mapping "
                    f"(override {prefix} as a whole instead)"
                )
            target[part] = child
            target = child
        target[parts[-1]] = copy.deepcopy(value)
    return result


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

_JOB_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobSpec))
_JOB_REQUIRED: dict[str, str] = {
    "name": "my-job",
    "entrypoint": "train.py:train",
    "ranks": "4",
    "steps": "1000",
}
_CHAOS_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ChaosEntry))
_CHAOS_REQUIRED: dict[str, str] = {"at_step": "100", "action": "kill-rank"}
_ETCD_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EtcdConfig))


def parse_spec(
    data: Mapping[str, Any], base_dir: str | os.PathLike[str] = ".", source: str = "<spec>"
) -> JobSpec:
    """Validate a raw mapping (e.g. parsed YAML) into a :class:`JobSpec`.

    ``base_dir`` anchors relative paths (the spec file's directory when called from
    :func:`load_spec`); ``source`` prefixes every error so the user knows which file is wrong.
    Checks run in a fixed order -- unknown keys, required keys, then each field in declaration
    order -- and the first failure is raised, so the same bad file always gives the same message.
    ``data`` is not modified.
    """
    try:
        return _parse_job(data, os.path.abspath(os.fspath(base_dir)))
    except SpecError as exc:
        raise exc.with_source(source) from None


def _parse_job(data: Mapping[str, Any], base_dir: str) -> JobSpec:
    if not isinstance(data, Mapping):
        raise SpecError(f"top level must be a mapping of field: value, got {_kind(data)}")
    _check_keys(data, _JOB_FIELDS, where=None)
    _check_required(data, _JOB_REQUIRED, where=None)

    defaults = {f.name: f for f in dataclasses.fields(JobSpec)}

    def opt(key: str) -> Any:
        if key in data:
            return data[key]
        # Collection fields (default_factory) read as None, which their parsers turn into the
        # empty default.
        default = defaults[key].default
        return None if default is dataclasses.MISSING else default

    def default_of(key: str) -> Any:
        return defaults[key].default

    name = _parse_name(data["name"])
    entrypoint = _parse_entrypoint(data["entrypoint"], base_dir)
    ranks = _parse_int("ranks", data["ranks"], minimum=1)
    steps = _parse_int("steps", data["steps"], minimum=1)
    spares = _parse_int("spares", opt("spares"), minimum=0, default=default_of("spares"))
    ranks_per_node = _parse_int(
        "ranks_per_node", opt("ranks_per_node"), minimum=1, default=default_of("ranks_per_node")
    )
    args = _parse_args(opt("args"))
    etcd = _parse_etcd(opt("etcd"), base_dir)
    lease_ttl = _parse_seconds(
        "lease_ttl", opt("lease_ttl"), minimum=1.0, default=default_of("lease_ttl")
    )
    hang_timeout = _parse_seconds(
        "hang_timeout", opt("hang_timeout"), above=0.0, default=default_of("hang_timeout")
    )
    on_no_spare = _parse_choice(
        "on_no_spare", opt("on_no_spare"), ON_NO_SPARE_POLICIES, default=default_of("on_no_spare")
    )
    min_ranks = _parse_int(
        "min_ranks", opt("min_ranks"), minimum=1, default=default_of("min_ranks")
    )
    if min_ranks > ranks:
        raise SpecError(
            f"must be <= ranks ({ranks}), got {min_ranks} (lower min_ranks or raise ranks)",
            field="min_ranks",
        )
    replicas = _parse_int("replicas", opt("replicas"), minimum=0, default=default_of("replicas"))
    replicate_every = _parse_int(
        "replicate_every", opt("replicate_every"), minimum=1, default=default_of("replicate_every")
    )
    persist_every = _parse_int("persist_every", opt("persist_every"), minimum=0,
                               default=default_of("persist_every"))
    if persist_every and persist_every % replicate_every:
        raise SpecError(
            f"must be a multiple of replicate_every ({replicate_every}), got {persist_every} "
            f"(persisted steps are replication points; e.g. persist_every: {replicate_every * 5})",
            field="persist_every",
        )
    persist_path = _parse_persist_path(opt("persist_path"), base_dir)
    persist_local_dir = _parse_output_dir(opt("persist_local_dir"), base_dir, "persist_local_dir")
    persist_keep = _parse_int("persist_keep", opt("persist_keep"), minimum=1, default=default_of("persist_keep"))
    straggler_threshold = _parse_ratio("straggler_threshold", opt("straggler_threshold"))
    on_straggler = _parse_choice(
        "on_straggler", opt("on_straggler"), ("report", "replace"), default=default_of("on_straggler")
    )
    output_dir = _parse_output_dir(opt("output_dir"), base_dir)
    backend = _parse_choice("backend", opt("backend"), BACKENDS, default=default_of("backend"))
    env = _parse_env(opt("env"))
    chaos = _parse_chaos(opt("chaos"), ranks=ranks, steps=steps)
    backend_opts = {b: _parse_backend_options(b, opt(b)) for b in ("slurm", "kubernetes", "ray")}

    return JobSpec(
        name=name,
        entrypoint=entrypoint,
        ranks=ranks,
        steps=steps,
        spares=spares,
        ranks_per_node=ranks_per_node,
        args=args,
        etcd=etcd,
        lease_ttl=lease_ttl,
        hang_timeout=hang_timeout,
        on_no_spare=on_no_spare,
        min_ranks=min_ranks,
        replicas=replicas,
        replicate_every=replicate_every,
        persist_every=persist_every,
        persist_path=persist_path,
        persist_local_dir=persist_local_dir,
        persist_keep=persist_keep,
        straggler_threshold=straggler_threshold,
        on_straggler=on_straggler,
        output_dir=output_dir,
        backend=backend,
        env=env,
        chaos=chaos,
        **backend_opts,
    )


# ---- generic helpers ------------------------------------------------------------------------


def _kind(value: Any) -> str:
    """Short description of a value's YAML shape, for "expected X, got Y" messages."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _join(prefix: str | None, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a close match, else ``''``; typos are the usual culprit."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def _check_keys(data: Mapping[Any, Any], allowed: tuple[str, ...], where: str | None) -> None:
    """Unknown keys are errors, not warnings: a misspelt optional key would otherwise be ignored
    and the job would silently run with the default."""
    for key in data:
        if not isinstance(key, str):
            raise SpecError(f"field names must be strings, got {key!r}", field=where)
        if key not in allowed:
            hint = _did_you_mean(key, allowed) or f" (allowed: {', '.join(allowed)})"
            raise SpecError(f"unknown field {key!r}{hint}", field=where)


def _check_required(
    data: Mapping[str, Any], required: Mapping[str, str], where: str | None
) -> None:
    for key, example in required.items():
        if data.get(key) is None:
            raise SpecError(f"required (e.g. {key}: {example})", field=_join(where, key))


def _none_hint(value: Any, default: Any) -> str:
    """Extra hint for the two most common type slips: an empty YAML value and a quoted number."""
    if value is None and default is not _MISSING:
        return f" (remove the line to use the default, {default})"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (write the number without quotes)"
    return ""


def _parse_int(field_path: str, value: Any, *, minimum: int, default: Any = _MISSING) -> int:
    # bool is an int subclass; `ranks: yes` must not quietly mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(
            f"must be an integer, got {value!r}{_none_hint(value, default)}", field=field_path
        )
    if value < minimum:
        raise SpecError(f"must be >= {minimum}, got {value}", field=field_path)
    return value


def _parse_ratio(field_path: str, value: Any) -> float:
    """A slowdown factor (> 1): how many times the median compute time makes a straggler."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"must be a number like 2.0 (times the median step compute time), got {value!r}",
                        field=field_path)
    if value <= 1:
        raise SpecError(f"must be > 1 (1 would flag every rank), got {value!r}", field=field_path)
    return float(value)


def _parse_seconds(
    field_path: str,
    value: Any,
    *,
    minimum: float | None = None,
    above: float | None = None,
    default: Any = _MISSING,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(
            f"must be a number of seconds, got {value!r}{_none_hint(value, default)}",
            field=field_path,
        )
    seconds = float(value)
    if not math.isfinite(seconds):
        raise SpecError(f"must be a finite number of seconds, got {value!r}", field=field_path)
    if minimum is not None and seconds < minimum:
        raise SpecError(f"must be >= {minimum:g} seconds, got {value!r}", field=field_path)
    if above is not None and seconds <= above:
        raise SpecError(f"must be > {above:g} seconds, got {value!r}", field=field_path)
    return seconds


def _parse_choice(
    field_path: str, value: Any, choices: tuple[str, ...], *, default: Any = _MISSING
) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = _did_you_mean(value, choices) if isinstance(value, str) else ""
        if not hint:
            hint = _none_hint(value, default) if value is None else ""
        raise SpecError(
            f"must be one of {', '.join(choices)}, got {value!r}{hint}", field=field_path
        )
    return value


def _resolve_path(path: str, base_dir: str) -> str:
    return os.path.abspath(os.path.join(base_dir, os.path.expanduser(path)))


# ---- per-field parsers ----------------------------------------------------------------------


def _suggest_name(name: str) -> str:
    fixed = re.sub(r"[^a-z0-9-]", "-", name.lower())
    fixed = re.sub(r"-{2,}", "-", fixed).strip("-")[:63].strip("-")
    return fixed or "my-job"


def _parse_name(value: Any) -> str:
    if not isinstance(value, str):
        raise SpecError(f"must be a string, got {value!r} (e.g. name: my-job)", field="name")
    if not _NAME_RE.match(value):
        raise SpecError(
            f"must be 1-63 lowercase letters, digits or '-', starting and ending with a letter "
            f"or digit, got {value!r} (try {_suggest_name(value)!r})",
            field="name",
        )
    return value


def _parse_entrypoint(value: Any, base_dir: str) -> str:
    """``module.path:function`` or ``file.py:function``; a file is made absolute and must exist.

    The module form is deliberately *not* imported here: importing user code would pull in torch
    and run arbitrary side effects in the controller. Workers import it when they start.
    """
    forms = "'module.path:function' or 'path/to/file.py:function'"
    if not isinstance(value, str):
        raise SpecError(f"must be {forms}, got {value!r}", field="entrypoint")
    text = value.strip()
    target, sep, func = text.rpartition(":")
    if not sep or not target:
        example = f"{text}:train" if text else "train.py:train"
        raise SpecError(
            f"must be {forms}, got {value!r} (add the function to call, e.g. {example!r})",
            field="entrypoint",
        )
    if not func.isidentifier() or keyword.iskeyword(func):
        raise SpecError(
            f"function {func!r} in {value!r} is not a Python identifier "
            f"(name the train function, e.g. '{target}:train')",
            field="entrypoint",
        )
    if target.endswith(".py"):
        path = _resolve_path(target, base_dir)
        if not os.path.isfile(path):
            raise SpecError(
                f"file not found: {path} (from {value!r}; relative paths are resolved against "
                f"the spec file's directory {base_dir})",
                field="entrypoint",
            )
        return f"{path}:{func}"
    parts = target.split(".")
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise SpecError(
            f"{target!r} in {value!r} is neither a .py file nor a dotted module path (use {forms})",
            field="entrypoint",
        )
    return f"{target}:{func}"


def _plain_data(value: Any, path: str) -> Any:
    """Copy ``value`` checking it is JSON data: args travel to workers as JSON and must come back
    equal, so dates, sets, NaN or non-string keys are refused here rather than mangled later."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SpecError(
                f"must be a finite number, got {value!r} (pass it as a string, e.g. 'inf')",
                field=path,
            )
        return value
    if isinstance(value, (list, tuple)):
        return [_plain_data(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SpecError(f"mapping keys must be strings, got {k!r} (quote it)", field=path)
            out[k] = _plain_data(v, f"{path}.{k}")
        return out
    raise SpecError(
        f"must be plain data (string, number, bool, null, list or mapping), got {value!r} "
        f"(quote it to pass a string)",
        field=path,
    )


def _parse_args(value: Any) -> dict[str, Any]:
    """Keyword arguments for the train function, so keys must be valid Python identifiers."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            f"must be a mapping of keyword arguments, got {_kind(value)} "
            f"(e.g. args: {{lr: 0.001}})",
            field="args",
        )
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
            suggestion = re.sub(r"\W", "_", str(key))
            if not suggestion.isidentifier() or keyword.iskeyword(suggestion):
                suggestion = f"arg_{suggestion}"
            raise SpecError(
                f"key {key!r} is not a valid Python keyword argument name (try {suggestion!r})",
                field="args",
            )
        out[key] = _plain_data(item, f"args.{key}")
    return out


def _normalise_endpoint(raw: Any, where: str) -> str:
    """``host:port`` / ``http(s)://host:port`` -> ``http(s)://host:port``, so the etcd client and
    the health checks see one canonical spelling."""
    fix = f"expected host:port or http(s)://host:port, e.g. {_EXAMPLE_ENDPOINT}"
    if not isinstance(raw, str):
        raise SpecError(f"bad endpoint {raw!r} ({fix})", field=where)
    text = raw.strip()
    scheme = "http"
    rest = text
    if "://" in text:
        scheme, _, rest = text.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise SpecError(
                f"bad endpoint {raw!r}: scheme must be http or https ({fix})", field=where
            )
    rest = rest.rstrip("/")
    if rest.startswith("["):  # IPv6 literal: [::1]:2379
        close = rest.find("]")
        host = rest[: close + 1] if close > 0 else ""
        after = rest[close + 1 :] if close > 0 else ""
        port_text = after[1:] if after.startswith(":") else ""
    else:
        host, _, port_text = rest.rpartition(":")
    bad_host = not host or bool(re.search(r"[\s/@]", host))
    if not host.startswith("[") and ":" in host:  # unbracketed IPv6 or a stray colon
        bad_host = True
    if bad_host or not port_text:
        raise SpecError(f"bad endpoint {raw!r}: needs a host and a port ({fix})", field=where)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise SpecError(
            f"bad endpoint {raw!r}: port {port_text!r} must be an integer 1-65535 ({fix})",
            field=where,
        )
    return f"{scheme}://{host}:{int(port_text)}"


def _parse_endpoints(value: Any, where: str) -> tuple[str, ...]:
    if value is None or value == "embedded":
        return ()
    if isinstance(value, str):
        # Comma-separated lists are the etcdctl convention (ETCDCTL_ENDPOINTS).
        items = [p for p in (s.strip() for s in value.split(",")) if p]
        if len(items) == 1:
            return (_normalise_endpoint(items[0], where),)
        return tuple(_normalise_endpoint(p, f"{where}[{i}]") for i, p in enumerate(items))
    if isinstance(value, (list, tuple)):
        return tuple(_normalise_endpoint(p, f"{where}[{i}]") for i, p in enumerate(value))
    raise SpecError(
        f"must be 'embedded', an endpoint string or a list of endpoints, got {value!r} "
        f"(e.g. {_EXAMPLE_ENDPOINT})",
        field=where,
    )


def _parse_etcd(value: Any, base_dir: str) -> EtcdConfig:
    if value is None or isinstance(value, (str, list, tuple)):
        return EtcdConfig(endpoints=_parse_endpoints(value, "etcd"))
    if not isinstance(value, Mapping):
        raise SpecError(
            f"must be 'embedded', an endpoint string, a list of endpoints or a mapping with "
            f"endpoints, got {value!r} (e.g. etcd: {_EXAMPLE_ENDPOINT})",
            field="etcd",
        )
    _check_keys(value, _ETCD_FIELDS, where="etcd")
    endpoints = _parse_endpoints(value.get("endpoints"), "etcd.endpoints")
    extras: dict[str, str | None] = {}
    for key in ("ca_cert", "cert", "key", "user", "password"):
        item = value.get(key)
        if item is not None and (not isinstance(item, str) or not item):
            quote = " (quote it)" if key in ("user", "password") else ""
            raise SpecError(f"must be a non-empty string, got {item!r}{quote}", field=f"etcd.{key}")
        if item is not None and key in ("ca_cert", "cert", "key"):
            item = _resolve_path(item, base_dir)
        extras[key] = item
    given = [k for k, v in extras.items() if v is not None]
    if given and not endpoints:
        raise SpecError(
            f"{given[0]} only applies to an external etcd; add endpoints "
            f"(e.g. endpoints: https://etcd-0:2379) or remove {given[0]}",
            field="etcd",
        )
    if (extras["cert"] is None) != (extras["key"] is None):
        have, need = ("cert", "key") if extras["cert"] is not None else ("key", "cert")
        raise SpecError(f"{have} is set but {need} is not (client TLS needs both)", field="etcd")
    if (extras["user"] is None) != (extras["password"] is None):
        have, need = ("user", "password") if extras["user"] is not None else ("password", "user")
        raise SpecError(f"{have} is set but {need} is not (etcd auth needs both)", field="etcd")
    return EtcdConfig(endpoints=endpoints, **extras)


def _parse_output_dir(value: Any, base_dir: str, name: str = "output_dir") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(
            f"must be a directory path, got {value!r} (e.g. {name}: runs/my-job)",
            field=name,
        )
    return _resolve_path(value, base_dir)


def _parse_persist_path(value: Any, base_dir: str) -> str | None:
    """A directory, or an fsspec URL (s3://bucket/prefix, gs://..., file:///...)."""
    if isinstance(value, str) and re.match(r"^[a-z][a-z0-9+.-]*://", value):
        return value
    return _parse_output_dir(value, base_dir, "persist_path")


def _parse_env(value: Any) -> dict[str, str]:
    """Extra worker environment. YAML turns ``1`` and ``true`` into int/bool; environment values
    are strings, so scalars are coerced (bools to ``true``/``false``, as most tools expect)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            f"must be a mapping of NAME: value, got {_kind(value)} "
            f"(e.g. env: {{NCCL_DEBUG: WARN}})",
            field="env",
        )
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise SpecError(
                f"variable names must be non-empty strings without '=', got {key!r}", field="env"
            )
        if isinstance(item, bool):
            out[key] = "true" if item else "false"
        elif isinstance(item, (str, int, float)):
            out[key] = str(item)
        else:
            raise SpecError(
                f"must be a string, got {item!r} (quote it, e.g. {key}: '')", field=f"env.{key}"
            )
    return out


def _parse_backend_options(backend: str, value: Any) -> dict[str, Any]:
    schema = BACKEND_OPTIONS[backend]
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        first = next(iter(schema))
        raise SpecError(
            f"must be a mapping of option: value, got {_kind(value)} "
            f"(e.g. {backend}: {{{first}: ...}}; options: {', '.join(schema)})",
            field=backend,
        )
    _check_keys(value, tuple(schema), where=backend)
    out: dict[str, Any] = {}
    for key, item in value.items():
        kind, help_ = schema[key]
        where = f"{backend}.{key}"
        if kind == "str" and isinstance(item, str) and item.strip():
            out[key] = item
        elif kind == "int" and isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out[key] = item
        elif kind == "float" and isinstance(item, (int, float)) and not isinstance(item, bool) \
                and math.isfinite(item) and item >= 0:
            out[key] = float(item)
        elif kind == "strlist" and isinstance(item, (list, tuple)) \
                and all(isinstance(x, str) and x for x in item):
            out[key] = list(item)
        elif kind in ("strmap", "strfloat") and isinstance(item, Mapping) and all(
            isinstance(k, str) and k and (
                isinstance(v, str) if kind == "strmap"
                else isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)
            for k, v in item.items()
        ):
            out[key] = {k: (v if kind == "strmap" else float(v)) for k, v in item.items()}
        else:
            want = {"str": "a non-empty string", "int": "a whole number >= 0",
                    "float": "a number >= 0", "strlist": "a list of non-empty strings",
                    "strmap": "a mapping of string to string",
                    "strfloat": "a mapping of name to a number >= 0"}[kind]
            raise SpecError(f"must be {want}, got {item!r} ({help_})", field=where)
    return out


def _parse_chaos(value: Any, *, ranks: int, steps: int) -> tuple[ChaosEntry, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise SpecError(
            f"must be a list of entries, got {_kind(value)} "
            f"(e.g. chaos: [{{at_step: 80, action: kill-rank, rank: 0}}])",
            field="chaos",
        )
    return tuple(
        _parse_chaos_entry(item, f"chaos[{i}]", ranks=ranks, steps=steps)
        for i, item in enumerate(value)
    )


def _parse_chaos_entry(item: Any, where: str, *, ranks: int, steps: int) -> ChaosEntry:
    if not isinstance(item, Mapping):
        raise SpecError(
            f"must be a mapping like {{at_step: 80, action: kill-rank, rank: 0}}, got {item!r}",
            field=where,
        )
    _check_keys(item, _CHAOS_FIELDS, where=where)
    _check_required(item, _CHAOS_REQUIRED, where=where)

    at_step = _parse_int(f"{where}.at_step", item["at_step"], minimum=0)
    if at_step >= steps:
        raise SpecError(
            f"must be < steps ({steps}), got {at_step} (the fault would never fire)",
            field=f"{where}.at_step",
        )
    action = _parse_choice(f"{where}.action", item["action"], CHAOS_ACTIONS)

    rank: int | None = None
    if item.get("rank") is not None:
        rank = _parse_int(f"{where}.rank", item["rank"], minimum=0)
        if rank >= ranks:
            raise SpecError(
                f"must be < ranks ({ranks}), got {rank} (ranks are numbered 0..{ranks - 1})",
                field=f"{where}.rank",
            )
    node: str | None = None
    if item.get("node") is not None:
        node = item["node"]
        if not isinstance(node, str) or not node.strip():
            raise SpecError(
                f"must be a node name, got {node!r} (quote it, or use rank: to target the "
                f"node hosting that rank)",
                field=f"{where}.node",
            )
    seconds: float | None = None
    if item.get("seconds") is not None:
        seconds = _parse_seconds(f"{where}.seconds", item["seconds"], above=0.0)

    # Which targets each action takes; extra targets are errors because they suggest the user
    # meant a different action (kill-rank with node: probably meant kill-node).
    if action in RANK_ACTIONS:
        if rank is None:
            raise SpecError(f"{action} needs the rank to target (e.g. rank: 0)", field=where)
        if node is not None:
            raise SpecError(
                f"node is not used by {action} (remove it, or use kill-node/partition-node)",
                field=f"{where}.node",
            )
    elif action in NODE_ACTIONS:
        if rank is None and node is None:
            raise SpecError(
                f"{action} needs a target: rank (the node hosting that rank) or node",
                field=where,
            )
        if rank is not None and node is not None:
            raise SpecError(f"{action} takes rank or node, not both (remove one)", field=where)
    else:
        for name, given in (("rank", rank), ("node", node)):
            if given is not None:
                raise SpecError(
                    f"{name} is not used by {action}, which targets the control plane (remove it)",
                    field=f"{where}.{name}",
                )
    if seconds is not None and action not in _TIMED_ACTIONS:
        raise SpecError(
            f"seconds is not used by {action}; it applies to {', '.join(_TIMED_ACTIONS)} "
            f"(remove it)",
            field=f"{where}.seconds",
        )
    if action == "slow-rank" and seconds is None:
        raise SpecError(
            "slow-rank needs seconds, the delay added to every step (e.g. seconds: 0.5)",
            field=where,
        )
    return ChaosEntry(at_step=at_step, action=action, rank=rank, node=node, seconds=seconds)
