"""The CLI tells the truth about a real job: Ctrl-C on `run` stops it, `status --json` carries the
step, the total and every logged metric, `run`'s progress never goes backwards across a
recovery, `logs --follow` ends with the job, `logs --rank R` shows what the worker that took
rank R logged while it was still warm, and a closed stdout is no error.

Real etcd, controller, agents, workers and gloo (the ``cluster`` fixture).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

WARMUP_LINE = "warming up: loading the data"

TRAIN = f'''
import time

import torch


def warmup(**args):
    print("{WARMUP_LINE}", flush=True)


def train(session, step_sleep=0.03):
    for step in session.steps():
        x = torch.ones(4)
        session.allreduce(x)
        session.log(loss=1.0 / (step + 1), acc=step / session.total_steps)
        time.sleep(step_sleep)
'''


def _entrypoint(tmp: Path) -> str:
    path = tmp / "truth_train.py"
    path.write_text(TRAIN)
    return f"{path}:train"


def _popen(cluster, *args: str, log: Path) -> subprocess.Popen:
    """`hotspare ARGS` with its output in ``log`` (not in the fixture's process group: the
    test sends it signals itself). SIGINT is set back to its default in the child, as at a
    terminal: a suite started in the background (`make test &` from a script) ignores SIGINT,
    that is inherited, and Python then installs no KeyboardInterrupt handler."""
    return subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", *args], env=cluster.env,
                            cwd=cluster.tmp, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def job_processes(job: str) -> list[int]:
    """Live processes of ``job``: its agents (``--job JOB``) and workers (``HOTSPARE_JOB=JOB``)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a == b"--job" and b == job.encode() for a, b in zip(argv, argv[1:], strict=False)) or \
                f"HOTSPARE_JOB={job}".encode() in env:
            found.append(int(d.name))
    return found


def _step(cluster, job: str) -> int:
    return min((p.step for p in cluster.job(job).snapshot().progress.values()), default=-1)


def test_ctrl_c_on_run_cancels_the_job_and_leaves_no_process_of_it(cluster, tmp_path):
    cluster.controller()
    job = f"sigint-{os.getpid()}"
    spec = cluster.spec_file(name=job, ranks=2, spares=0, steps=100000)
    log = tmp_path / "run.log"
    run = _popen(cluster, "run", str(spec), log=log)
    try:
        cluster.wait(lambda: _step(cluster, job) >= 3, what="the job to make progress")
        assert job_processes(job), "the test cannot see the job's processes"
        run.send_signal(signal.SIGINT)
        rc = run.wait(120)
    finally:
        if run.poll() is None:
            run.kill()
    out = log.read_text()
    assert rc == 130, out
    assert f"cancelling job {job}" in out and "no process of it is left" in out, out
    assert "Traceback" not in out, out
    assert cluster.job(job).state()[0].value == "cancelled"
    assert job_processes(job) == [], out
    status = json.loads(cluster.hotspare("status", job, "--json", check=True).stdout)
    assert not [r for r in status["ranks"] if r["state"] in ("running", "straggler")], status


def _progress_steps(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"\| steps (\d+)/\d+ \|", out)]


def test_status_progress_and_logs_tell_the_truth_across_a_recovery(cluster, tmp_path):
    cluster.controller()
    job = f"truth-{os.getpid()}"
    spec = cluster.spec_file(name=job, ranks=2, spares=1, steps=150, entrypoint=_entrypoint(tmp_path),
                             args={"step_sleep": 0.05},
                             chaos=[{"at_step": 60, "action": "kill-rank", "rank": 1}])
    run_log, follow_log = tmp_path / "run.log", tmp_path / "follow.log"
    run = _popen(cluster, "run", str(spec), log=run_log)
    follow = None
    try:
        cluster.wait(lambda: cluster.job(job).exists(), what="the job to be registered")
        follow = _popen(cluster, "logs", job, "--follow", log=follow_log)

        def metrics_shown() -> bool:
            data = json.loads(cluster.hotspare("status", job, "--json", check=True).stdout)
            return data["step"] > 0 and {"loss", "acc"} <= set(data["metrics"])
        cluster.wait(metrics_shown, what="status --json to show the step and the metrics")
        data = json.loads(cluster.hotspare("status", job, "--json", check=True).stdout)
        assert data["total_steps"] == 150 and 0 <= data["metrics"]["acc"] <= 1  # the first step's may be 0
        assert all("acc" in r["metrics"] for r in data["ranks"] if r["state"] == "running"), data
        assert run.wait(240) == 0, run_log.read_text()
        assert follow.wait(60) == 0  # --follow ended by itself when the job did
    finally:
        for p in (run, follow):
            if p is not None and p.poll() is None:
                p.kill()
    out = run_log.read_text()
    steps = _progress_steps(out)
    assert steps and steps == sorted(steps), f"the progress went backwards: {steps}\n{out}"
    assert "epoch 2" in out, out  # the recovery happened while `run` watched
    assert f"output: {tmp_path / 'out' / job}" in out and "final metrics" in out and "acc 0.99" in out, out
    followed = follow_log.read_text()
    assert "rank0.log" in followed and "assigned rank 0" in followed, followed

    # the spare's worker printed the line while warm, into its slot log: rank 1's logs show it
    [spare] = [e for e in cluster.job(job).events() if e.kind == "assigned" and e.data["epoch"] == 2]
    r = cluster.hotspare("logs", job, "--rank", "1", check=True)
    assert f"worker pid {spare.data['pid']} before it took rank 1" in r.stdout, r.stdout
    assert r.stdout.count(WARMUP_LINE) == 2, r.stdout  # the first holder's and the spare's
    assert "assigned rank 1" in r.stdout

    # a reader that stops early (`| head`) is no error
    for args in (["status", job], ["events", job], ["logs", job]):
        p = subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", *args], env=cluster.env,
                             cwd=cluster.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()  # closed before anything was written: the first write breaks the pipe
        err = p.stderr.read().decode()
        assert p.wait(60) == 0, (args, err)
        assert "Traceback" not in err and "Broken" not in err and "error" not in err, (args, err)
