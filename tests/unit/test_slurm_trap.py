"""The Slurm batch script's exit trap, run by bash: what it leaves in the output directory when
Slurm stops the job (SIGTERM: scancel, the time limit) and when the job ends by itself.

The script's prologue (variables, ``keep``, ``cleanup``, the traps) runs as generated; the
``hotspare`` it calls is a small shell script that answers ``status``/``events`` like the CLI
would with etcd up ($FAKE_STATUS/$FAKE_EVENTS) or fails like it does with etcd gone."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from hotspare.orchestrator.launchers import LaunchError
from hotspare.orchestrator.launchers.slurm import SlurmLauncher, _prologue
from hotspare.orchestrator.spec import load_spec

REPO_ROOT = Path(__file__).resolve().parents[2]

FAKE_CLI = """#!/bin/bash
# called as: FAKE -m hotspare.orchestrator.cli {status|events} JOB --etcd URL --json
case "$3" in
  status) [ -n "${FAKE_STATUS:-}" ] && { echo "$FAKE_STATUS"; exit 0; } ;;
  events) [ -n "${FAKE_EVENTS:-}" ] && { echo "$FAKE_EVENTS"; exit 0; } ;;
esac
echo "hotspare $3: error: cannot use etcd (connection refused)" >&2
exit 2
"""


def _run_prologue(tmp: Path, *, stopped: bool, persist_every: int = 10, **fake: str) -> Path:
    """Run the script's prologue with an etcd URL set, then either end normally or wait until
    SIGTERM arrives (as a stopped allocation's batch shell does); the output dir."""
    cli = tmp / "fake-python"
    cli.write_text(FAKE_CLI)
    cli.chmod(0o755)
    out = tmp / "out"
    spec = load_spec(REPO_ROOT / "configs" / "demo.yaml",
                     {"backend": "slurm", "output_dir": str(out), "persist_every": persist_every,
                      "slurm": {"python": str(cli)}})
    spec = dataclasses.replace(spec, run_id="20261204-120000-abcd")
    body = "\n".join(_prologue(spec)) + "\nETCD=https://127.0.0.1:1\n"
    body += 'sleep 60 & agents+=($!); echo ready; wait\n' if stopped else "true\n"
    env = dict(os.environ, **{f"FAKE_{k.upper()}": v for k, v in fake.items()})
    p = subprocess.Popen(["bash", "-c", body], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if stopped:
            for line in p.stdout:  # the script's own lines first ("hotspare: job ... on nodes")
                if line.strip() == "ready":
                    p.send_signal(signal.SIGTERM)
                    break
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == (143 if stopped else 0), err
    return out


def _status(out: Path) -> dict:
    return json.loads((out / "final-status.json").read_text())


RUNNING = json.dumps({"job": "demo", "state": "running", "message": "", "epoch": 1})
CANCELLED = json.dumps({"job": "demo", "state": "cancelled", "message": "cancelled by user", "epoch": 1})
EVENTS = json.dumps({"events": [], "recoveries": []})


def test_stopped_by_slurm_with_its_etcd_gone_it_says_so_and_how_to_resume(tmp_path):
    out = _run_prologue(tmp_path, stopped=True)
    st = _status(out)
    assert st["state"] == "cancelled" and st["run_id"] == "20261204-120000-abcd"
    assert "stopped by Slurm" in st["message"] and "hotspare submit --resume" in st["message"]
    assert str(out / "checkpoints" / "20261204-120000-abcd") in st["message"]
    assert not (out / "final-events.json").exists()  # no timeline to keep: never an empty one
    assert sorted(p.name for p in out.iterdir()) == ["final-status.json", "logs"]  # no .tmp left


def test_stopped_without_checkpoints_it_says_a_new_submission_starts_from_step_0(tmp_path):
    st = _status(_run_prologue(tmp_path, stopped=True, persist_every=0))
    assert "persist_every: 0" in st["message"] and "from step 0" in st["message"]
    assert "--resume" not in st["message"]


def test_stopped_while_etcd_still_answers_running_keeps_its_own_status_and_the_timeline(tmp_path):
    out = _run_prologue(tmp_path, stopped=True, status=RUNNING, events=EVENTS)
    assert "stopped by Slurm" in _status(out)["message"]  # not "running" after the allocation
    assert json.loads((out / "final-events.json").read_text()) == json.loads(EVENTS)


@pytest.mark.parametrize("stopped", [True, False])
def test_an_end_recorded_in_etcd_is_what_it_leaves(tmp_path, stopped):
    out = _run_prologue(tmp_path, stopped=stopped, status=CANCELLED, events=EVENTS)
    assert _status(out) == json.loads(CANCELLED)


def test_a_new_submission_removes_what_a_killed_trap_left_half_written(tmp_path, monkeypatch):
    """SIGKILL (KillWait after the SIGTERM) can cut the trap short while it writes: the next
    submission of the name must not find those files (nor the last run's outcome)."""
    out = tmp_path / "out"
    out.mkdir()
    left = ["final-status.json", "final-status.json.tmp", "final-events.json", "final-events.json.tmp"]
    for name in left:
        (out / name).write_text("{")
    spec = load_spec(REPO_ROOT / "configs" / "demo.yaml", {"backend": "slurm", "output_dir": str(out)})
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    with pytest.raises(LaunchError, match="sbatch"):  # all is written but nothing submitted
        SlurmLauncher().launch(spec, [])
    assert not [name for name in left if (out / name).exists()]
