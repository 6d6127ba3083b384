"""Unit tests for hotspare.orchestrator.spec: parsing, validation messages, path resolution, round-trips.

No server, no torch: every test writes its own YAML (and a dummy train.py) under tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hotspare.orchestrator.spec import (
    CHAOS_ACTIONS,
    ChaosEntry,
    EtcdConfig,
    JobSpec,
    SpecError,
    load_spec,
    parse_name,
    parse_overrides,
    parse_spec,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- helpers --------------------------------------------------------------------------------


def write_train(directory: Path, name: str = "train.py") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("def train(**kwargs):\n    return kwargs\n")
    return path


def base_data(**changes: Any) -> dict[str, Any]:
    """A minimal valid spec (entrypoint relative to the base dir) with ``changes`` applied;
    a change whose value is ``DELETE`` removes that key."""
    data: dict[str, Any] = {
        "name": "my-job",
        "entrypoint": "train.py:train",
        "ranks": 4,
        "steps": 100,
    }
    for key, value in changes.items():
        if value is DELETE:
            data.pop(key, None)
        else:
            data[key] = value
    return data


DELETE = object()


def write_spec(directory: Path, data: Any, name: str = "job.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def parse(tmp_path: Path, **changes: Any) -> JobSpec:
    write_train(tmp_path)
    return parse_spec(base_data(**changes), base_dir=tmp_path)


def error_of(tmp_path: Path, **changes: Any) -> str:
    write_train(tmp_path)
    with pytest.raises(SpecError) as info:
        parse_spec(base_data(**changes), base_dir=tmp_path)
    return str(info.value)


def assert_mentions(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ---- valid specs, defaults, round-trips -----------------------------------------------------


def full_data() -> dict[str, Any]:
    return {
        "name": "gpt-small-2",
        "entrypoint": "src/train.py:train",
        "ranks": 8,
        "steps": 500,
        "spares": 2,
        "ranks_per_node": 3,
        "args": {"lr": 0.001, "layers": [4, 8], "opt": {"name": "adamw", "nesterov": False}},
        "etcd": {
            "endpoints": ["etcd-0:2379", "https://etcd-1:2379"],
            "ca_cert": "certs/ca.pem",
            "cert": "certs/client.pem",
            "key": "certs/client.key",
            "user": "root",
            "password": "s3cret",
        },
        "lease_ttl": 3,
        "hang_timeout": 30.5,
        "on_no_spare": "shrink",
        "min_ranks": 2,
        "replicas": 2,
        "output_dir": "runs/out",
        "backend": "slurm",
        "env": {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": 4},
        "chaos": [
            {"at_step": 0, "action": "kill-rank", "rank": 7},
            {"at_step": 10, "action": "kill-node", "node": "node-3"},
            {"at_step": 20, "action": "hang-rank", "rank": 1, "seconds": 90},
            {"at_step": 30, "action": "slow-rank", "rank": 2, "seconds": 0.25},
            {"at_step": 40, "action": "partition-node", "rank": 3, "seconds": 15},
            {"at_step": 50, "action": "kill-controller"},
            {"at_step": 499, "action": "restart-etcd"},
            {"at_step": 60, "action": "corrupt-checkpoint", "rank": 0},
        ],
    }


def test_full_valid_spec_parses_every_field(tmp_path: Path) -> None:
    write_train(tmp_path / "src")
    spec = load_spec(write_spec(tmp_path, full_data()))

    assert spec.name == "gpt-small-2"
    assert spec.entrypoint == f"{tmp_path / 'src' / 'train.py'}:train"
    assert (spec.ranks, spec.steps, spec.spares, spec.ranks_per_node) == (8, 500, 2, 3)
    assert spec.args == {"lr": 0.001, "layers": [4, 8], "opt": {"name": "adamw", "nesterov": False}}
    assert spec.etcd == EtcdConfig(
        endpoints=("http://etcd-0:2379", "https://etcd-1:2379"),
        ca_cert=str(tmp_path / "certs" / "ca.pem"),
        cert=str(tmp_path / "certs" / "client.pem"),
        key=str(tmp_path / "certs" / "client.key"),
        user="root",
        password="s3cret",
    )
    assert not spec.etcd.embedded
    assert spec.lease_ttl == 3.0 and isinstance(spec.lease_ttl, float)
    assert spec.hang_timeout == 30.5
    assert (spec.on_no_spare, spec.min_ranks, spec.replicas) == ("shrink", 2, 2)
    assert spec.output_dir == str(tmp_path / "runs" / "out")
    assert spec.backend == "slurm"
    assert spec.env == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4"}
    assert [c.action for c in spec.chaos] == list(CHAOS_ACTIONS)
    assert spec.chaos[2] == ChaosEntry(at_step=20, action="hang-rank", rank=1, seconds=90.0)
    assert spec.nodes == 3  # ceil(8 / 3)
    assert spec.total_nodes == 5


def test_full_spec_round_trips_through_to_dict_and_from_dict(tmp_path: Path) -> None:
    write_train(tmp_path / "src")
    spec = load_spec(write_spec(tmp_path, full_data()))

    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_full_spec_round_trips_through_json(tmp_path: Path) -> None:
    write_train(tmp_path / "src")
    spec = load_spec(write_spec(tmp_path, full_data()))

    text = spec.to_json()
    decoded = json.loads(text)
    assert decoded == spec.to_dict()
    assert JobSpec.from_dict(decoded) == spec


def test_from_dict_keeps_resolved_paths_without_checking_they_exist(tmp_path: Path) -> None:
    train = write_train(tmp_path)
    spec = parse_spec(base_data(output_dir="out"), base_dir=tmp_path)
    data = spec.to_dict()
    train.unlink()  # e.g. decoded on a host that does not have the file

    again = JobSpec.from_dict(data)
    assert again.entrypoint == f"{train}:train"
    assert again.output_dir == str(tmp_path / "out")


def test_from_dict_rejects_unknown_fields_as_version_skew(tmp_path: Path) -> None:
    data = parse(tmp_path).to_dict()
    data["surprise"] = 1
    with pytest.raises(SpecError, match="unknown spec field 'surprise'"):
        JobSpec.from_dict(data)


def test_to_dict_returns_copies_so_mutating_it_leaves_the_spec_alone(tmp_path: Path) -> None:
    spec = parse(tmp_path, args={"opt": {"lr": 1}})
    data = spec.to_dict()
    data["args"]["opt"]["lr"] = 2
    assert spec.args == {"opt": {"lr": 1}}


def test_minimal_spec_gets_documented_defaults(tmp_path: Path) -> None:
    spec = parse(tmp_path)

    assert spec.spares == 1
    assert spec.ranks_per_node == 1
    assert spec.args == {}
    assert spec.etcd == EtcdConfig() and spec.etcd.embedded
    assert spec.lease_ttl == 5.0
    assert spec.hang_timeout == 60.0
    assert spec.on_no_spare == "wait"
    assert spec.min_ranks == 1
    assert spec.replicas == 1
    assert spec.output_dir is None
    assert spec.backend == "local"
    assert spec.env == {}
    assert spec.chaos == ()
    assert spec.nodes == 4
    assert spec.total_nodes == 5


def test_empty_yaml_values_for_collections_mean_defaults(tmp_path: Path) -> None:
    spec = parse(tmp_path, args=None, etcd=None, env=None, chaos=None, output_dir=None)
    assert (spec.args, spec.env, spec.chaos, spec.output_dir) == ({}, {}, (), None)
    assert spec.etcd.embedded


@pytest.mark.parametrize(
    ("ranks", "per_node", "nodes"), [(1, 1, 1), (4, 2, 2), (5, 2, 3), (3, 8, 1)]
)
def test_nodes_is_ranks_over_ranks_per_node_rounded_up(
    tmp_path: Path, ranks: int, per_node: int, nodes: int
) -> None:
    spec = parse(tmp_path, ranks=ranks, ranks_per_node=per_node, spares=2)
    assert spec.nodes == nodes
    assert spec.total_nodes == nodes + 2


def test_spec_is_frozen(tmp_path: Path) -> None:
    spec = parse(tmp_path)
    with pytest.raises(AttributeError):
        spec.ranks = 2  # type: ignore[misc]


def test_env_values_are_coerced_to_strings(tmp_path: Path) -> None:
    spec = parse(tmp_path, env={"A": 1, "B": True, "C": "x", "D": 1.5, "E": False})
    assert spec.env == {"A": "1", "B": "true", "C": "x", "D": "1.5", "E": "false"}


def test_parse_spec_does_not_mutate_its_input(tmp_path: Path) -> None:
    write_train(tmp_path)
    data = base_data(args={"opt": {"lr": 1}}, chaos=[{"at_step": 1, "action": "kill-controller"}])
    snapshot = json.loads(json.dumps(data))
    spec = parse_spec(data, base_dir=tmp_path)
    assert data == snapshot
    data["args"]["opt"]["lr"] = 99
    assert spec.args == {"opt": {"lr": 1}}


def test_float_fields_accept_ints_and_store_floats(tmp_path: Path) -> None:
    spec = parse(tmp_path, lease_ttl=1, hang_timeout=2)
    assert (spec.lease_ttl, spec.hang_timeout) == (1.0, 2.0)
    assert all(isinstance(v, float) for v in (spec.lease_ttl, spec.hang_timeout))


def test_spec_error_is_a_value_error_that_exposes_field_and_source(tmp_path: Path) -> None:
    write_train(tmp_path)
    with pytest.raises(ValueError) as info:
        parse_spec(base_data(ranks=0), base_dir=tmp_path, source="job.yaml")
    err = info.value
    assert isinstance(err, SpecError)
    assert str(err) == "job.yaml: ranks: must be >= 1, got 0"
    assert (err.source, err.field, err.reason) == ("job.yaml", "ranks", "must be >= 1, got 0")


def test_spec_module_does_not_import_torch() -> None:
    code = (
        "import sys, hotspare.orchestrator.spec; "
        "sys.exit(1 if any(m == 'torch' or m.startswith('torch.') for m in sys.modules) else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=False)
    assert result.returncode == 0


# ---- required and unknown fields ------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "example"),
    [
        ("name", "name: my-job"),
        ("entrypoint", "entrypoint: train.py:train"),
        ("ranks", "ranks: 4"),
        ("steps", "steps: 1000"),
    ],
)
def test_missing_required_field_is_rejected_with_example(
    tmp_path: Path, field: str, example: str
) -> None:
    message = error_of(tmp_path, **{field: DELETE})
    assert message.endswith(f"{field}: required (e.g. {example})")


def test_required_field_left_empty_counts_as_missing(tmp_path: Path) -> None:
    assert error_of(tmp_path, ranks=None).endswith("ranks: required (e.g. ranks: 4)")


def test_unknown_top_level_field_suggests_the_close_match(tmp_path: Path) -> None:
    message = error_of(tmp_path, rank=3)
    assert message.endswith("unknown field 'rank' (did you mean 'ranks'?)")


def test_unknown_top_level_field_without_close_match_lists_allowed_fields(tmp_path: Path) -> None:
    message = error_of(tmp_path, zzz=1)
    assert_mentions(message, "unknown field 'zzz'", "allowed:", "ranks", "on_no_spare", "chaos")


def test_unknown_chaos_field_suggests_the_close_match(tmp_path: Path) -> None:
    message = error_of(tmp_path, chaos=[{"at_stp": 3, "action": "kill-rank", "rank": 0}])
    assert message.endswith("chaos[0]: unknown field 'at_stp' (did you mean 'at_step'?)")


def test_unknown_etcd_field_suggests_the_close_match(tmp_path: Path) -> None:
    message = error_of(tmp_path, etcd={"endpoint": "h:2379"})
    assert message.endswith("etcd: unknown field 'endpoint' (did you mean 'endpoints'?)")


def test_unknown_keys_are_reported_before_missing_required_fields(tmp_path: Path) -> None:
    message = error_of(tmp_path, rank=3, ranks=DELETE)
    assert "unknown field 'rank'" in message


def test_missing_required_fields_are_reported_before_bad_values(tmp_path: Path) -> None:
    message = error_of(tmp_path, name="BAD NAME", steps=DELETE)
    assert message.endswith("steps: required (e.g. steps: 1000)")


def test_bad_fields_are_reported_in_declaration_order(tmp_path: Path) -> None:
    # YAML order is irrelevant: chaos comes first in the mapping but is declared last.
    data = {"chaos": "nope", "backend": "nope", **base_data(steps=0, ranks=0)}
    write_train(tmp_path)
    with pytest.raises(SpecError, match=r"^<spec>: ranks: must be >= 1, got 0$"):
        parse_spec(data, base_dir=tmp_path)


# ---- per-field validation errors ------------------------------------------------------------

# (changes to the minimal spec, substrings the message must contain: field, bad value, fix)
FIELD_ERRORS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "ranks_zero": ({"ranks": 0}, ("ranks: must be >= 1, got 0",)),
    "ranks_bool": ({"ranks": True}, ("ranks: must be an integer, got True",)),
    "ranks_float": ({"ranks": 2.0}, ("ranks: must be an integer, got 2.0",)),
    "ranks_quoted": ({"ranks": "4"}, ("ranks: must be an integer, got '4'", "without quotes")),
    "steps_zero": ({"steps": 0}, ("steps: must be >= 1, got 0",)),
    "spares_negative": ({"spares": -1}, ("spares: must be >= 0, got -1",)),
    "spares_empty": (
        {"spares": None},
        ("spares: must be an integer, got None", "remove the line to use the default, 1"),
    ),
    "ranks_per_node_zero": ({"ranks_per_node": 0}, ("ranks_per_node: must be >= 1, got 0",)),
    "min_ranks_zero": ({"min_ranks": 0}, ("min_ranks: must be >= 1, got 0",)),
    "min_ranks_above_ranks": (
        {"min_ranks": 5},
        ("min_ranks: must be <= ranks (4), got 5", "lower min_ranks or raise ranks"),
    ),
    "replicas_negative": ({"replicas": -1}, ("replicas: must be >= 0, got -1",)),
    "replicate_interval_negative": ({"replicate_interval": -1}, ("replicate_interval: must be >= 0 seconds, got -1",)),
    "replicate_interval_text": ({"replicate_interval": "2s"}, ("replicate_interval: must be a number of seconds, got '2s'",)),
    "lease_ttl_too_small": ({"lease_ttl": 0.5}, ("lease_ttl: must be >= 1 seconds, got 0.5",)),
    "lease_ttl_string": (
        {"lease_ttl": "fast"},
        ("lease_ttl: must be a number of seconds, got 'fast'",),
    ),
    "lease_ttl_bool": ({"lease_ttl": True}, ("lease_ttl: must be a number of seconds, got True",)),
    "hang_timeout_zero": ({"hang_timeout": 0}, ("hang_timeout: must be > 0 seconds, got 0",)),
    "hang_timeout_infinite": (
        {"hang_timeout": float("inf")},
        ("hang_timeout: must be a finite number of seconds, got inf",),
    ),
    "on_no_spare_unknown": (
        {"on_no_spare": "retry"},
        ("on_no_spare: must be one of wait, shrink, fail, got 'retry'",),
    ),
    "on_no_spare_typo": (
        {"on_no_spare": "shrnk"},
        ("on_no_spare: must be one of wait, shrink, fail, got 'shrnk'", "did you mean 'shrink'"),
    ),
    "backend_unknown": (
        {"backend": "k8s"},
        ("backend: must be one of local, slurm, kubernetes, ray, got 'k8s'",),
    ),
    "name_invalid_chars": ({"name": "My_Job"}, ("name:", "'My_Job'", "(try 'my-job')")),
    "name_trailing_dash": ({"name": "job-"}, ("name:", "'job-'", "(try 'job')")),
    "name_too_long": ({"name": "a" * 64}, ("name:", "1-63", "(try '" + "a" * 63 + "')")),
    "name_not_string": ({"name": 123}, ("name: must be a string, got 123", "e.g. name: my-job")),
    "entrypoint_without_function": (
        {"entrypoint": "train.py"},
        ("entrypoint:", "'train.py'", "e.g. 'train.py:train'"),
    ),
    "entrypoint_bad_function": (
        {"entrypoint": "train.py:1st"},
        ("entrypoint:", "'1st'", "not a Python identifier", "'train.py:train'"),
    ),
    "entrypoint_bad_module": (
        {"entrypoint": "my-module:train"},
        ("entrypoint:", "'my-module'", "path/to/file.py:function", "module.path:function"),
    ),
    "args_not_mapping": ({"args": [1, 2]}, ("args: must be a mapping", "got a list", "args: {lr")),
    "args_key_not_identifier": (
        {"args": {"learning-rate": 0.1}},
        ("args:", "'learning-rate'", "(try 'learning_rate')"),
    ),
    "args_value_not_plain_data": (
        {"args": {"start": {1, 2}}},
        ("args.start: must be plain data", "{1, 2}", "quote it"),
    ),
    "args_nan": ({"args": {"x": float("nan")}}, ("args.x: must be a finite number, got nan",)),
    "output_dir_not_string": ({"output_dir": 5}, ("output_dir: must be a directory path, got 5",)),
    "env_not_mapping": ({"env": ["A=1"]}, ("env: must be a mapping", "got a list", "NCCL_DEBUG")),
    "env_empty_key": ({"env": {"": "x"}}, ("env: variable names", "got ''")),
    "env_value_not_scalar": (
        {"env": {"PATHS": ["a", "b"]}},
        ("env.PATHS: must be a string, got ['a', 'b']", "quote it"),
    ),
    "chaos_not_list": ({"chaos": {"at_step": 1}}, ("chaos: must be a list", "got a mapping")),
    "chaos_entry_not_mapping": (
        {"chaos": ["kill-rank"]},
        ("chaos[0]: must be a mapping", "'kill-rank'"),
    ),
    "chaos_at_step_negative": (
        {
            "chaos": [
                {"at_step": 1, "action": "kill-controller"},
                {"at_step": -3, "action": "kill-controller"},
            ]
        },
        ("chaos[1].at_step: must be >= 0, got -3",),
    ),
    "chaos_at_step_past_the_end": (
        {"chaos": [{"at_step": 100, "action": "kill-controller"}]},
        ("chaos[0].at_step: must be < steps (100), got 100", "never fire"),
    ),
    "chaos_missing_action": (
        {"chaos": [{"at_step": 1}]},
        ("chaos[0].action: required (e.g. action: kill-rank)",),
    ),
    "chaos_unknown_action": (
        {"chaos": [{"at_step": 1, "action": "kill_rank", "rank": 0}]},
        (
            "chaos[0].action: must be one of kill-rank,",
            "got 'kill_rank'",
            "did you mean 'kill-rank'",
        ),
    ),
    "chaos_rank_out_of_range": (
        {"chaos": [{"at_step": 1, "action": "kill-rank", "rank": 4}]},
        ("chaos[0].rank: must be < ranks (4), got 4", "0..3"),
    ),
    "chaos_rank_negative": (
        {"chaos": [{"at_step": 1, "action": "kill-rank", "rank": -1}]},
        ("chaos[0].rank: must be >= 0, got -1",),
    ),
    "chaos_rank_action_without_rank": (
        {"chaos": [{"at_step": 1, "action": "hang-rank"}]},
        ("chaos[0]: hang-rank needs the rank", "rank: 0"),
    ),
    "chaos_rank_action_with_node": (
        {"chaos": [{"at_step": 1, "action": "kill-rank", "rank": 0, "node": "n1"}]},
        ("chaos[0].node: node is not used by kill-rank", "kill-node"),
    ),
    "chaos_node_action_without_target": (
        {"chaos": [{"at_step": 1, "action": "kill-node"}]},
        ("chaos[0]: kill-node needs a target", "rank", "node"),
    ),
    "chaos_node_action_with_both_targets": (
        {"chaos": [{"at_step": 1, "action": "partition-node", "rank": 0, "node": "n1"}]},
        ("chaos[0]: partition-node takes rank or node, not both",),
    ),
    "chaos_node_not_string": (
        {"chaos": [{"at_step": 1, "action": "kill-node", "node": 3}]},
        ("chaos[0].node: must be a node name, got 3", "quote it"),
    ),
    "chaos_control_action_with_rank": (
        {"chaos": [{"at_step": 1, "action": "kill-controller", "rank": 0}]},
        ("chaos[0].rank: rank is not used by kill-controller", "remove it"),
    ),
    "chaos_seconds_on_untimed_action": (
        {"chaos": [{"at_step": 1, "action": "kill-rank", "rank": 0, "seconds": 5}]},
        ("chaos[0].seconds: seconds is not used by kill-rank", "remove it"),
    ),
    "chaos_seconds_on_a_scheduled_control_plane_action": (
        {"chaos": [{"at_step": 1, "action": "restart-etcd", "seconds": 5}]},
        ("chaos[0].seconds: seconds is not used by restart-etcd; it applies to hang-rank, "
         "slow-rank, partition-node (remove it)",),
    ),
    "chaos_seconds_not_positive": (
        {"chaos": [{"at_step": 1, "action": "hang-rank", "rank": 0, "seconds": 0}]},
        ("chaos[0].seconds: must be > 0 seconds, got 0",),
    ),
    "chaos_seconds_string": (
        {"chaos": [{"at_step": 1, "action": "hang-rank", "rank": 0, "seconds": "long"}]},
        ("chaos[0].seconds: must be a number of seconds, got 'long'",),
    ),
    "chaos_slow_rank_without_seconds": (
        {"chaos": [{"at_step": 1, "action": "slow-rank", "rank": 0}]},
        ("chaos[0]: slow-rank needs seconds", "seconds: 0.5"),
    ),
    "etcd_wrong_type": (
        {"etcd": 5},
        ("etcd: must be 'embedded'", "got 5", "http://127.0.0.1:2379"),
    ),
    "etcd_cert_without_key": (
        {"etcd": {"endpoints": "h:1", "cert": "c.pem"}},
        ("etcd: cert is set but key is not",),
    ),
    "etcd_user_without_password": (
        {"etcd": {"endpoints": "h:1", "user": "root"}},
        ("etcd: user is set but password is not",),
    ),
    "etcd_tls_without_endpoints": (
        {"etcd": {"ca_cert": "ca.pem"}},
        ("etcd: ca_cert only applies to an external etcd", "add endpoints"),
    ),
    "etcd_password_not_string": (
        {"etcd": {"endpoints": "h:1", "user": "u", "password": 1234}},
        ("etcd.password: must be a non-empty string, got 1234", "quote it"),
    ),
}


@pytest.mark.parametrize(("changes", "expected"), FIELD_ERRORS.values(), ids=FIELD_ERRORS.keys())
def test_invalid_field_is_rejected_with_field_value_and_fix(
    tmp_path: Path, changes: dict[str, Any], expected: tuple[str, ...]
) -> None:
    assert_mentions(error_of(tmp_path, **changes), *expected)


def test_ranks_zero_is_rejected_with_fix(tmp_path: Path) -> None:
    assert error_of(tmp_path, ranks=0) == "<spec>: ranks: must be >= 1, got 0"


def test_on_no_spare_unknown_policy_lists_the_choices(tmp_path: Path) -> None:
    message = error_of(tmp_path, on_no_spare="retry")
    assert message == "<spec>: on_no_spare: must be one of wait, shrink, fail, got 'retry'"


def test_float_field_given_a_word_names_it(tmp_path: Path) -> None:
    message = error_of(tmp_path, lease_ttl="fast")
    assert message.endswith("lease_ttl: must be a number of seconds, got 'fast'")


# ---- entrypoint resolution ------------------------------------------------------------------


def test_py_entrypoint_is_resolved_relative_to_the_spec_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train = write_train(tmp_path / "examples", "gpt.py")
    spec_path = write_spec(tmp_path / "configs", base_data(entrypoint="../examples/gpt.py:train"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the working directory must not matter

    spec = load_spec(spec_path)

    assert spec.entrypoint == f"{train}:train"
    assert os.path.isabs(spec.entrypoint.rpartition(":")[0])


def test_py_entrypoint_is_resolved_relative_to_base_dir_in_parse_spec(tmp_path: Path) -> None:
    train = write_train(tmp_path / "proj")
    spec = parse_spec(base_data(), base_dir=tmp_path / "proj")
    assert spec.entrypoint == f"{train}:train"


def test_absolute_py_entrypoint_is_kept(tmp_path: Path) -> None:
    train = write_train(tmp_path / "abs")
    spec = parse_spec(base_data(entrypoint=f"{train}:train"), base_dir=tmp_path / "nowhere")
    assert spec.entrypoint == f"{train}:train"


def test_missing_py_entrypoint_names_the_resolved_path(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path / "configs", base_data(entrypoint="../examples/gpt.py:train"))
    with pytest.raises(SpecError) as info:
        load_spec(spec_path)
    message = str(info.value)
    resolved = str(tmp_path / "examples" / "gpt.py")
    assert_mentions(message, str(spec_path), "entrypoint: file not found", resolved)
    assert_mentions(message, "'../examples/gpt.py:train'", str(tmp_path / "configs"))


def test_module_entrypoint_is_accepted_without_importing_it(tmp_path: Path) -> None:
    spec = parse_spec(base_data(entrypoint="no_such_pkg.models.gpt:train"), base_dir=tmp_path)
    assert spec.entrypoint == "no_such_pkg.models.gpt:train"
    assert "no_such_pkg" not in sys.modules


def test_output_dir_is_resolved_relative_to_the_spec_file(tmp_path: Path) -> None:
    write_train(tmp_path / "configs")
    spec = load_spec(write_spec(tmp_path / "configs", base_data(output_dir="../runs")))
    assert spec.output_dir == str(tmp_path / "runs")


def test_absolute_output_dir_is_kept(tmp_path: Path) -> None:
    spec = parse(tmp_path, output_dir=str(tmp_path / "abs-out"))
    assert spec.output_dir == str(tmp_path / "abs-out")


# ---- args -----------------------------------------------------------------------------------


def test_args_accept_nested_plain_data(tmp_path: Path) -> None:
    args = {"lr": 0.1, "sizes": [1, 2], "opt": {"betas": [0.9, 0.95]}, "tag": None, "amp": True}
    assert parse(tmp_path, args=args).args == args


def test_args_key_that_is_a_python_keyword_is_rejected(tmp_path: Path) -> None:
    assert_mentions(
        error_of(tmp_path, args={"lambda": 1}), "args:", "'lambda'", "(try 'arg_lambda')"
    )


# ---- etcd -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("etcd", "endpoints"),
    [
        (DELETE, ()),
        ("embedded", ()),
        ("etcd-0:2379", ("http://etcd-0:2379",)),
        ("http://etcd-0:2379", ("http://etcd-0:2379",)),
        ("HTTPS://etcd-0:2379/", ("https://etcd-0:2379",)),
        ("10.0.0.1:2379, 10.0.0.2:2379", ("http://10.0.0.1:2379", "http://10.0.0.2:2379")),
        (["a:1", "https://b:2"], ("http://a:1", "https://b:2")),
        ("[::1]:2379", ("http://[::1]:2379",)),
        ({"endpoints": "a:1"}, ("http://a:1",)),
        ({"endpoints": ["a:1", "b:2"]}, ("http://a:1", "http://b:2")),
        ({"endpoints": "embedded"}, ()),
    ],
    ids=[
        "absent",
        "embedded",
        "host-port",
        "http-url",
        "https-url-trailing-slash",
        "comma-separated",
        "list",
        "ipv6",
        "mapping-string",
        "mapping-list",
        "mapping-embedded",
    ],
)
def test_etcd_forms_normalise_to_endpoint_urls(
    tmp_path: Path, etcd: Any, endpoints: tuple[str, ...]
) -> None:
    spec = parse(tmp_path, etcd=etcd)
    assert spec.etcd.endpoints == endpoints
    assert spec.etcd.embedded == (not endpoints)


def test_etcd_mapping_keeps_auth_and_resolves_tls_paths(tmp_path: Path) -> None:
    etcd = {
        "endpoints": ["https://e:2379"],
        "ca_cert": "tls/ca.pem",
        "cert": "/abs/client.pem",
        "key": "/abs/client.key",
        "user": "root",
        "password": "pw",
    }
    spec = parse(tmp_path, etcd=etcd)
    assert spec.etcd.ca_cert == str(tmp_path / "tls" / "ca.pem")
    assert (spec.etcd.cert, spec.etcd.key) == ("/abs/client.pem", "/abs/client.key")
    assert (spec.etcd.user, spec.etcd.password) == ("root", "pw")


def test_etcd_password_is_not_shown_in_repr(tmp_path: Path) -> None:
    spec = parse(tmp_path, etcd={"endpoints": "e:1", "user": "root", "password": "hunter2"})
    assert "hunter2" not in repr(spec)


@pytest.mark.parametrize(
    ("etcd", "expected"),
    [
        ("etcd-host", ("etcd: bad endpoint 'etcd-host'", "needs a host and a port")),
        ("etcd-host:abc", ("etcd: bad endpoint 'etcd-host:abc'", "port 'abc' must be an integer")),
        ("etcd-host:99999", ("etcd: bad endpoint 'etcd-host:99999'", "1-65535")),
        ("ftp://etcd-host:2379", ("bad endpoint 'ftp://etcd-host:2379'", "http or https")),
        (["a:1", "b"], ("etcd[1]: bad endpoint 'b'",)),
        ({"endpoints": ["a:1", 7]}, ("etcd.endpoints[1]: bad endpoint 7",)),
    ],
    ids=["no-port", "port-not-int", "port-out-of-range", "bad-scheme", "list", "mapping"],
)
def test_bad_etcd_endpoint_is_rejected_naming_it(
    tmp_path: Path, etcd: Any, expected: tuple[str, ...]
) -> None:
    message = error_of(tmp_path, etcd=etcd)
    assert_mentions(message, *expected, "e.g. http://127.0.0.1:2379")


# ---- files: YAML errors, empty files, missing files -----------------------------------------


def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = write_spec(tmp_path, "name: demo\nranks: 4\nsteps: [1, 2\nentrypoint: x:y\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid YAML at line ")
    assert "line 4" in message or "line 3" in message


def test_yaml_bad_indentation_reports_its_line(tmp_path: Path) -> None:
    path = write_spec(tmp_path, "name: demo\nranks: 4\n  steps: 3\n")
    with pytest.raises(SpecError, match=r"job\.yaml: invalid YAML at line 3, column \d+: "):
        load_spec(path)


def test_duplicate_yaml_key_is_rejected_with_its_line(tmp_path: Path) -> None:
    path = write_spec(tmp_path, "name: demo\nranks: 4\nsteps: 3\nranks: 8\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_mentions(str(info.value), str(path), "line 4", "duplicate key 'ranks'")


def test_empty_file_is_rejected_clearly(tmp_path: Path) -> None:
    path = write_spec(tmp_path, "# only a comment\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_mentions(str(info.value), f"{path}: file is empty", "name, entrypoint, ranks and steps")


def test_top_level_list_is_rejected(tmp_path: Path) -> None:
    path = write_spec(tmp_path, "- name: demo\n")
    with pytest.raises(SpecError, match=r"job\.yaml: top level must be a mapping .*got a list"):
        load_spec(path)


def test_missing_file_is_reported_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as info:
        load_spec("job.yaml")
    assert str(info.value) == "job.yaml: no such file"


def test_directory_instead_of_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


def test_field_errors_from_a_file_are_prefixed_with_its_path(tmp_path: Path) -> None:
    write_train(tmp_path)
    path = write_spec(tmp_path, base_data(ranks=0))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == f"{path}: ranks: must be >= 1, got 0"


# ---- overrides ------------------------------------------------------------------------------


def test_overrides_are_applied_on_top_of_the_file(tmp_path: Path) -> None:
    write_train(tmp_path)
    path = write_spec(tmp_path, base_data(args={"lr": 0.1, "layers": 2}))

    spec = load_spec(path, overrides={"ranks": 8, "on_no_spare": "fail", "args.lr": 0.5})

    assert (spec.ranks, spec.on_no_spare) == (8, "fail")
    assert spec.args == {"lr": 0.5, "layers": 2}


def test_overrides_can_create_nested_mappings(tmp_path: Path) -> None:
    write_train(tmp_path)
    spec = load_spec(write_spec(tmp_path, base_data()), overrides={"env.NCCL_DEBUG": "INFO"})
    assert spec.env == {"NCCL_DEBUG": "INFO"}


def test_overrides_are_validated_like_file_values(tmp_path: Path) -> None:
    write_train(tmp_path)
    path = write_spec(tmp_path, base_data())
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides={"ranks": 0})
    assert str(info.value) == f"{path}: ranks: must be >= 1, got 0"


def test_override_with_unknown_key_suggests_the_close_match(tmp_path: Path) -> None:
    write_train(tmp_path)
    with pytest.raises(SpecError, match=r"unknown field 'rank' \(did you mean 'ranks'\?\)"):
        load_spec(write_spec(tmp_path, base_data()), overrides={"rank": 8})


def test_override_into_a_non_mapping_is_rejected(tmp_path: Path) -> None:
    write_train(tmp_path)
    path = write_spec(tmp_path, base_data(etcd="embedded"))
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides={"etcd.user": "root"})
    assert_mentions(str(info.value), str(path), "'etcd.user'", "not a mapping", "override etcd")


def test_parse_overrides_reads_values_as_yaml() -> None:
    parsed = parse_overrides(["ranks=8", "args.lr=0.5", "name=my-job", "chaos=[]", "output_dir="])
    assert parsed == {"ranks": 8, "args.lr": 0.5, "name": "my-job", "chaos": [], "output_dir": None}


def test_parse_overrides_keeps_invalid_yaml_as_a_string() -> None:
    assert parse_overrides(["name=[oops"]) == {"name": "[oops"}


@pytest.mark.parametrize("item", ["ranks", "=8"])
def test_parse_overrides_without_key_value_shows_the_form(item: str) -> None:
    with pytest.raises(SpecError, match=r"expected key=value, e\.g\. --set ranks=8"):
        parse_overrides([item])


def test_chaos_vocabulary_is_the_chaos_action_table() -> None:
    """hotspare.orchestrator.spec re-exports the names of hotspare.orchestrator.chaos (one table of actions),
    so a new action row is accepted by the spec without touching spec.py."""
    from hotspare.orchestrator import chaos, spec

    assert spec.CHAOS_ACTIONS == chaos.NAMES
    assert (spec.RANK_ACTIONS, spec.NODE_ACTIONS, spec.CONTROL_ACTIONS) == (
        chaos.RANK_ACTIONS, chaos.NODE_ACTIONS, chaos.CONTROL_ACTIONS)
    assert set(spec.RANK_ACTIONS) | set(spec.NODE_ACTIONS) | set(spec.CONTROL_ACTIONS) == set(
        spec.CHAOS_ACTIONS)


@pytest.mark.parametrize("name", ["abc\n", "abc\n#x", "a\nb"])
def test_a_name_with_a_newline_is_refused(name: str) -> None:
    """Security review F11: ``$`` matches before a trailing newline, so ``name: "abc\\n"``
    passed and broke the Slurm script (and reached etcd keys and /dev/shm names)."""
    with pytest.raises(SpecError, match="must be 1-63 lowercase letters"):
        parse_name(name)


@pytest.mark.parametrize("field,value", [
    ("output_dir", "runs/x\ntouch PWNED_output_dir"),
    ("slurm", {"partition": "gpu\ntouch PWNED_partition"}),
    ("slurm", {"sbatch_args": ["--exclusive", "--comment=a\ntouch PWNED"]}),
    ("env", {"A": "x\0y"}),
])
def test_values_that_would_inject_lines_into_a_batch_script_are_refused(tmp_path: Path, field: str, value: Any) -> None:
    """Security review F12/F18: output_dir, Slurm options and sbatch_args went unquoted into
    the batch script, so a newline in them injected shell lines; a NUL in an env value made
    every agent die at spawn. Refused at submit, naming the field."""
    fields = {"backend": "slurm"} if field == "slurm" else {}
    with pytest.raises(SpecError, match="control characters|NUL"):
        load_spec(REPO_ROOT / "configs" / "demo.yaml", {**fields, field: value})


def test_slurm_setup_may_still_hold_several_shell_lines(tmp_path: Path) -> None:
    spec = load_spec(REPO_ROOT / "configs" / "demo.yaml",
                     {"backend": "slurm", "slurm": {"setup": "module load cuda\nsource env.sh"}})
    assert spec.slurm["setup"].count("\n") == 1


def test_the_slurm_secret_file_is_0600_even_over_an_older_wider_one(tmp_path: Path) -> None:
    """Security review F14: the secret was opened with O_CREAT|O_TRUNC, which keeps the mode
    of a file that already exists (0644 from an earlier run, say)."""
    from hotspare.orchestrator.launchers.slurm import write_private

    secret = tmp_path / "secret"
    secret.write_text("old")
    secret.chmod(0o644)
    write_private(secret, "new")
    assert secret.read_text() == "new" and (secret.stat().st_mode & 0o777) == 0o600


def test_slurm_refuses_an_etcd_password_that_would_be_stored_with_the_job(tmp_path: Path, monkeypatch) -> None:
    """Security review F19: a spec's inline password is exported to the CLI's environment, and
    sbatch stores that environment with the job. The Slurm launcher wants a password file."""
    from hotspare.orchestrator.launchers import LaunchError
    from hotspare.orchestrator.launchers.slurm import SlurmLauncher

    monkeypatch.setenv("HOTSPARE_ETCD_PASSWORD", "s3cret")
    monkeypatch.delenv("HOTSPARE_ETCD_PASSWORD_FILE", raising=False)
    spec = load_spec(REPO_ROOT / "configs" / "demo.yaml", {"backend": "slurm", "output_dir": str(tmp_path)})
    with pytest.raises(LaunchError, match="HOTSPARE_ETCD_PASSWORD_FILE"):
        SlurmLauncher().launch(spec, ["http://e:2379"])
    assert not (tmp_path / "slurm").exists() or not list((tmp_path / "slurm").iterdir())


@pytest.mark.parametrize("field,value,msg", [
    ("ranks", 10**30, "must be <= 65536"),
    ("steps", 2**70, "must be <= 9007199254740991"),
    ("lease_ttl", 1e300, "must be <= 2.592e\\+06 seconds"),
])
def test_absurd_numbers_are_refused(field: str, value: Any, msg: str) -> None:
    """Security review F18: no upper bounds -- ranks: 1e30 had the local backend build a list of
    10^30 nodes, and a TTL of 1e300 overflowed gRPC's int64."""
    with pytest.raises(SpecError, match=msg):
        load_spec(REPO_ROOT / "configs" / "demo.yaml", {field: value})
