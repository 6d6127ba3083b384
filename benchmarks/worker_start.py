"""A warm worker, started vs forked from a zygote: time to warm, CPU seconds, memory.

Refilling the warm pool (after every swap, on the node that lost a worker) and starting a
job's workers both pay for one warm worker: torch, ``torch._dynamo`` (the first optimizer
step's import), hotspare's session, etcd, the job's module. Per trial, the same real worker
(``hotspare.agents.worker``, the GPT example's job, prewarm on as for a refill) is brought to
WARM two ways, exactly as an agent does it (``node_workers.spawn_worker``):

* ``started``: its own process (``worker_link.worker_command``), importing everything itself;
* ``forked``: forked from a zygote that has imported it all once (``agents/zygote.py``).

Measured per worker, from the request to its heartbeat saying WARM:

* warm s -- wall time;
* cpu s -- the CPU seconds (user + system, ``/proc/<pid>/stat``) the worker process itself
  burnt to get there: the node's CPU taken from the training ranks by one refill;
* pss MB -- its proportional set size once warm (``/proc/<pid>/smaps_rollup``): memory
  shared with the zygote and its siblings counts once, split between them.

The zygote's own one-time cost (its CPU seconds to preload) is reported on its own line.
Workers of a trial are kept warm until the trial ends, so pss reflects a node that holds
``--workers`` warm workers side by side.

    .venv/bin/python benchmarks/worker_start.py --trials 3 --workers 3
    .venv/bin/python benchmarks/worker_start.py --smoke   # both ways once: does it work?
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    EXAMPLES,
    base_parser,
    finish,
    fmt,
    machine_info,
    parse_args_smoke,
    table,
    write_json,
)

from hotspare.agents.node_workers import spawn_worker
from hotspare.agents.worker_link import WARM, Heartbeat, WorkerEnv, pin_spec
from hotspare.agents.zygote import Zygote
from hotspare.orchestrator.etcd_server import start_etcd
from hotspare.orchestrator.spec import parse_spec
from hotspare.orchestrator.store import JobStore, Store

WAYS = ("started", "forked")
SMOKE = {"workers": 1, "warm_timeout": 240.0}
AIM_CPU = 0.1  # a forked worker burns at most a tenth of a started one's CPU to get warm


def parse_args(argv: list[str] | None):
    p = base_parser(__doc__, "worker_start.json", "trials per way (each brings --workers workers to warm)")
    p.add_argument("--workers", type=int, default=3, help="warm workers per trial and way, side by side")
    p.add_argument("--warm-timeout", type=float, default=240.0, help="seconds a worker may take to get warm")
    return parse_args_smoke(p, argv, SMOKE)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def pss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Bench:
    """A real etcd with the GPT example's job submitted, and a place for workers' files."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.etcd = start_etcd(tmp / "etcd", log_path=tmp / "etcd.log")
        self.store = Store([self.etcd.endpoint])
        try:
            spec = parse_spec({"name": "wstart", "entrypoint": str(EXAMPLES / "gpt.py") + ":train",
                               "ranks": 1, "spares": 0, "steps": 10, "output_dir": str(tmp / "out"),
                               "args": {"n_layer": 1, "n_embd": 32, "block_size": 32}})
            JobStore(self.store, "wstart").submit(spec, os.urandom(32))
            pin_spec(tmp, JobStore(self.store, "wstart").spec())  # as an agent does for its workers
        except BaseException:
            self.close()
            raise
        self.env = {k: v for k, v in os.environ.items() if k != "HOTSPARE_ZYGOTE"}
        self.env["HOTSPARE_ETCD"] = self.etcd.endpoint
        self.n = 0

    def worker(self, zygote: Zygote | None):
        self.n += 1
        link = WorkerEnv(job="wstart", node="bench", incarnation="b", hb=str(self.tmp / f"w{self.n}.hb"),
                         log_dir=str(self.tmp), snap_dir=str(self.tmp), agent_pid=os.getpid(), prewarm=True)
        return spawn_worker(self.n, link, self.env, zygote)

    def close(self) -> None:
        self.store.close()
        self.etcd.stop()


def bring_up(bench: Bench, zygote: Zygote | None, n: int, timeout: float) -> tuple[list[dict], list[str]]:
    """Start ``n`` workers one after another, each measured to WARM; then let them all go."""
    rows, problems, procs = [], [], []
    try:
        for _ in range(n):
            t0 = time.monotonic()
            w = bench.worker(zygote)
            procs.append(w)
            while Heartbeat(w.hb.path).read()[0] != WARM:
                if w.proc.poll() is not None:
                    problems.append(f"worker pid {w.proc.pid} exited with {w.proc.returncode} before it was warm")
                    return rows, problems
                if time.monotonic() - t0 > timeout:
                    problems.append(f"worker pid {w.proc.pid} not warm after {timeout:.0f}s")
                    return rows, problems
                time.sleep(0.01)
            rows.append({"warm_s": time.monotonic() - t0, "cpu_s": cpu_seconds(w.proc.pid), "pid": w.proc.pid})
        for r in rows:  # side by side: what sharing saves shows once all are up
            r["pss_mb"] = pss_mb(r["pid"])
    finally:
        for w in procs:
            w.kill()
    return rows, problems


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hotspare-wstart-"))
    bench = Bench(tmp)
    results: dict[str, list[dict]] = {w: [] for w in WAYS}
    problems: list[str] = []
    zygote_cpu = None
    try:
        t0 = time.monotonic()
        zygote = Zygote.start(bench.env, tmp / "zygote.log", owner=os.getpid())
        why = zygote.usable(bench.env, timeout=a.warm_timeout)  # answered once its preload is done
        if why:
            problems.append(f"the zygote will not fork these workers: {why}")
        print(f"zygote ready after {time.monotonic() - t0:.1f}s")
        for trial in range(a.trials):
            rows, pr = bring_up(bench, None, a.workers, a.warm_timeout)
            results["started"] += rows
            problems += [f"trial {trial} started: {p}" for p in pr]
            rows, pr = bring_up(bench, zygote, a.workers, a.warm_timeout)
            results["forked"] += rows
            problems += [f"trial {trial} forked: {p}" for p in pr]
            if zygote.lost:
                problems.append(f"trial {trial}: the zygote was lost ({zygote.lost})")
                break
        assert zygote.proc is not None
        zygote_cpu = cpu_seconds(zygote.proc.pid)
        print(f"zygote: {zygote_cpu:.2f} CPU seconds in all (its preload, once, and its forks)")
        zygote.close()
    finally:
        bench.close()
    summary: dict[str, Any] = {}
    table_rows = []
    for way in WAYS:
        rs = results[way]
        s = {k: (statistics.median(v) if (v := [r[k] for r in rs if r.get(k) is not None]) else None)
             for k in ("warm_s", "cpu_s", "pss_mb")}
        s["n"] = len(rs)
        summary[way] = s
        table_rows.append([way, s["n"], fmt(s["warm_s"], 2), fmt(s["cpu_s"], 2), fmt(s["pss_mb"], 0)])
    print(f"\nworker start: {a.trials} trial(s) x {a.workers} worker(s) per way; {os.cpu_count()} CPUs")
    print(table(["way", "workers", "warm s (median)", "cpu s (median)", "pss MB (median)"], table_rows, left=1))
    started, forked = summary["started"]["cpu_s"], summary["forked"]["cpu_s"]
    ratio = forked / started if started and forked is not None else None
    met = "n/a" if ratio is None else ("met" if ratio <= AIM_CPU else "NOT met")
    print(f"aim: a forked worker's CPU to warm <= {AIM_CPU} x a started one's: {fmt(ratio)} -> {met}")
    for way in WAYS:
        if summary[way]["n"] != a.trials * a.workers and not any(way in p for p in problems):
            problems.append(f"{way}: {summary[way]['n']} of {a.trials * a.workers} workers measured")
    path = write_json(a.json, {"benchmark": "worker_start", "smoke": a.smoke, "ok": not problems,
                               "problems": problems, "machine": machine_info(), "trials": a.trials,
                               "workers": a.workers, "zygote_cpu_s": zygote_cpu, "summary": summary,
                               "cpu_ratio": ratio, "results": results})
    print(f"wrote {path}")
    return finish("worker_start", problems)


if __name__ == "__main__":
    sys.exit(main())
