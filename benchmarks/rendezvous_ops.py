"""What one epoch's rendezvous costs etcd, as a function of the group's size N (issue 15).

Every epoch's process group is built through ``EtcdC10dStore`` (``orchestrator/store/c10d.py``):
a ``torch.distributed.Store`` over etcd on a fresh key prefix (``recovery/session.py``). Gloo's
full mesh has every rank publish its address under that prefix and read every rank's (its own
included: torch 2.13's gloo ``wait``s for each key, then ``get``s it). This benchmark starts a
private etcd and ``max(--sizes)`` worker processes (each imports torch and connects once); per
(trial, N, variant) the first N workers build one gloo group through the variant's store on a
fresh prefix, as ``ReconfigurableProcessGroup`` does (``dist.ProcessGroupGloo(store, rank, N,
timeout)``), and run one allreduce (checked). The workers are told to start by a line on their
stdin (no etcd traffic), rank r after ``r * stagger`` seconds (``--staggers``): 0, all at
once; 0.05, one after another, as live workers learning of a new epoch at slightly different
times are -- where a store that polls for missing keys pays per second of waiting.

Variants (alternating within every trial, so that a busy machine slows both alike):

* ``before`` -- ``orchestrator/store/c10d.py`` from git (``--before auto``: the newest commit whose
  store still polls etcd with one ``get`` per key, see ``OLD_STORE``), loaded in the workers
  as ``hotspare.orchestrator.store.c10d_before``;
* ``after`` -- the working tree's ``EtcdC10dStore``.

Measured per run: etcd's requests over the run, from its ``/metrics`` (``Range``, ``Put``,
``Txn``, ``DeleteRange`` unary calls, and ``Watch msgs``: watch create/cancel requests on the
workers' watch streams), taken once every worker has finished and its store's watches have had
time to be cancelled (``--settle``); the same counted by the workers themselves (a ``Store``
whose every etcd request is counted), as a cross-check; the wall time from "go" to the last
rank's allreduce; the slowest rank's group construction.

    .venv/bin/python benchmarks/rendezvous_ops.py --trials 3
    .venv/bin/python benchmarks/rendezvous_ops.py --smoke     # N = 2, one trial
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    REPO,
    base_parser,
    etcd_requests,
    finish,
    fmt,
    machine_info,
    parse_args_smoke,
    summarize,
    table,
    write_json,
)

VARIANTS = ("before", "after")
SMOKE = {"sizes": "2"}
METHODS = ("Range", "Put", "Txn", "DeleteRange", "Watch msgs")
#: how --before auto recognises the store from before issue 15 (polls one key at a time)
OLD_STORE = "pending = [k for k in pending if self._store.get(self._k(k)) is None]"
MODULE = "orchestrator/store/c10d.py"


def parse_args(argv: list[str] | None):
    p = base_parser(__doc__, "rendezvous_ops.json", "trials (each: every size, every variant once)")
    p.add_argument("--sizes", default="2,4,8,16", help="group sizes N, comma-separated")
    p.add_argument("--staggers", default="0,0.05",
                   help="seconds between consecutive ranks' starts, comma-separated (each is a run)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--before", default="auto",
                   help="the 'before' store: auto (newest commit whose c10d.py polls), a git revision, or a file")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one rendezvous + allreduce may take")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds to wait after a run before reading etcd's counters (default: the store's "
                        "watch linger + 0.5)")
    p.add_argument("--worker", nargs=2, metavar=("ENDPOINT", "BEFORE"), help=argparse_hidden())
    return parse_args_smoke(p, argv, SMOKE)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def git(*args: str) -> str:
    r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def resolve_before(spec: str, into: Path) -> tuple[Path, str]:
    """A file holding the pre-issue-15 c10d.py, and where it came from."""
    if spec != "auto" and Path(spec).is_file():
        return Path(spec), f"file {spec}"
    rev = spec
    if spec == "auto":
        rev = next((r for r in git("log", "--format=%H").split()
                    if OLD_STORE in git("show", f"{r}:{MODULE}")), "")
        if not rev:
            raise RuntimeError(f"--before auto: no commit's {MODULE} polls ({OLD_STORE!r})")
    commit = git("rev-parse", "--short", f"{rev}^{{commit}}").strip()
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text(git("show", f"{commit}:{MODULE}"))
    return into, f"git {commit}"


# -- a worker (one rank) -----------------------------------------------------------------------------
def worker(endpoint: str, before: str) -> int:
    """Commands on stdin, one JSON line each; answers on stdout, one JSON line each."""
    import importlib.util
    from collections import Counter
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hotspare.orchestrator.store import c10d
    from hotspare.orchestrator.store.client import Store

    stores = {"after": c10d.EtcdC10dStore}
    if before:
        name = "hotspare.orchestrator.store.c10d_before"
        spec = importlib.util.spec_from_file_location(name, before)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        stores["before"] = mod.EtcdC10dStore

    class CountingStore(Store):
        """Every etcd request this process makes goes through ``Store._call``: counted by verb."""

        counts: Counter = Counter()

        def _call(self, what, fn):
            CountingStore.counts[what.split(" ", 1)[0]] += 1
            return super()._call(what, fn)

    st = CountingStore([endpoint], timeout=10.0)
    st.get("/rdzv-bench/ping")
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "report":
            print(json.dumps({"counts": dict(CountingStore.counts)}), flush=True)
            continue
        CountingStore.counts.clear()
        rank, n = cmd["rank"], cmd["n"]
        out: dict[str, Any] = {"rank": rank}
        time.sleep(cmd["delay"])
        try:
            t0 = time.perf_counter()
            store = stores[cmd["variant"]](st, cmd["prefix"], timeout=timedelta(seconds=cmd["timeout"]))
            pg = dist.ProcessGroupGloo(store, rank, n, timedelta(seconds=cmd["timeout"]))
            t1 = time.perf_counter()
            t = torch.full((4,), float(rank + 1))
            pg.allreduce([t]).wait()
            t2 = time.perf_counter()
            out.update(build_s=t1 - t0, allreduce_s=t2 - t1, ok=bool((t == n * (n + 1) / 2).all()),
                       value=t[0].item())
            del pg
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out.update(ok=False, error=f"{type(e).__name__}: {e}")
        print(json.dumps(out), flush=True)
    st.close()
    return 0


# -- the parent ----------------------------------------------------------------------------------------
class Workers:
    def __init__(self, n: int, endpoint: str, before: str, log: Path) -> None:
        self.log = open(log, "ab")  # noqa: SIM115 - closed in close()
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.procs = [subprocess.Popen([sys.executable, __file__, "--worker", endpoint, before], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                       text=True, cwd=REPO / "benchmarks")
                      for _ in range(n)]
        self.lines: list[queue.Queue[str | None]] = [queue.Queue() for _ in self.procs]
        for p, q in zip(self.procs, self.lines, strict=True):
            threading.Thread(target=self._read, args=(p, q), daemon=True).start()

    @staticmethod
    def _read(p: subprocess.Popen, q: queue.Queue) -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            q.put(line)
        q.put(None)

    def send(self, i: int, cmd: dict[str, Any]) -> None:
        self.procs[i].stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.procs[i].stdin.flush()  # type: ignore[union-attr]

    def answer(self, i: int, deadline: float) -> dict[str, Any]:
        try:
            line = self.lines[i].get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"worker {i} did not answer in time") from None
        if line is None:
            raise RuntimeError(f"worker {i} exited (code {self.procs[i].wait()}); see the log")
        return json.loads(line)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.log.close()


def one_run(w: Workers, endpoint: str, variant: str, n: int, stagger: float, trial: int, a) -> dict[str, Any]:
    prefix = f"/rdzv-bench/{variant}/n{n}/s{stagger}/t{trial}/epoch/1"
    req0 = etcd_requests(endpoint)
    t0 = time.monotonic()
    for r in range(n):
        w.send(r, {"op": "go", "variant": variant, "prefix": prefix, "rank": r, "n": n, "timeout": a.timeout,
                   "delay": r * stagger})
    deadline = t0 + a.timeout + n * stagger + 10
    answers = [w.answer(r, deadline) for r in range(n)]
    wall = time.monotonic() - t0
    time.sleep(a.settle)  # the stores' watches are cancelled after their linger
    req1 = etcd_requests(endpoint)
    for r in range(n):
        w.send(r, {"op": "report"})
    counted: dict[str, int] = {}
    for r in range(n):
        for k, v in w.answer(r, time.monotonic() + 30)["counts"].items():
            counted[k] = counted.get(k, 0) + v
    reqs = {m: req1.get(m, 0) - req0.get(m, 0) for m in METHODS}
    errors = [f"rank {x['rank']}: {x.get('error') or 'wrong allreduce result ' + str(x.get('value'))}"
              for x in answers if not x.get("ok")]
    total = sum(reqs.values())
    return {"variant": variant, "n": n, "stagger": stagger, "trial": trial, "ok": not errors, "errors": errors, "wall_s": wall,
            "build_s_max": max((x.get("build_s", 0.0) for x in answers), default=None),
            "etcd_requests": reqs, "total": total, "per_rank": total / n, "client_counted": counted,
            "client_total": sum(counted.values()), "load_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    from hotspare.orchestrator.etcd_server import start_etcd
    from hotspare.orchestrator.store import c10d

    sizes = [int(x) for x in a.sizes.split(",") if x]
    staggers = [float(x) for x in a.staggers.split(",") if x]
    variants = [v for v in a.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if a.settle is None:
        a.settle = getattr(c10d, "WATCH_LINGER_S", 0.0) + 0.5
    problems: list[str] = []
    runs: list[dict[str, Any]] = []
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="hotspare-rdzv-") as d:
        tmp = Path(d)
        source = {"after": "working tree"}
        before = ""
        if "before" in variants:
            try:
                path, source["before"] = resolve_before(a.before, tmp / "before" / "c10d.py")
                before = str(path)
            except Exception as e:  # noqa: BLE001 - reported
                problems.append(f"before: {e}")
                variants = [v for v in variants if v != "before"]
        srv = start_etcd(tmp / "etcd", log_path=tmp / "etcd.log")
        w = Workers(max(sizes), srv.endpoint, before, tmp / "workers.log")
        try:
            deadline = time.monotonic() + 300
            for i in range(len(w.procs)):
                w.answer(i, deadline)  # "ready": torch imported, etcd connected
            for trial in range(a.trials):
                for n, stagger in [(n, s) for s in staggers for n in sizes]:
                    for v in (variants if (trial + n) % 2 == 0 else variants[::-1]):
                        what = f"trial {trial} N={n} stagger {stagger} {v}"
                        try:
                            run = one_run(w, srv.endpoint, v, n, stagger, trial, a)
                        except Exception as e:  # noqa: BLE001 - the run's problem; later runs need fresh workers
                            problems.append(f"{what}: {type(e).__name__}: {e}")
                            raise
                        runs.append(run)
                        problems += [f"{what}: {e}" for e in run["errors"]]
                        print(f"trial {trial} N={n:2d} stagger {stagger:.3f} {v:6s}: {run['total']:5.0f} requests "
                              f"({run['per_rank']:.1f}/rank, client-counted {run['client_total']}), "
                              f"wall {run['wall_s']:.3f} s (load {run['load_1m']})", flush=True)
        except Exception as e:  # noqa: BLE001 - already recorded, or the workers' start
            if not problems:
                problems.append(f"{type(e).__name__}: {e}")
            if (tmp / "workers.log").exists():
                print((tmp / "workers.log").read_text()[-4000:], file=sys.stderr)
        finally:
            w.close()
            srv.stop()

    stats: dict[str, dict[str, Any]] = {}
    rows = []
    for stagger, v, n in [(s, v, n) for s in staggers for v in variants for n in sizes]:
        rs = [r for r in runs if r["variant"] == v and r["n"] == n and r["stagger"] == stagger]
        if not rs:
            continue
        s = {"total": summarize(r["total"] for r in rs), "per_rank": summarize(r["per_rank"] for r in rs),
             "wall_s": summarize(r["wall_s"] for r in rs), "build_s_max": summarize(r["build_s_max"] for r in rs),
             **{m: summarize(r["etcd_requests"][m] for r in rs) for m in METHODS}}
        stats[f"{v} N={n} stagger {stagger}"] = s
        rows.append([v, n, stagger, fmt(s["total"]["median"], 0), fmt(s["per_rank"]["median"], 1),
                     *(fmt(s[m]["median"], 0) for m in METHODS),
                     fmt(s["wall_s"]["median"]), fmt(s["build_s_max"]["median"])])
    print(table(["variant", "N", "stagger s", "requests", "per N", *METHODS, "wall s", "build s"], rows, left=1))
    print(f"(medians of {a.trials} trial(s); requests = etcd's, over one rendezvous + allreduce)")
    write_json(a.json, {"benchmark": "rendezvous_ops", "smoke": a.smoke, "ok": not problems, "problems": problems,
                        "machine": machine,
                        "config": {"sizes": sizes, "staggers": staggers, "variants": variants, "trials": a.trials,
                                   "settle_s": a.settle, "timeout_s": a.timeout, "source": source},
                        "stats": stats, "runs": runs})
    return finish("rendezvous_ops", problems)


if __name__ == "__main__":
    sys.exit(main())
