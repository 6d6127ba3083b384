"""The ``hotspare`` entry point without a cluster: the parser, the etcd settings it takes, the
one-line errors, and what ``hotspare --help`` loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hotspare.orchestrator import chaos
from hotspare.orchestrator.cli import COMMANDS, _error_line, build_parser, main
from hotspare.orchestrator.commands.common import EtcdSettings
from hotspare.orchestrator.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _grpc_quiet(monkeypatch):
    """main() sets GRPC_VERBOSITY in the environment: undone after each test."""
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_the_old_names_stay_importable_from_the_entry_point():
    from hotspare.orchestrator.cli import AGENT_ACTIONS, ALL_ACTIONS, CliError, inject, register_job  # noqa: F401

    assert ALL_ACTIONS == chaos.CLI_ACTIONS and AGENT_ACTIONS == chaos.AGENT_ACTIONS


def test_subcommands_are_listed_in_their_documented_order():
    assert [c.name for c in COMMANDS] == ["up", "down", "submit", "run", "status", "events", "logs",
                                          "checkpoint", "wait", "cancel", "chaos", "agent", "controller",
                                          "etcd"]


def test_controller_leader_ttl_and_its_hidden_deprecated_alias(capsys):
    assert parse("controller").leader_ttl == 3.0
    assert parse("controller", "--leader-ttl", "1.5").leader_ttl == 1.5
    assert parse("controller", "--ttl", "2").leader_ttl == 2.0
    assert "--ttl is deprecated; use --leader-ttl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("controller", "--help")
    out = capsys.readouterr().out
    assert "--leader-ttl" in out and "--ttl" not in out.replace("--leader-ttl", "")


def test_chaos_accepts_the_table_s_command_line_actions_and_describes_each(capsys):
    for name in chaos.CLI_ACTIONS:
        assert parse("chaos", "j", "--action", name).action == name
    spec_only = [n for n, a in chaos.ACTIONS.items() if a.spec_only]
    assert spec_only
    with pytest.raises(SystemExit):
        parse("chaos", "j", "--action", spec_only[0])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse("chaos", "--help")
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")
              and line.split()[0] in chaos.NAMES]
    assert listed == list(chaos.CLI_ACTIONS)


def test_etcd_flags_win_over_the_environment_which_wins_over_the_spec(monkeypatch, tmp_path):
    for var in ("HOTSPARE_ETCD_CA", "HOTSPARE_ETCD_USER", "HOTSPARE_ETCD_PASSWORD", "HOTSPARE_ETCD_PASSWORD_FILE"):
        monkeypatch.setenv(var, "")  # recorded, so that what s.export() sets below is undone afterwards
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOTSPARE_ETCD_USER", "from-env")
    monkeypatch.setenv("HOTSPARE_ETCD_PASSWORD", "env-password")
    pw = tmp_path / "pw"
    pw.write_text("file-password\n")
    s = EtcdSettings.from_flags(parse("status", "--etcd-ca", "ca.pem", "--etcd-password-file", str(pw)))
    spec = load_spec(REPO / "configs" / "demo.yaml",
                     {"etcd.endpoints": ["https://e:2379"], "etcd.user": "from-spec", "etcd.password": "spec-pw",
                      "etcd.ca_cert": str(tmp_path / "spec-ca.pem")})
    s.fill_from_spec(spec)
    opts = s.options()
    assert opts["ca_cert"] == os.path.abspath("ca.pem")  # the flag, made absolute
    assert opts["user"] == "from-env"
    assert opts["password"] == "file-password"  # the flag's file, not the environment's password
    assert os.environ["HOTSPARE_ETCD_PASSWORD"] == "env-password"  # nothing written yet
    assert "HOTSPARE_ETCD_CA" not in os.environ
    s.export()
    assert os.environ["HOTSPARE_ETCD_CA"] == os.path.abspath("ca.pem")
    assert "HOTSPARE_ETCD_PASSWORD" not in os.environ


def test_the_spec_fills_what_flags_and_environment_leave_open(monkeypatch, tmp_path):
    for var in ("HOTSPARE_ETCD_USER", "HOTSPARE_ETCD_PASSWORD", "HOTSPARE_ETCD_PASSWORD_FILE"):
        monkeypatch.delenv(var, raising=False)
    s = EtcdSettings.from_flags(parse("status"))
    s.fill_from_spec(load_spec(REPO / "configs" / "demo.yaml", {"etcd.endpoints": ["http://e:2379"], "etcd.user": "u", "etcd.password": "p"}))
    assert (s.options()["user"], s.options()["password"]) == ("u", "p")


def test_a_command_that_starts_nothing_leaves_the_environment_alone(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("HOTSPARE_ETCD_USER", raising=False)
    monkeypatch.delenv("HOTSPARE_ETCD", raising=False)
    rc = main(["submit", str(REPO / "configs" / "demo.yaml"), "--dry-run", "--etcd-user", "someone",
               "--state-dir", str(tmp_path)])
    assert rc == 0 and '"name": "demo"' in capsys.readouterr().out
    assert "HOTSPARE_ETCD_USER" not in os.environ


def test_errors_are_one_line_naming_what_failed(tmp_path, capsys):
    assert main(["submit", str(tmp_path / "none.yaml"), "--dry-run", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hotspare submit: error: ") and err.count("\n") == 1 and "none.yaml" in err
    assert _error_line(OSError(13, "Permission denied", "/out/x")) == "/out/x: Permission denied"
    assert _error_line(subprocess.TimeoutExpired(["squeue", "-h"], 30)) == (
        "`squeue -h` did not answer within 30s; is the scheduler reachable from here?")


def test_help_loads_neither_torch_nor_a_scheduler_library():
    code = ("import sys\nfrom hotspare.orchestrator.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for m in ('torch', 'kubernetes', 'ray', 'hotspare.agents.agent') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
