"""benchmarks/offload.py --smoke runs end to end: every variant but DeepSpeed (which needs its
own venv and is only run when asked) has a finite step time, and the final parameters and
moments of in-RAM AdamW, the naive offload and hotspare's variants are bit-identical."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_offload_bench_smoke(tmp_path):
    out = tmp_path / "offload.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "offload.py"), "--smoke", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert data["smoke"] is True and data["ok"] is True and data["problems"] == []
    assert data["disk"]["ok"] and data["disk"]["read_gbps"] > 0 and data["disk"]["write_gbps"] > 0
    [s] = data["scenarios"].values()
    for v in ("compute", "inram", "naive", "hotspare-h", "hotspare-h-sync", "hotspare-v", "hotspare-v-nocrc"):
        assert s[v]["ok"], (v, s[v])
        assert math.isfinite(s[v]["step_s"]) and s[v]["step_s"] > 0, (v, s[v])
        assert s[v]["maxrss_mb"] > 0
    assert s["bit_identical"] is True
    assert s["deepspeed"]["ok"] or s["deepspeed"]["error"]  # run, or the reason it was not
    for v in ("hotspare-h", "hotspare-v"):
        assert s[v]["bytes_per_step"] > 0 and s[v]["direct"] in (True, False)
