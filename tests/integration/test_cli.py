"""The CLI's user-facing errors: one clear line, exit code 2, nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"ranks": 0}, ["ranks", "must be >= 1", "got 0"]),
        ({"on_no_spare": "retry"}, ["on_no_spare", "wait, shrink, fail", "retry"]),
        ({"rank": 3}, ["unknown field 'rank'", "did you mean 'ranks'"]),
        ({"entrypoint": "missing.py:train"}, ["entrypoint", "missing.py"]),
        ({"chaos": [{"at_step": -1, "action": "kill-rank", "rank": 0}]}, ["chaos[0].at_step", "-1"]),
    ],
)
def test_malformed_spec_is_one_clear_error_and_nothing_is_submitted(cluster, fields, words):
    spec = cluster.spec_file(name="bad", **fields)
    r = cluster.hotspare("run", str(spec))
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1, r.stderr
    for w in words:
        assert w in err[0], err[0]
    assert not cluster.job("bad").exists()


def test_status_of_unknown_job_names_it(cluster):
    r = cluster.hotspare("status", "nope")
    assert r.returncode == 2 and "no job named 'nope'" in r.stderr


def test_dry_run_prints_the_resolved_spec_without_submitting(cluster):
    spec = cluster.spec_file(name="dry")
    r = cluster.hotspare("submit", str(spec), "--dry-run", check=True)
    assert '"ranks": 3' in r.stdout and not cluster.job("dry").exists()


def test_kubernetes_dry_run_writes_only_kubernetes_objects_to_stdout(tmp_path):
    """`hotspare submit --dry-run SPEC | kubectl apply -f -`: every YAML document on stdout is a
    Kubernetes object (the resolved spec is there as comments), valid by the strict schema."""
    import os

    import yaml

    config = Path(__file__).resolve().parents[2] / "configs" / "kubernetes.yaml"
    env = {k: v for k, v in os.environ.items() if k != "HOTSPARE_ETCD"}
    r = subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", "submit", str(config), "--dry-run",
                        "--state-dir", str(tmp_path / "state")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert '#   "ranks": 4,' in r.stdout  # the resolved spec, readable, as comments
    docs = [d for d in yaml.safe_load_all(r.stdout) if d is not None]
    assert len(docs) >= 5
    for d in docs:
        assert isinstance(d, dict) and d.get("apiVersion") and d.get("kind"), d
    try:
        import kubernetes_validate as kv
    except ImportError:
        return
    for d in docs:
        kv.validate(d, kv.latest_version(), strict=True)


def test_every_command_has_help(cluster):
    for cmd in ("up", "down", "run", "submit", "status", "events", "logs", "cancel", "chaos",
                "agent", "controller", "etcd", "wait", "checkpoint"):
        r = cluster.hotspare(cmd, "--help", check=True)
        assert "usage: hotspare " + cmd in r.stdout


def test_a_failed_launch_leaves_no_job_behind(cluster, tmp_path):
    """The job is registered in etcd before the backend launches it; if the launch fails
    (here: no kubeconfig), the registration is undone so the same name can be resubmitted."""
    spec = cluster.spec_file(name="nolaunch", backend="kubernetes", etcd=[cluster.endpoint])
    cluster.env["KUBECONFIG"] = str(tmp_path / "no-such-kubeconfig")
    for _ in range(2):  # the second submit is not refused as a duplicate
        r = cluster.hotspare("submit", str(spec))
        assert r.returncode == 2 and "kubernetes:" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "exists" not in r.stderr
        assert not cluster.job("nolaunch").exists()


def test_scheduler_commands_without_the_scheduler_tools_are_one_clear_error(cluster, tmp_path):
    """A Slurm job's record is there, but this machine has no scancel/squeue on PATH (a
    workstation, not the login node): cancel, status and wait say so; no traceback."""
    from hotspare.orchestrator.launchers import save_record

    save_record(tmp_path / "state", "elsewhere", {
        "backend": "slurm", "endpoints": [], "output_dir": str(tmp_path / "out" / "elsewhere"),
        "info": {"job_id": "4242", "endpoints_file": str(tmp_path / "none")}, "time": 0})
    env = {k: v for k, v in cluster.env.items() if k != "HOTSPARE_ETCD"}
    env["PATH"] = str(tmp_path / "empty-bin")
    for args in (["cancel", "elsewhere"], ["status", "elsewhere"], ["wait", "elsewhere", "--timeout", "2"]):
        r = subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", *args], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
        assert r.stderr.startswith(f"hotspare {args[0]}: error: "), (args, r.stderr)
    assert "scancel" in subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", "cancel", "elsewhere"], env=env,
                                       cwd=tmp_path, capture_output=True, text=True, timeout=60).stderr


def test_an_agent_whose_etcd_does_not_answer_yet_waits_for_it_then_says_why_it_gave_up(etcd, tmp_path):
    """An agent may start before its etcd does (pods start in any order) or while it is too busy
    for one ping: it retries for --wait seconds, saying so, instead of dying on the first try."""
    from ..conftest import wait_until

    cmd = [sys.executable, "-m", "hotspare.orchestrator.cli", "agent", "--job", "nojob", "--node", "n0",
           "--etcd", etcd.endpoint, "--zygote", "off", "--wait", "10"]
    etcd.suspend()  # SIGSTOP: it accepts connections and never answers
    err = tmp_path / "agent.err"
    with open(err, "wb") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
    try:
        wait_until(lambda: "retrying for up to" in err.read_text(), "the agent to say it retries", timeout=60)
        assert p.poll() is None
    finally:
        etcd.resume()
    # etcd answers now: the agent connects and waits for its job (which never comes) -- the
    # error it ends with is that one, not the connection
    assert p.wait(120) == 2
    text = err.read_text()
    assert "job nojob not found in etcd after" in text, text
    assert "cannot use etcd" in text  # what it retried on, named

    # no etcd at all: the same patience, then one clear error naming the endpoint
    from hotspare.orchestrator.etcd_server import free_port

    nothing = f"http://127.0.0.1:{free_port()}"
    dead = subprocess.run([*cmd[:-6], "--etcd", nothing, "--zygote", "off", "--wait", "2"], capture_output=True,
                          text=True, timeout=120)
    assert dead.returncode == 2 and f"cannot use etcd at {nothing}" in dead.stderr.splitlines()[-1], dead.stderr


def test_a_controller_started_before_its_etcd_answers_waits_for_it_and_then_leads(tmp_path):
    """A controller that gave up on an etcd too busy to answer its first ping left the job it
    was started for unplaced, with nobody to say so: it waits (saying so) and then leads."""
    import os
    import subprocess
    import sys

    from hotspare.orchestrator.etcd_server import EtcdServer, free_port
    from hotspare.orchestrator.spec import load_spec
    from hotspare.orchestrator.store import JobStore, Store, wait_until

    from ..conftest import write_spec

    srv = EtcdServer(tmp_path / "etcd", free_port(), free_port())
    env = dict(os.environ, HOTSPARE_ETCD=srv.endpoint, HOTSPARE_STATE_DIR=str(tmp_path / "state"))
    ctl = subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", "controller", "--leader-ttl", "2"],
                           env=env, stderr=subprocess.PIPE, text=True)
    try:
        said = ctl.stderr.readline()  # blocks until it says it waits (or exits)
        assert "retrying for up to" in said and "etcd" in said, said
        srv.start(log_path=tmp_path / "etcd.log")
        srv.wait_ready()
        st = Store([srv.endpoint])
        js = JobStore(st, "late")
        js.submit(load_spec(write_spec(tmp_path, name="late", ranks=1, spares=0, steps=5)), b"x" * 32)
        assert wait_until(lambda: js.snapshot().leader is not None, timeout=60), "the controller never led the job"
        assert ctl.poll() is None
    finally:
        ctl.terminate()
        ctl.wait(30)
        srv.stop()
