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

The module is the public face of three: :mod:`~hotspare.orchestrator.spec_model` holds the dataclasses
(re-exported here), :mod:`~hotspare.orchestrator.spec_fields` the validator of each field, and this one
the loading API, the order of the checks, and the chaos schedule (checked against
:mod:`hotspare.orchestrator.chaos`, the one table of actions, whose names it re-exports).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from . import chaos
from .spec_fields import (
    MAX_PROCESSES,
    check_keys,
    check_required,
    parse_args,
    parse_backend_options,
    parse_choice,
    parse_entrypoint,
    parse_env,
    parse_etcd,
    parse_int,
    parse_name,
    parse_output_dir,
    parse_persist_path,
    parse_ratio,
    parse_seconds,
    parse_size,
)
from .spec_model import (
    BACKEND_OPTIONS,
    BACKENDS,
    ON_CODE_ERROR_POLICIES,
    ON_NO_SPARE_POLICIES,
    ChaosEntry,
    EtcdConfig,
    JobSpec,
    SpecError,
    yaml_shape,
)

__all__ = [
    "BACKENDS",
    "BACKEND_OPTIONS",
    "CHAOS_ACTIONS",
    "CONTROL_ACTIONS",
    "NODE_ACTIONS",
    "ON_CODE_ERROR_POLICIES",
    "ON_NO_SPARE_POLICIES",
    "RANK_ACTIONS",
    "SYSTEM_FIELDS",
    "ChaosEntry",
    "EtcdConfig",
    "JobSpec",
    "SpecError",
    "load_spec",
    "parse_overrides",
    "parse_spec",
]

#: Every fault the chaos injector knows how to cause, in the spelling used in YAML.
CHAOS_ACTIONS: tuple[str, ...] = chaos.NAMES
#: Actions aimed at one training process; they need ``rank``. corrupt-checkpoint damages
#: that rank's file in the newest complete persisted checkpoint (spec-only: for testing
#: that recovery refuses it and falls back to an older one).
RANK_ACTIONS: tuple[str, ...] = chaos.RANK_ACTIONS
#: Actions aimed at a whole node; it is named directly (``node``) or via a rank it hosts (``rank``).
NODE_ACTIONS: tuple[str, ...] = chaos.NODE_ACTIONS
#: Actions aimed at the control plane; they take no target.
CONTROL_ACTIONS: tuple[str, ...] = chaos.CONTROL_ACTIONS


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
            f"top level must be a mapping of field: value, got {yaml_shape(data)}", source=source
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

#: Fields ``submit`` fills in; a YAML file that sets them is refused like any unknown key.
SYSTEM_FIELDS: tuple[str, ...] = ("run_id", "resume_from")
_JOB_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(JobSpec) if f.name not in SYSTEM_FIELDS)
_JOB_REQUIRED: dict[str, str] = {
    "name": "my-job",
    "entrypoint": "train.py:train",
    "ranks": "4",
    "steps": "1000",
}
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(JobSpec)}


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
    """The fields in declaration order (the first bad one is reported), in four groups."""
    if not isinstance(data, Mapping):
        raise SpecError(f"top level must be a mapping of field: value, got {yaml_shape(data)}")
    check_keys(data, _JOB_FIELDS, where=None)
    check_required(data, _JOB_REQUIRED, where=None)
    fields = _parse_shape(data, base_dir)
    fields.update(_parse_failure_policy(data, fields["ranks"]))
    fields.update(_parse_state_tiers(data, base_dir))
    fields.update(_parse_run(data, base_dir, ranks=fields["ranks"], steps=fields["steps"]))
    return JobSpec(**fields)


def _opt(data: Mapping[str, Any], key: str) -> Any:
    """An optional field as written, else its default. Collection fields (default_factory)
    read as None, which their parsers turn into the empty default."""
    if key in data:
        return data[key]
    default = _DEFAULTS[key]
    return None if default is dataclasses.MISSING else default


def _parse_shape(data: Mapping[str, Any], base_dir: str) -> dict[str, Any]:
    """What runs, how many ranks for how many steps, on how many nodes, against which etcd."""
    return {
        "name": parse_name(data["name"]),
        "entrypoint": parse_entrypoint(data["entrypoint"], base_dir),
        "ranks": parse_int("ranks", data["ranks"], minimum=1, maximum=MAX_PROCESSES),
        "steps": parse_int("steps", data["steps"], minimum=1),
        "spares": parse_int("spares", _opt(data, "spares"), minimum=0, default=_DEFAULTS["spares"],
                           maximum=MAX_PROCESSES),
        "ranks_per_node": parse_int("ranks_per_node", _opt(data, "ranks_per_node"), minimum=1, maximum=MAX_PROCESSES,
                                    default=_DEFAULTS["ranks_per_node"]),
        "args": parse_args(_opt(data, "args")),
        "etcd": parse_etcd(_opt(data, "etcd"), base_dir),
    }


def _parse_failure_policy(data: Mapping[str, Any], ranks: int) -> dict[str, Any]:
    """How a failure is detected and what the controller does about it."""
    lease_ttl = parse_seconds("lease_ttl", _opt(data, "lease_ttl"), minimum=1.0,
                              default=_DEFAULTS["lease_ttl"])
    hang_timeout = parse_seconds("hang_timeout", _opt(data, "hang_timeout"), above=0.0,
                                 default=_DEFAULTS["hang_timeout"])
    on_no_spare = parse_choice("on_no_spare", _opt(data, "on_no_spare"), ON_NO_SPARE_POLICIES,
                               default=_DEFAULTS["on_no_spare"])
    min_ranks = parse_int("min_ranks", _opt(data, "min_ranks"), minimum=1,
                          default=_DEFAULTS["min_ranks"])
    if min_ranks > ranks:
        raise SpecError(
            f"must be <= ranks ({ranks}), got {min_ranks} (lower min_ranks or raise ranks)",
            field="min_ranks",
        )
    return {"lease_ttl": lease_ttl, "hang_timeout": hang_timeout, "on_no_spare": on_no_spare,
            "min_ranks": min_ranks, **_parse_failure_limits(data)}


def _parse_failure_limits(data: Mapping[str, Any]) -> dict[str, Any]:
    """Code errors and the crash-loop guards: when failing again is the answer."""
    return {
        "on_code_error": parse_choice("on_code_error", _opt(data, "on_code_error"),
                                      ON_CODE_ERROR_POLICIES, default=_DEFAULTS["on_code_error"]),
        "code_error_retries": parse_int("code_error_retries", _opt(data, "code_error_retries"),
                                        minimum=0, default=_DEFAULTS["code_error_retries"]),
        "max_failures": parse_int("max_failures", _opt(data, "max_failures"), minimum=1,
                                  default=_DEFAULTS["max_failures"]),
        "failure_window": parse_seconds("failure_window", _opt(data, "failure_window"),
                                        above=0.0, default=_DEFAULTS["failure_window"]),
        "crash_loop_limit": parse_int("crash_loop_limit", _opt(data, "crash_loop_limit"),
                                      minimum=2, default=_DEFAULTS["crash_loop_limit"]),
    }


def _parse_state_tiers(data: Mapping[str, Any], base_dir: str) -> dict[str, Any]:
    """Where each rank's state is kept: replicas on peers, and the persistent tier."""
    replicas = parse_int("replicas", _opt(data, "replicas"), minimum=0,
                         default=_DEFAULTS["replicas"])
    replicate_every = parse_int("replicate_every", _opt(data, "replicate_every"), minimum=1,
                                default=_DEFAULTS["replicate_every"])
    replicate_interval = parse_seconds("replicate_interval", _opt(data, "replicate_interval"), minimum=0.0,
                                       default=_DEFAULTS["replicate_interval"])
    persist_every = parse_int("persist_every", _opt(data, "persist_every"), minimum=0,
                              default=_DEFAULTS["persist_every"])
    if persist_every and persist_every % replicate_every:
        raise SpecError(
            f"must be a multiple of replicate_every ({replicate_every}), got {persist_every} "
            f"(persisted steps are replication points; e.g. persist_every: {replicate_every * 5})",
            field="persist_every",
        )
    return {
        "replicas": replicas,
        "replicate_every": replicate_every,
        "replicate_interval": replicate_interval,
        "persist_every": persist_every,
        "persist_path": parse_persist_path(_opt(data, "persist_path"), base_dir),
        "persist_local_dir": parse_output_dir(_opt(data, "persist_local_dir"), base_dir,
                                              "persist_local_dir"),
        "persist_keep": parse_int("persist_keep", _opt(data, "persist_keep"), minimum=1,
                                  default=_DEFAULTS["persist_keep"]),
        "shm_budget": parse_size("shm_budget", _opt(data, "shm_budget")),
    }


def _parse_run(data: Mapping[str, Any], base_dir: str, *, ranks: int, steps: int) -> dict[str, Any]:
    """Stragglers, outputs, the backend and its options, the environment and scheduled chaos."""
    out = {
        "straggler_threshold": parse_ratio("straggler_threshold", _opt(data, "straggler_threshold")),
        "on_straggler": parse_choice("on_straggler", _opt(data, "on_straggler"),
                                     ("report", "replace"), default=_DEFAULTS["on_straggler"]),
        "output_dir": parse_output_dir(_opt(data, "output_dir"), base_dir),
        "backend": parse_choice("backend", _opt(data, "backend"), BACKENDS,
                                default=_DEFAULTS["backend"]),
        "env": parse_env(_opt(data, "env")),
        "chaos": _parse_chaos(_opt(data, "chaos"), ranks=ranks, steps=steps),
    }
    out.update({b: parse_backend_options(b, _opt(data, b)) for b in ("slurm", "kubernetes", "ray")})
    return out


# ---- the chaos schedule: checked against hotspare.orchestrator.chaos's table of actions ----------

#: Actions whose scheduled entries take ``seconds`` (a duration, or for slow-rank a per-step
#: delay): the timed ones of :mod:`hotspare.orchestrator.chaos` that act on a rank or node. A scheduled
#: control-plane action takes no target and no seconds (restart-etcd uses its default
#: duration; ``hotspare chaos --seconds`` sets one by hand).
_SCHEDULED_TIMED_ACTIONS: tuple[str, ...] = tuple(
    name for name in chaos.TIMED_ACTIONS if chaos.ACTIONS[name].target is not chaos.Target.CONTROL
)
_CHAOS_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ChaosEntry))
_CHAOS_REQUIRED: dict[str, str] = {"at_step": "100", "action": "kill-rank"}


def _parse_chaos(value: Any, *, ranks: int, steps: int) -> tuple[ChaosEntry, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise SpecError(
            f"must be a list of entries, got {yaml_shape(value)} "
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
    check_keys(item, _CHAOS_FIELDS, where=where)
    check_required(item, _CHAOS_REQUIRED, where=where)

    at_step = parse_int(f"{where}.at_step", item["at_step"], minimum=0)
    if at_step >= steps:
        raise SpecError(
            f"must be < steps ({steps}), got {at_step} (the fault would never fire)",
            field=f"{where}.at_step",
        )
    action = parse_choice(f"{where}.action", item["action"], chaos.NAMES)
    rank = _parse_chaos_rank(item.get("rank"), where, ranks)
    node = _parse_chaos_node(item.get("node"), where)
    seconds: float | None = None
    if item.get("seconds") is not None:
        seconds = parse_seconds(f"{where}.seconds", item["seconds"], above=0.0)
    _check_chaos_targets(action, rank, node, where)
    _check_chaos_seconds(action, seconds, where)
    during = _parse_chaos_during(item.get("during"), action, where)
    return ChaosEntry(at_step=at_step, action=action, rank=rank, node=node, seconds=seconds, during=during)


def _parse_chaos_during(value: Any, action: str, where: str) -> str | None:
    """``during:``, a recovery phase the entry fires inside (:data:`hotspare.orchestrator.chaos.PHASES`)."""
    if value is None:
        return None
    phase = parse_choice(f"{where}.during", value, tuple(chaos.PHASES))
    if action in chaos.NOT_DURING:
        raise SpecError(
            f"{action} slows every step and cannot fire during a recovery phase (remove during:, "
            f"or use one of {', '.join(n for n in chaos.NAMES if n not in chaos.NOT_DURING)})",
            field=f"{where}.during",
        )
    return phase


def _parse_chaos_rank(value: Any, where: str, ranks: int) -> int | None:
    if value is None:
        return None
    rank = parse_int(f"{where}.rank", value, minimum=0)
    if rank >= ranks:
        raise SpecError(
            f"must be < ranks ({ranks}), got {rank} (ranks are numbered 0..{ranks - 1})",
            field=f"{where}.rank",
        )
    return rank


def _parse_chaos_node(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(
            f"must be a node name, got {value!r} (quote it, or use rank: to target the "
            f"node hosting that rank)",
            field=f"{where}.node",
        )
    return value


def _check_chaos_targets(action: str, rank: int | None, node: str | None, where: str) -> None:
    """Which targets each action takes (its ``target`` in :mod:`hotspare.orchestrator.chaos`). Extra
    targets are errors because they suggest the user meant a different action (kill-rank
    with node: probably meant kill-node)."""
    target = chaos.ACTIONS[action].target
    if target is chaos.Target.RANK:
        if rank is None:
            raise SpecError(f"{action} needs the rank to target (e.g. rank: 0)", field=where)
        if node is not None:
            raise SpecError(
                f"node is not used by {action} (remove it, or use kill-node/partition-node)",
                field=f"{where}.node",
            )
    elif target is chaos.Target.NODE:
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


def _check_chaos_seconds(action: str, seconds: float | None, where: str) -> None:
    if seconds is not None and action not in _SCHEDULED_TIMED_ACTIONS:
        raise SpecError(
            f"seconds is not used by {action}; it applies to {', '.join(_SCHEDULED_TIMED_ACTIONS)} "
            f"(remove it)",
            field=f"{where}.seconds",
        )
    if action == "slow-rank" and seconds is None:
        raise SpecError(
            "slow-rank needs seconds, the delay added to every step (e.g. seconds: 0.5)",
            field=where,
        )
