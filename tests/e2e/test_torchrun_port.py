"""The user guide's ports (docs/user-guide.md): the ordinary torchrun scripts
(examples/torchrun_port/) run under torchrun, and their hotspare versions
(examples/ddp_train.py, examples/fsdp_train.py) run as jobs from their own job specs."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys

import pytest

from hotspare import load_final

from ..conftest import EXAMPLES, REPO

PORT = EXAMPLES / "torchrun_port"


TEARDOWN_ABORT = "terminate called without an active exception"
PORTS = [("train_torchrun.py", "ddp_train.py"), ("fsdp_torchrun.py", "fsdp_train.py")]


@pytest.mark.parametrize("before,after", PORTS)
def test_the_user_guide_shows_the_real_diff_and_job_yaml(before, after):
    """docs/user-guide.md quotes each port's diff and job spec: they must not drift apart."""
    guide = (REPO / "docs" / "user-guide.md").read_text()
    old = (PORT / before).read_text().splitlines(keepends=True)
    new = (EXAMPLES / after).read_text().splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(old, new, f"torchrun_port/{before}", after))
    assert "```diff\n" + diff + "```" in guide, f"regenerate the diff of {after} in docs/user-guide.md"
    assert "```yaml\n" + (EXAMPLES / after.replace(".py", ".yaml")).read_text() + "```" in guide


@pytest.mark.parametrize("script", ["train_torchrun.py", "fsdp_torchrun.py"])
def test_the_torchrun_scripts_run_under_torchrun(tmp_path, script):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    wrap = tmp_path / "finished.py"  # runs the script as torchrun would, then says it returned
    wrap.write_text("import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
                    "print('script returned', flush=True)\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(wrap), str(PORT / script), "--steps", "4"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "step 0 loss" in r.stdout, r.stdout + r.stderr[-4000:]
    if r.returncode != 0:
        # torch 2.13's gloo/DDP teardown sometimes aborts a process at interpreter exit, after
        # destroy_process_group (seen here in full-suite runs, rarely); torch's bug, not the script's.
        # Anything else -- or an abort before both ranks' main() returned -- still fails the test.
        assert TEARDOWN_ABORT in r.stderr and r.stdout.count("script returned") == 2, r.stdout + r.stderr[-4000:]


def test_the_ddp_port_runs_under_hotspare_from_its_job_yaml(cluster):
    out = cluster.tmp / "out" / "port"
    cluster.controller()
    summary, r = cluster.run_json(str(EXAMPLES / "ddp_train.yaml"), "--set", "steps=4", "--set", "spares=0",
                                  "--set", "lease_ttl=2", "--set", f"output_dir={out}")
    assert summary["state"] == "succeeded", r.stdout + r.stderr[-4000:]
    assert "step 0 loss" in (out / "logs" / "rank0.log").read_text()  # prints go to the rank's log
    final = load_final(out)
    assert final.manifest["steps"] == 4 and sorted(final.ranks) == [0, 1]
    assert any(k.startswith("model.") for k in final.ranks[0]), sorted(final.ranks[0])
