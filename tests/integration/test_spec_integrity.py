"""Write access to a job's etcd keys is not code execution on its nodes (security review F2).

Workers used to re-read the job's spec -- entrypoint, args, env -- from etcd every time one
started, so whoever could write ``/hotspare/<job>/spec`` (on the embedded etcd: any local
user) chose the code the next (re)started worker imported. Now the agent pins the spec it
validated in its private run directory and its workers run that one; an agent given the
submitted spec's digest (every launcher passes it) refuses a spec that differs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hotspare.orchestrator.spec import JobSpec

pytestmark = pytest.mark.timeout(300)

TRAIN = '''
import time

def train(session, step_sleep=0.05):
    for step in session.steps():
        session.allreduce_grads(__import__("torch").nn.Linear(2, 2))
        time.sleep(step_sleep)
'''

EVIL = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported by a worker")

def train(session, **_):
    raise SystemExit("evil")
'''


def test_a_spec_rewritten_in_etcd_is_not_what_a_restarted_worker_runs(cluster):
    """An attacker rewrites the running job's spec in etcd to an entrypoint of theirs, then a
    worker dies: the worker that replaces it (and the warm one its agent starts next) run
    the submitted code. Without the pinned spec the replacement imported evil.py."""
    train = cluster.tmp / "train.py"
    train.write_text(TRAIN)
    marker = cluster.tmp / "PWNED"
    evil = cluster.tmp / "evil.py"
    evil.write_text(EVIL.format(marker=str(marker)))
    cluster.controller()
    spec = cluster.spec_file(name="pinned", entrypoint=f"{train}:train", ranks=2, spares=1, steps=120,
                             args={"step_sleep": 0.05})
    run = subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", "run", "--no-check", str(spec), "--json"],
                           env=cluster.env, cwd=cluster.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        js = cluster.job("pinned")
        # each rank's first trained step is published at once (then every 10 s): both train
        cluster.wait(lambda: js.exists() and len(js.snapshot().progress) == 2
                     and min(p.step for p in js.snapshot().progress.values()) >= 0, what="the job to make progress")
        # the attack: a plain etcd write, no credentials needed on the embedded etcd
        raw = json.loads(cluster.store.get(js.keys.spec).value)
        raw["entrypoint"] = f"{evil}:train"
        cluster.store.put(js.keys.spec, json.dumps(raw))
        js.send_chaos("node1", {"action": "kill-rank", "rank": 1})
        out, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    summary = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert summary["state"] == "succeeded", out[-3000:]
    assert summary["recoveries"], "the kill did not happen: the test proves nothing"
    assert not marker.exists(), "a worker imported the entrypoint an etcd writer put in the spec"


def test_an_agent_refuses_a_spec_that_is_not_the_submitted_one(cluster, tmp_path):
    """The launcher hands each agent the digest of the spec it submitted; a spec in etcd that
    differs (rewritten between submit and the agent's start) is refused with the reason."""
    from hotspare.orchestrator.spec import load_spec

    js = cluster.job("tampered")
    js.submit(load_spec(cluster.spec_file(name="tampered", ranks=1, spares=0, steps=5)), b"x" * 32)
    submitted = js.spec()
    digest = submitted.digest()
    raw = json.loads(cluster.store.get(js.keys.spec).value)
    raw["env"] = {"LD_PRELOAD": "/tmp/evil.so"}  # ... and what an etcd writer makes of it
    cluster.store.put(js.keys.spec, json.dumps(raw))
    p = subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", "agent", "--job", "tampered",
                        "--node", "node0", "--spec-sha256", digest, "--zygote", "off", "--wait", "10"],
                       env=cluster.env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "is not the one submitted" in p.stderr + p.stdout and "refusing to run it" in p.stderr + p.stdout


def test_the_digest_survives_the_round_trip_through_etcd():
    """What the launcher computes from the spec it submits equals what the agent computes
    from the spec it reads back (JSON through etcd)."""
    from hotspare.orchestrator.spec import load_spec

    from ..conftest import REPO

    spec = load_spec(REPO / "configs" / "demo.yaml", {"args.lr": 0.1, "env": {"A": "b"}})
    back = JobSpec.from_json(spec.to_json())
    assert back.digest() == spec.digest()
    assert JobSpec.from_dict({**spec.to_dict(), "entrypoint": "x.py:train"}).digest() != spec.digest()
