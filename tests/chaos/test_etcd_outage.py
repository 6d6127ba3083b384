"""etcd goes away for 10 s mid-job: training continues, nobody restarts, failures during
and after the outage are recovered. Uses the embedded cluster (`hotspare up`)."""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from hotspare.orchestrator import embedded
from hotspare.orchestrator.store import JobStore

pytestmark = pytest.mark.timeout(400)


def _max_hb_step(job: str) -> int:
    """Training progress read the way the agents read it: the workers' heartbeat files."""
    best = -1
    for path in glob.glob(f"/dev/shm/hotspare-{job}-*/*.hb"):
        try:
            with open(path, "rb") as f:
                state, step, _t, _pid = struct.unpack("<qqdq", f.read(32))
        except (OSError, struct.error):
            continue
        if state == 2:
            best = max(best, step)
    return best


def test_training_survives_a_10s_etcd_outage_with_failures_during_and_after(tmp_path):
    from ..conftest import EXAMPLES

    env = dict(os.environ, HOTSPARE_STATE_DIR=str(tmp_path / "state"), PYTHONUNBUFFERED="1")
    env.pop("HOTSPARE_ETCD", None)

    def cli(*args, check=True, **kw):
        r = subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", *args], env=env,
                           capture_output=True, text=True, timeout=120, **kw)
        assert not check or r.returncode == 0, r.stdout + r.stderr
        return r

    cli("up")
    cluster = embedded.load(tmp_path / "state")
    try:
        spec = tmp_path / "outage.yaml"
        spec.write_text(json.dumps({
            "name": "outage", "entrypoint": str(EXAMPLES / "allreduce.py") + ":train",
            "ranks": 3, "spares": 2, "steps": 700, "lease_ttl": 3, "hang_timeout": 60,
            "output_dir": str(tmp_path / "out"), "args": {"step_sleep": 0.02},
        }))
        cli("submit", str(spec))
        js = JobStore(cluster.store(), "outage")  # with the embedded etcd's password
        deadline = time.monotonic() + 120
        while _max_hb_step("outage") < 50:
            assert time.monotonic() < deadline, "job did not start"
            time.sleep(0.2)
        agents = json.loads((tmp_path / "out" / "agents.json").read_text())
        victim = next(e.data["pid"] for e in js.events() if e.kind == "rebuilt" and e.data["rank"] == 2)

        outage = subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", "chaos", "outage",
                                   "--action", "restart-etcd", "--seconds", "10"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.5)  # etcd is down now
        before = _max_hb_step("outage")
        time.sleep(3.0)
        during = _max_hb_step("outage")
        assert during > before + 20, f"training stalled without etcd ({before} -> {during})"
        os.kill(victim, signal.SIGKILL)  # a failure while etcd is away
        out, _ = outage.communicate(timeout=60)
        assert outage.returncode == 0, out

        # once etcd is back the failure is reported and swapped
        deadline = time.monotonic() + 60
        while True:
            try:
                if js.epoch() >= 2:
                    break
            except Exception:  # noqa: BLE001 - the client reconnects by itself
                pass
            assert time.monotonic() < deadline, "failure during the outage was not recovered"
            time.sleep(0.2)
        cli("chaos", "outage", "--action", "kill-rank", "--rank", "0")  # and one after it
        deadline = time.monotonic() + 180
        while not js.state()[0].terminal:
            assert time.monotonic() < deadline, "job did not finish"
            time.sleep(0.5)
        state, msg = js.state()
        assert state.value == "succeeded", msg
        assert js.epoch() == 3
        # agents and controller rode the outage out: same processes throughout
        for node, pid in agents.items():
            assert _alive_or_exited_cleanly(pid), f"agent {node} died during the outage"
        assert embedded.load(tmp_path / "state").controller_pid == cluster.controller_pid
        leaders = [e for e in js.events() if e.kind == "leader"]
        assert len(leaders) == 1, "the controller never lost its leadership"
    finally:
        cli("down", check=False)


def _alive_or_exited_cleanly(pid: int) -> bool:
    # agents exit 0 when the job ends; they were not restarted (same pid recorded at start)
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return True  # exited after the job ended; a crash would have left a failed job
