"""What hotspare's own processes burn while a job trains undisturbed, in CPU seconds per second.

A wall-clock ratio on a shared 2-core machine moves with the load; the CPU time the kernel
charged to each process does not. This runs ``configs/demo.yaml`` (4 ranks + 1 spare node,
its chaos entry removed, steps raised so it never ends inside the measurement) on a private
etcd and controller, waits until every rank is past ``--warmup`` steps, then reads
``utime + stime`` of every process of the job from ``/proc/<pid>/stat`` at the start and the
end of each ``--window``-second window. Roles:

* ``etcd``, ``controller``: the control plane;
* ``cli``: ``hotspare run`` following the job; ``zygote``: the pre-imported fork server;
* ``agent <node>``: each node agent (the spare's too);
* ``warm spare``: the spare node's warm worker (ready to take a rank, not training);
* ``training``: the ranks' worker processes (not hotspare's overhead: shown for scale).

A worker is told apart by its process group: the zygote forks each worker into its agent's
group. A window in which any process of the job ended, or the epoch changed, is a failed
run: the figure would no longer be steady state. The aims are issue 15's (agent <= 0.005
cores, controller <= 0.005, etcd <= 0.01, warm spare <= 0.001); they are reported, not
enforced.

    .venv/bin/python benchmarks/sidecar_cpu.py --trials 3
    .venv/bin/python benchmarks/sidecar_cpu.py --smoke
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from common import (
    REPO,
    BenchCluster,
    base_parser,
    etcd_requests,
    finish,
    machine_info,
    parse_args_smoke,
    table,
    write_json,
)

from hotspare.orchestrator.etcd_server import LONG_LIVED_HEARTBEAT_MS
from hotspare.orchestrator.spec import parse_spec

TICK = os.sysconf("SC_CLK_TCK")
AIMS = {"agent": 0.005, "controller": 0.005, "etcd": 0.01, "warm spare": 0.001}
CLI = [sys.executable, "-m", "hotspare.orchestrator.cli"]


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` (every thread), or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5)


def pgrp(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def all_pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]


def roles(cluster: BenchCluster, run: subprocess.Popen, agents: dict[str, int]) -> dict[int, str]:
    """pid -> role for every process of the job and of the control plane."""
    out = {cluster.etcd.pid: "etcd", cluster.controller.pid: "controller", run.pid: "cli"}
    by_group = {pid: node for node, pid in agents.items()}
    below_cli = set(descendants(run.pid))
    for pid in all_pids():
        group = pgrp(pid)
        if pid in by_group:
            out[pid] = f"agent {by_group[pid]}"
        elif group in by_group:
            out[pid] = "warm spare" if by_group[group].startswith("spare") else f"training {by_group[group]}"
        elif pid in below_cli and "zygote" in cmdline(pid):
            out[pid] = "zygote"
    missing = [n for n, p in agents.items() if p not in out or cpu_seconds(p) is None]
    if missing:
        raise RuntimeError(f"agents {missing} are not running")
    return out


def status(cluster: BenchCluster, name: str) -> dict[str, Any]:
    r = subprocess.run([*CLI, "status", name, "--json"], env=cluster.env, capture_output=True, text=True,
                       timeout=60, cwd=cluster.tmp)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {}


def wait_steady(cluster: BenchCluster, name: str, run: subprocess.Popen, warmup: int, timeout: float) -> dict:
    """The job's status once every rank is past ``warmup`` steps (it must still be epoch 1)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise RuntimeError(f"`hotspare run` exited with {run.returncode} before the job was steady")
        st = status(cluster, name)
        ranks = st.get("ranks") or []
        if st.get("state") == "running" and ranks and min(r.get("step", -1) for r in ranks) >= warmup:
            return st
        time.sleep(1.0)
    raise RuntimeError(f"the job did not reach step {warmup} on every rank within {timeout:.0f}s")


def wait_progress(cluster: BenchCluster, name: str, step: int, timeout: float = 30.0) -> dict:
    """The job's status once its step passed ``step`` (progress is published every few
    seconds, so a short window may end before the next record): proof it kept training."""
    deadline = time.monotonic() + timeout
    st = status(cluster, name)
    while st.get("step", 0) <= step and st.get("state") == "running" and time.monotonic() < deadline:
        time.sleep(1.0)
        st = status(cluster, name)
    return st


def measure(pids: dict[int, str], window: float, endpoint: str) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per second of each role over one window (roles with several processes,
    like ``training``, are summed), and etcd's requests per second by method."""
    req0, t0, start = etcd_requests(endpoint), time.monotonic(), {p: cpu_seconds(p) for p in pids}
    time.sleep(window)
    t1, end, req1 = time.monotonic(), {p: cpu_seconds(p) for p in pids}, etcd_requests(endpoint)
    gone = [f"{pids[p]} (pid {p})" for p in pids if start[p] is None or end[p] is None]
    if gone:
        raise RuntimeError(f"process(es) ended during the window: {', '.join(gone)}")
    out: dict[str, float] = {}
    for p, role in pids.items():
        out[role] = out.get(role, 0.0) + (end[p] - start[p]) / (t1 - t0)
    rates = {m: (req1[m] - req0.get(m, 0.0)) / (t1 - t0) for m in req1 if req1[m] != req0.get(m, 0.0)}
    return out, rates


def spec_for(a, out_dir: Path) -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    spec.pop("chaos", None)
    spec["entrypoint"] = str(REPO / "examples" / "gpt.py") + ":train"
    spec.update(name="sidecar", ranks=a.ranks, steps=1_000_000, output_dir=str(out_dir))
    if a.replicate_every:
        spec["replicate_every"] = a.replicate_every
    if a.replicate_interval is not None:
        spec["replicate_interval"] = a.replicate_interval
    return spec


def points_per_s(steps_per_s: float, every: int, interval: float) -> float:
    """Replication points a second the schedule makes at this step rate: a candidate every
    ``every`` steps, and of those the first ``interval`` seconds or more after the last point."""
    if steps_per_s <= 0:
        return 0.0
    candidate_s = every / steps_per_s
    return 1.0 / (max(1, math.ceil(interval / candidate_s - 1e-9)) * candidate_s)


def run(a) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    windows: list[dict[str, float]] = []
    requests: list[dict[str, float]] = []
    # etcd as `hotspare up` runs it (its heartbeat is most of an idle etcd's CPU)
    with BenchCluster(heartbeat_ms=LONG_LIVED_HEARTBEAT_MS) as cluster:
        spec = spec_for(a, cluster.output_dir("sidecar"))
        path = cluster.tmp / "sidecar.yaml"
        path.write_text(yaml.safe_dump(spec))
        cluster.jobs.append("sidecar")
        log = open(cluster.tmp / "run.log", "wb")  # noqa: SIM115 - closed below
        env = {k: v for k, v in cluster.env.items() if k != "HOTSPARE_ZYGOTE"}  # the job's own, as `make demo` has
        run_p = subprocess.Popen([*CLI, "run", str(path), "--no-check"], env=env, stdout=log,
                                 stderr=subprocess.STDOUT, cwd=cluster.tmp)
        try:
            before = wait_steady(cluster, "sidecar", run_p, a.warmup, a.start_timeout)
            agents = json.loads((cluster.output_dir("sidecar") / "agents.json").read_text())
            pids = roles(cluster, run_p, agents)
            t0 = time.monotonic()
            for _ in range(a.trials):
                got, rates = measure(pids, a.window, cluster.endpoint)
                windows.append(got)
                requests.append(rates)
            after = wait_progress(cluster, "sidecar", before.get("step", 0))
            if after.get("epoch") != before.get("epoch") or after.get("state") != "running":
                problems.append(f"the job left steady state during the measurement: epoch {before.get('epoch')} -> "
                                f"{after.get('epoch')}, state {after.get('state')}")
            steps = (after.get("step", 0) - before.get("step", 0))
            elapsed = time.monotonic() - t0
            if steps <= 0:
                problems.append("the job made no progress during the measurement")
        except RuntimeError as e:
            problems.append(str(e))
            before, after, steps, elapsed = {}, {}, 0, 0.0
        finally:
            subprocess.run([*CLI, "cancel", "sidecar"], env=cluster.env, capture_output=True, timeout=60,
                           cwd=cluster.tmp)
            try:
                run_p.wait(60)
            except subprocess.TimeoutExpired:
                run_p.kill()
            log.close()
    roles_ = sorted({r for w in windows for r in w})
    median = {r: statistics.median(w.get(r, 0.0) for w in windows) for r in roles_}
    methods = sorted({m for r in requests for m in r})
    per_s = {m: statistics.median(r.get(m, 0.0) for r in requests) for m in methods}
    job_spec = parse_spec(spec)
    every, interval = job_spec.replicate_every, job_spec.replicate_interval
    rate = steps / elapsed if elapsed else 0.0  # about: the steps are read from progress records
    return {"windows": windows, "median_cores": median, "steps_in_measurement": steps,
            "steps_per_s": rate, "replicate_every": every, "replicate_interval": interval,
            "points_per_s": points_per_s(rate, every, interval),
            "window_s": a.window, "etcd_requests_per_s": per_s}, problems


def aims(median: dict[str, float]) -> list[tuple[str, float, float, bool]]:
    """(role, measured cores, aim, met) per aimed role; every agent is held to the agent aim."""
    out = []
    for role, cores in sorted(median.items()):
        kind = "agent" if role.startswith("agent ") else role
        if kind in AIMS:
            out.append((role, cores, AIMS[kind], cores <= AIMS[kind]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__, "sidecar_cpu.json", "measurement windows (consecutive, one job)")
    p.add_argument("--ranks", type=int, default=4, help="training ranks (one per node) plus one spare node")
    p.add_argument("--window", type=float, default=20.0, help="seconds per measurement window")
    p.add_argument("--warmup", type=int, default=30, help="steps every rank must be past before measuring")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the warm-up")
    p.add_argument("--replicate-every", type=int, default=0,
                   help="the spec's replicate_every (0: demo.yaml's, the default 10 steps); an active agent's "
                   "CPU is mostly the replication of points, so it scales with points per second")
    p.add_argument("--replicate-interval", type=float, default=None,
                   help="the spec's replicate_interval in seconds (default: demo.yaml's, the default 5 s; "
                   "0: every candidate step is a point)")
    a = parse_args_smoke(p, argv, {"ranks": 2, "window": 3.0, "warmup": 3})
    result, problems = run(a)
    rows = [(role, f"{cores:.4f}") for role, cores in sorted(result["median_cores"].items())]
    print(table(["process", "cores (CPU s / s, median of windows)"], rows))
    checked = aims(result["median_cores"])
    print(table(["process", "cores", "aim", "met"], [(r, f"{c:.4f}", f"{m}", "yes" if ok else "NO")
                                                     for r, c, m, ok in checked]))
    print(table(["etcd request", "per second"], [(m, f"{v:.2f}") for m, v in result["etcd_requests_per_s"].items()]))
    sidecar = sum(c for r, c in result["median_cores"].items() if not r.startswith("training"))
    print(f"hotspare's processes together: {sidecar:.4f} cores; each rank about {result.get('steps_per_s', 0):.1f} "
          f"steps/s, {result.get('points_per_s', 0):.2f} replication points/s (replicate_every {result.get('replicate_every')}, "
          f"replicate_interval {result.get('replicate_interval')} s)")
    write_json(a.json, {"benchmark": "sidecar_cpu", "smoke": a.smoke, "machine": machine_info(),
                        "args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
                        "result": result, "sidecar_cores": sidecar,
                        "aims": [{"process": r, "cores": c, "aim": m, "met": ok} for r, c, m, ok in checked],
                        "ok": not problems, "problems": problems})
    return finish("sidecar_cpu", problems)


if __name__ == "__main__":
    sys.exit(main())
