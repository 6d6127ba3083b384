"""Benchmarks cannot rot: each benchmark's ``--smoke`` mode runs here, end to end.

A smoke run is tiny (2 ranks, a few steps, one trial) but exercises every run of its
benchmark; it exits non-zero and names the run when any of them reports a problem. Its
numbers mean nothing and are not checked (the machine is shared and noisy): only that every
run was ok, by the exit code and by the JSON each benchmark writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "out"
TIMEOUT = 540  # seconds per benchmark run: generous, a smoke run takes well under a minute or two


def results_state() -> dict[str, float]:
    """benchmarks/out/*.json and their mtimes: a smoke run must never overwrite a result."""
    return {p.name: p.stat().st_mtime for p in RESULTS.glob("*.json")}


def smoke(name: str, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run ``benchmarks/<name>.py --smoke --json <tmp> [extra]`` with the project's Python (the
    one running the tests: the virtualenv's) from the repository root; (result, JSON or None)."""
    out = tmp_path / f"{name}.json"
    before = results_state()
    r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--json", str(out), *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert results_state() == before, "a smoke run touched benchmarks/out/"
    data = json.loads(out.read_text()) if out.exists() else None
    return r, data


def explain(r: subprocess.CompletedProcess) -> str:
    return f"exit code {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


def assert_ok(r: subprocess.CompletedProcess, data: dict | None) -> dict:
    assert r.returncode == 0, explain(r)
    assert data is not None, "no JSON written\n" + explain(r)
    assert data["smoke"] is True
    assert data["ok"] is True and data["problems"] == [], data["problems"]
    return data


@pytest.mark.timeout(TIMEOUT + 60)
def test_recovery_time_smoke(tmp_path):
    data = assert_ok(*smoke("recovery_time", tmp_path))
    trials = {t["scenario"]: t for t in data["trials"]}
    assert set(trials) == {"worker_kill", "node_loss"}
    for sc, t in trials.items():
        assert t["ok"] and t["state"] == "succeeded", (sc, t)
        assert data["stats"][sc]["ok"] == 1, sc


@pytest.mark.timeout(TIMEOUT + 60)
def test_lost_time_smoke(tmp_path):
    data = assert_ok(*smoke("lost_time", tmp_path))
    runs = ("hotspare_nofail", "hotspare_fail", "torchrun_nofail", "torchrun_fail", "plain")
    [trial] = data["trials"]
    for k in runs:
        assert trial[k]["ok"], (k, trial[k])
    assert trial["torchrun_fail"]["attempts"] == 2  # killed once, restarted, resumed
    assert len(trial["hotspare_fail"]["recoveries"]) == 1
    same = trial["identical_final_params"]
    assert {k for k in same if k != "reference"} == set(runs) - {same["reference"]}
    assert all(v is True for k, v in same.items() if k != "reference"), same


@pytest.mark.timeout(TIMEOUT + 60)
def test_checkpoint_smoke(tmp_path):
    data = assert_ok(*smoke("checkpoint", tmp_path))
    [res] = data["results"]
    for m in ("hotspare", "torch.save", "dcp.save", "dcp.async_save"):
        assert res[m]["ok"] and res[m]["trials"], (m, res[m])


@pytest.mark.timeout(TIMEOUT + 60)
def test_overhead_smoke(tmp_path):
    data = assert_ok(*smoke("overhead", tmp_path))
    modes = data["by_replication"]
    assert set(modes) == {"process", "none"}
    for mode, res in modes.items():
        assert res["ok"] and res["trials"], (mode, res["problems"])
    confirmed = modes["process"]["trials"][0]["replication"]["confirmed"]
    assert confirmed is not None and confirmed[0] >= 0  # points really went to the buddy


@pytest.mark.timeout(TIMEOUT + 60)
def test_worker_start_smoke(tmp_path):
    data = assert_ok(*smoke("worker_start", tmp_path))
    for way in ("started", "forked"):
        [w] = data["results"][way]
        assert w["warm_s"] > 0 and w["cpu_s"] > 0, (way, w)  # a real worker, measured from /proc
    assert data["zygote_cpu_s"] > 0


@pytest.mark.timeout(TIMEOUT + 60)
def test_sidecar_cpu_smoke(tmp_path):
    data = assert_ok(*smoke("sidecar_cpu", tmp_path))
    cores = data["result"]["median_cores"]
    assert {"etcd", "controller", "cli", "agent node0", "agent node1", "agent spare0", "warm spare"} <= set(cores)
    assert cores["training node0"] > 0 and cores["training node1"] > 0, cores  # read from real workers' /proc
    assert data["result"]["steps_in_measurement"] > 0


@pytest.mark.timeout(TIMEOUT + 60)
def test_restore_rss_smoke(tmp_path):
    """A spare restores a snapshot served by a ReplicaServer process, from a replica file and from a
    dead worker's slot; the restored parameters match, and both sides' peaks were read from /proc."""
    data = assert_ok(*smoke("restore_rss", tmp_path))
    assert sorted(t["source"] for t in data["trials"]) == ["replica", "slot"]
    for t in data["trials"]:
        assert t["ok"] and t["bytes"] == 16 << 20 and t["seconds"] > 0, t
        for side in ("server", "worker"):
            assert t[side]["after"]["VmHWM"] > 0 and "peak_growth" in t[side], (t["source"], side)


@pytest.mark.timeout(TIMEOUT + 60)
def test_scale_smoke_every_simulated_agent_sees_each_new_world(tmp_path):
    """N = 50 agents against a real etcd and controller (issue 15): correctness only -- each
    failure produced a new world that every live agent read, nodes lost and workers reported."""
    data = assert_ok(*smoke("scale", tmp_path))
    rows = data["result"]["failures"]
    assert [r["kind"] for r in rows] == ["node loss", "worker exit"] * 2
    assert all(r["ok"] and r["decision_latency_s"] is not None for r in rows), rows
    epochs = [r["epoch"] for r in rows]
    assert epochs == sorted(set(epochs)), epochs  # each failure moved the job to a newer world


@pytest.mark.timeout(TIMEOUT + 60)
def test_smoke_run_fails_when_a_run_inside_it_fails(tmp_path):
    """torchrun with a failure and no restarts cannot finish: the benchmark must say so and exit 1
    (with the default --max-restarts the same command passes: test_lost_time_smoke)."""
    r, data = smoke("lost_time", tmp_path, "--runs", "torchrun_fail", "--max-restarts", "0")
    assert r.returncode == 1, explain(r)
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("lost_time: FAILED: ")]
    assert failed and all("torchrun_fail" in ln for ln in failed), explain(r)
    assert any("torchrun exited with" in ln for ln in failed), explain(r)
    assert data is not None and data["ok"] is False and data["problems"]
    assert data["trials"][0]["torchrun_fail"]["ok"] is False


def test_smoke_defaults_yield_to_explicit_flags_and_never_write_results(monkeypatch):
    """--smoke changes the defaults only: a flag given with it wins, and the JSON goes to a temp
    file unless --json is given. (Parsing only; nothing runs.)"""
    monkeypatch.syspath_prepend(str(BENCH))
    for mod in ("common", "lost_time"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    import lost_time

    try:
        a = lost_time.parse_args(["--smoke"])
        assert (a.trials, a.ranks, a.runs) == (1, 2, list(lost_time.SYSTEMS))
        assert Path(a.json).parent != RESULTS and Path(a.json).exists()
        Path(a.json).unlink()
        a = lost_time.parse_args(["--smoke", "--runs", "torchrun_fail", "--ranks", "3", "--json", "x.json"])
        assert (a.trials, a.ranks, a.runs, a.json, a.steps) == (1, 3, ["torchrun_fail"], "x.json",
                                                                lost_time.SMOKE["steps"])
        a = lost_time.parse_args([])
        assert (a.trials, a.ranks, a.smoke) == (5, 4, False) and Path(a.json).parent == RESULTS
    finally:
        for mod in ("common", "lost_time"):
            sys.modules.pop(mod, None)


@pytest.mark.timeout(TIMEOUT + 60)
def test_ddp_overhead_smoke(tmp_path):
    """examples/ddp_train.py under hotspare and under torchrun: every run ok, one recovery and one
    restart, and the final states compared (all of them identical with 2 ranks)."""
    data = assert_ok(*smoke("ddp_overhead", tmp_path))
    runs = ("hotspare_nofail", "hotspare_fail", "torchrun_nofail", "torchrun_fail", "plain", "plain_param_order")
    [trial] = data["trials"]
    for k in runs:
        assert trial[k]["ok"], (k, trial[k])
        assert trial[k]["span_s"] > 0 and trial[k]["wall_s"] > 0, (k, trial[k])
    assert trial["torchrun_fail"]["attempts"] == 2  # killed once, restarted, resumed from a checkpoint
    assert len(trial["hotspare_fail"]["recoveries"]) == 1
    assert trial["plain_param_order"]["buckets"] == "param-order" and trial["plain"]["buckets"] == "ready-order"
    same = trial["identical"]
    assert set(same) == {"hotspare_fail vs hotspare_nofail", "torchrun_fail vs torchrun_nofail",
                         "plain vs torchrun_nofail", "plain_param_order vs hotspare_nofail",
                         "torchrun_nofail vs hotspare_nofail"}, same
    assert same["hotspare_fail vs hotspare_nofail"]["compared"] == "full"
    assert all(v["identical"] is True and v["required"] for v in same.values()), same
    for key in ("overhead_ratio", "bucket_order_ratio", "hotspare_lost_s", "torchrun_lost_s", "ratio"):
        assert isinstance(data[key], (int, float)), (key, data[key])  # computed; values not checked
    assert data["config"]["workload"]["params"] > 0
    assert set(data["step_ms"]) == {"hotspare_nofail", "torchrun_nofail", "plain", "plain_param_order"}


@pytest.mark.timeout(TIMEOUT + 60)
def test_replication_mac_smoke(tmp_path):
    """Both wires (before the frame MAC covered bodies, from git; and this tree's) put and get a
    snapshot through a real ReplicaServer and send one bare frame; structure only, no timings."""
    data = assert_ok(*smoke("replication_mac", tmp_path))
    assert data["config"]["variants"] == ["before", "after"]
    assert data["config"]["before"].startswith("git ")
    assert len(data["trials"]) == 2 and all(t["ok"] for t in data["trials"]), data["trials"]
    for t in data["trials"]:
        assert t["bytes"] == 9 << 20
        for op in ("put", "get", "frame"):
            assert t[op]["s"] > 0 and t[op]["client_cpu_s"] >= 0 and t[op]["server_cpu_s"] >= 0, (t["variant"], op)
    for op in ("put", "get", "frame"):
        assert {"median", "best", "per_trial"} <= set(data["ratios"][op]), op
        assert data["stats"]["after"][op]["s"]["n"] == 1
    assert set(data["primitives_gbps"]) == {"sha256", "hmac_sha256", "crc32", "copy"}


@pytest.mark.timeout(TIMEOUT + 60)
def test_etcd_auth_smoke(tmp_path):
    """The embedded cluster without authentication, with it (bcrypt cost 4) and with etcd's
    default cost, each up, logged into and written; structure only, no timings."""
    data = assert_ok(*smoke("etcd_auth", tmp_path))
    assert {r["variant"] for r in data["runs"]} == {"plain", "auth", "auth_cost10"}
    for r in data["runs"]:
        assert r["up_s"] > 0 and r["login_s"] > 0 and r["pairs_per_s"] > 0, r


@pytest.mark.timeout(TIMEOUT + 60)
def test_rendezvous_ops_smoke(tmp_path):
    """Gloo groups of 2 worker processes built through the rendezvous store of before issue 15
    (from git) and this tree's, ranks together and one after another; every allreduce right, and
    etcd's request counts read (the counts themselves: tests/integration/test_rendezvous_ops.py)."""
    data = assert_ok(*smoke("rendezvous_ops", tmp_path))
    assert data["config"]["variants"] == ["before", "after"]
    assert data["config"]["source"]["before"].startswith("git ")
    assert {(r["variant"], r["n"], r["stagger"]) for r in data["runs"]} == {
        (v, 2, s) for v in ("before", "after") for s in (0.0, 0.05)}
    for r in data["runs"]:
        assert r["ok"] and r["etcd_requests"]["Put"] >= r["n"], r
