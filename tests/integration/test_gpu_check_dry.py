"""The GPU check cannot rot: ``bash benchmarks/gpu_check.sh --dry`` runs here, end to end.

The dry run is the GPU check's whole sequence on the CPU with gloo at tiny sizes: the GPU
variants of the DDP and FSDP2 examples (benchmarks/gpu/, ``device="cpu"``), each undisturbed
and with a kill-rank, on a private etcd and controller, their final states compared bit for
bit. Its timings mean nothing here and are not checked.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300  # seconds for the whole dry run (it takes about a minute on a quiet 2-core machine)


@pytest.mark.timeout(TIMEOUT + 60)
def test_gpu_check_dry_run_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry", "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=TIMEOUT)
    explain = f"exit code {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"
    assert r.returncode == 0, explain
    data = json.loads(out.read_text())
    assert data["dry"] is True and data["ok"] is True and data["problems"] == [], data["problems"]
    jobs = data["jobs"]
    assert set(jobs) == {"ddp_ref", "ddp_kill", "fsdp_ref", "fsdp_kill"}
    for name, job in jobs.items():
        assert job["ok"] and job["state"] == "succeeded", (name, job.get("problems"))
        assert job["device_backend"] == ["cpu gloo"], (name, job["device_backend"])  # what each rank reported
        assert len(job["recoveries"]) == (1 if name.endswith("_kill") else 0), (name, job["recoveries"])
        epochs = {x["epoch"] for x in job["rebuilt"]}  # the group was built, and rebuilt after the kill
        assert 1 in epochs and (max(epochs) > 1) == name.endswith("_kill"), (name, epochs)
    for fw in ("ddp", "fsdp"):
        assert data["checks"][fw]["kill_vs_ref"]["identical"] is True, data["checks"][fw]
        assert data["checks"][fw]["kill_vs_ref"]["tensors_compared"] > 0
    assert data["checks"]["ddp"]["replicas_agree_ddp_ref"]["agree"] is True
    assert data["checks"]["ddp"]["replicas_agree_ddp_kill"]["agree"] is True
    assert set(data["recovery_s"]) == {"ddp_kill", "fsdp_kill"}
