"""The user guide's port (docs/user-guide.md): the ordinary torchrun script runs under
torchrun, and its hotspare port runs as a job from its own job.yaml (examples/torchrun_port/)."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys

from hotspare import load_final

from ..conftest import EXAMPLES, REPO

PORT = EXAMPLES / "torchrun_port"


def test_the_user_guide_shows_the_real_diff_and_job_yaml():
    """docs/user-guide.md quotes the port's diff and job.yaml: they must not drift apart."""
    guide = (REPO / "docs" / "user-guide.md").read_text()
    before = (PORT / "train_torchrun.py").read_text().splitlines(keepends=True)
    after = (PORT / "train_hotspare.py").read_text().splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(before, after, "train_torchrun.py", "train_hotspare.py"))
    assert "```diff\n" + diff + "```" in guide, "regenerate the diff in docs/user-guide.md"
    assert "```yaml\n" + (PORT / "job.yaml").read_text() + "```" in guide


def test_the_torchrun_script_runs_under_torchrun(tmp_path):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(PORT / "train_torchrun.py"), "--steps", "4", "--out", str(tmp_path / "model.pt")],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "step 0 loss" in r.stdout and (tmp_path / "model.pt").exists()


def test_its_port_runs_under_hotspare_from_the_examples_job_yaml(cluster):
    out = cluster.tmp / "out" / "port"
    cluster.controller()
    summary, r = cluster.run_json(str(PORT / "job.yaml"), "--set", "steps=4", "--set", "spares=0",
                                  "--set", "lease_ttl=2", "--set", f"output_dir={out}")
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-4000:]
    assert "step 0 loss" in (out / "logs" / "rank0.log").read_text()  # prints go to the rank's log
    final = load_final(out)
    assert final.manifest["steps"] == 4 and sorted(final.ranks) == [0, 1]
    assert any(k.startswith("model.") for k in final.ranks[0]), sorted(final.ranks[0])
