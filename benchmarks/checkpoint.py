"""Persisting a checkpoint: time training is blocked, and end-to-end throughput.

Same state, same disk, one script: hotspare's persistent tier vs ``torch.save`` vs
``torch.distributed.checkpoint.save`` vs ``torch.distributed.checkpoint.async_save``.

The state of each size is a model (parameters in tensors of mixed sizes: a fifth of the
bytes in 256 KiB tensors, the rest in 32 MiB tensors, like a transformer's biases/norms vs
weight matrices) plus its Adam optimizer (exp_avg, exp_avg_sq): parameters are a third
of the bytes. Per method and trial, one checkpoint of a training step:

    t0  checkpoint requested (end of step k)
        training computes the next step's forward/backward for --compute-seconds
        the optimizer step may change the parameters: the checkpoint must be safe by now
    t1  the checkpoint is durable on disk (fsync'd, complete)

* blocked = the time the training thread cannot run. torch.save / dcp.save: the whole
  save (with fsync). dcp.async_save: until it returns (it stages a copy first).
  hotspare: ``SnapshotEngine.capture`` + the optimizer pre-hook's ``wait()`` after the
  compute phase -- exactly what a Session does; the copy to host memory overlaps the
  compute, and the flush to disk runs in another process (the node agent's Persister,
  here a stand-in process running the same class).
* throughput = bytes / (t1 - t0): GB/s of the persisted checkpoint, end to end. t1 is taken
  when it happens, not after the compute phase: async_save's future's done-callback, and the
  mtime of hotspare's manifest (written last, after every fsync).

Files go to --dir (default: benchmarks/out/ckpt-bench on the repository's disk); every
method fsyncs (torch.save via the file handle; DCP's FileSystemWriter syncs by default;
hotspare's writer fsyncs). Files are deleted after each measurement.

    .venv/bin/python benchmarks/checkpoint.py --sizes 0.1,0.5,1,2 --trials 3
    .venv/bin/python benchmarks/checkpoint.py --smoke   # every method, one tiny size: does it work?
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    OUT,
    base_parser,
    finish,
    fmt,
    machine_info,
    parse_args_smoke,
    shm_base,
    table,
    write_json,
)

AIM_BLOCKED = 0.05  # of torch.save's
METHODS = ("hotspare", "torch.save", "dcp.save", "dcp.async_save")


def build_state(gb: float):
    import torch

    torch.manual_seed(0)
    total = int(gb * 1e9 / 3 / 4)  # fp32 parameters: a third of the bytes
    small, big = 64 * 1024, 8 * 1024 * 1024  # elements: 256 KiB and 32 MiB tensors
    sizes, left = [], total
    n_small = max(1, (total // 5) // small)
    sizes += [small] * n_small
    left -= small * n_small
    while left > 0:
        sizes.append(min(big, left))
        left -= sizes[-1]
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for n in sizes])
    model = torch.nn.Module()
    model.params = params
    opt = torch.optim.Adam(params.parameters(), lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg / exp_avg_sq
    return model, opt, 3 * 4 * total


def compute(seconds: float) -> None:
    """The next step's forward/backward: real matmuls on the training thread."""
    import torch

    a = torch.randn(512, 512)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def state_dict(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def run_torch_save(model, opt, d: Path, compute_s: float) -> tuple[float, float]:
    import torch

    t0 = time.perf_counter()
    with open(d / "ckpt.pt", "wb") as f:
        torch.save(state_dict(model, opt), f)
        f.flush()
        os.fsync(f.fileno())
    blocked = time.perf_counter() - t0
    compute(compute_s)
    return blocked, blocked


def run_dcp_save(model, opt, d: Path, compute_s: float) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(state_dict(model, opt), checkpoint_id=str(d / "dcp"))
    blocked = time.perf_counter() - t0
    compute(compute_s)
    return blocked, blocked


def run_dcp_async(model, opt, d: Path, compute_s: float) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    done: list[float] = []
    t0 = time.perf_counter()
    fut = dcp.async_save(state_dict(model, opt), checkpoint_id=str(d / "dcp-async"))
    fut.add_done_callback(lambda _: done.append(time.perf_counter()))
    blocked = time.perf_counter() - t0
    compute(compute_s)
    fut.result()
    deadline = time.monotonic() + 60
    while not done:  # callbacks run just after waiters are woken
        if time.monotonic() > deadline:
            raise RuntimeError("async_save's done-callback did not run within 60s of its result")
        time.sleep(0.0005)
    return blocked, done[0] - t0


class Hotspare:
    """A SnapshotEngine over /dev/shm plus a Persister stand-in process, kept across trials
    (as in a job: the agent and the slots live for the whole run)."""

    def __init__(self, model, opt, d: Path, timeout: float) -> None:
        from hotspare.recovery.snapshot import SnapshotEngine
        from hotspare.recovery.state import provider_for

        self.timeout = timeout
        self.shm = Path(tempfile.mkdtemp(prefix="hs-ckpt-bench-", dir=shm_base()))
        self.eng = SnapshotEngine(self.shm, 0, replicate_every=10, replication_timeout=600)
        self.eng.providers = provider_for("model", model) + provider_for("optimizer", opt)
        d.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="hotspare-", dir=d))  # never an earlier run's files
        self.step = 0
        self.err = tempfile.TemporaryFile()  # the persister's stderr (a pipe could fill up and block it)
        # cwd: not the repository, whose top-level folders must not be importable by bare name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PERSISTER, str(self.shm), str(self.root)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.err, text=True, cwd=self.root)

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-2000:].strip()

    def run(self, compute_s: float) -> tuple[float, float]:
        from hotspare.agents.replica import ReplicaStore
        from hotspare.recovery import persist

        self.step += 10
        if self.step > 10:
            ReplicaStore(self.shm).confirm(0, self.step - 10)  # the previous point's replication gate
        wall0 = time.time()
        t0 = time.perf_counter()
        self.eng.capture(self.step)
        blocked = time.perf_counter() - t0
        compute(compute_s)
        t1 = time.perf_counter()
        self.eng.wait()  # the optimizer step's pre-hook
        blocked += time.perf_counter() - t1
        deadline = time.monotonic() + self.timeout
        while self.step not in persist.complete_steps(self.root):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the persister process exited with {self.proc.returncode} before step "
                                   f"{self.step} was persisted: {self.stderr_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"step {self.step} was not persisted within {self.timeout:g}s")
            time.sleep(0.002)
        # durable when the manifest (written last, after every fsync) was: its mtime
        manifest = persist.step_dir(self.root, self.step) / "manifest.json"
        return blocked, manifest.stat().st_mtime - wall0

    def close(self) -> str | None:
        """Stop the persister and the engine; a problem (the persister failed), or None."""
        problem = None
        try:
            self.proc.communicate(timeout=30)  # closes stdin: the persister stops
            if self.proc.returncode != 0:
                problem = f"the persister process exited with {self.proc.returncode}: {self.stderr_tail()}"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            problem = "the persister process did not stop within 30s"
        self.err.close()
        self.eng.close()
        shutil.rmtree(self.shm, ignore_errors=True)
        return problem


PERSISTER = """
import sys
from pathlib import Path
from hotspare.agents.node_view import NodeView
from hotspare.agents.persist import Persister
from hotspare.orchestrator.spec import JobSpec
spec = JobSpec(name="bench", entrypoint="x:y", ranks=1, steps=1, persist_every=10,
               persist_path=sys.argv[2], output_dir=sys.argv[2], persist_keep=1)
view = NodeView(epoch=1, world_size=1, seats={0: 0})
p = Persister(Path(sys.argv[1]), spec, job="bench", view=lambda: view,
              event=lambda *a, **k: None).start()  # the agent's own settings
sys.stdin.read()
p.stop()
"""


def measure(gb: float, trials: int, base: Path, compute_s: float, persist_timeout: float) -> dict[str, Any]:
    """Every method at state size ``gb``: medians of the measured trials, and ``problems``
    (one line each, naming the size and method) for every run that failed."""
    model, opt, nbytes = build_state(gb)
    res: dict[str, Any] = {"gb": gb, "bytes": nbytes}
    runners = {"torch.save": run_torch_save, "dcp.save": run_dcp_save, "dcp.async_save": run_dcp_async}
    failed: dict[str, list[str]] = {m: [] for m in METHODS}
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    hs: Hotspare | None = None
    try:
        hs = Hotspare(model, opt, base, persist_timeout)
    except Exception as e:
        failed["hotspare"].append(f"could not start: {type(e).__name__}: {e}")
    try:
        for t in range(trials + 1):  # trial 0 warms up (page cache, allocator, imports)
            order = list(METHODS) if t % 2 else list(reversed(METHODS))
            for m in order:
                if m == "hotspare" and hs is None:
                    continue
                d = base / f"{m}-{t}"
                d.mkdir(parents=True, exist_ok=True)
                try:
                    b, e = hs.run(compute_s) if m == "hotspare" else runners[m](model, opt, d, compute_s)
                except Exception as exc:  # a failed method must not hide the others' results
                    failed[m].append(f"trial {t}: {type(exc).__name__}: {exc}")
                    print(f"  {gb:g} GB {m:<15} trial {t}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                    continue
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                if t:
                    samples[m].append((b, e))
                print(f"  {gb:g} GB {m:<15} trial {t}: blocked {b:.3f}s, durable after {e:.3f}s", flush=True)
    finally:
        if hs is not None:
            pr = hs.close()
            if pr:
                failed["hotspare"].append(pr)
    for m, xs in samples.items():
        if not xs and not failed[m]:
            failed[m].append("no measured trial")
        blocked = statistics.median(x[0] for x in xs) if xs else None
        e2e = statistics.median(x[1] for x in xs) if xs else None
        res[m] = {"blocked_s": blocked, "end_to_end_s": e2e, "gb_per_s": nbytes / 1e9 / e2e if e2e else None,
                  "trials": [{"blocked_s": b, "end_to_end_s": e} for b, e in xs],
                  "ok": not failed[m], "problems": failed[m]}
    hs_r, ts_r, as_r = res["hotspare"], res["torch.save"], res["dcp.async_save"]
    res["blocked_vs_torch_save"] = (hs_r["blocked_s"] / ts_r["blocked_s"]
                                    if hs_r["blocked_s"] is not None and ts_r["blocked_s"] else None)
    res["throughput_vs_async_save"] = (hs_r["gb_per_s"] / as_r["gb_per_s"]
                                       if hs_r["gb_per_s"] is not None and as_r["gb_per_s"] else None)
    res["problems"] = [f"{gb:g} GB {m}: {pr}" for m in METHODS for pr in failed[m]]
    return res


#: --smoke: every method once (after its warm-up) at one tiny size, a short compute phase, a temp dir
SMOKE = {"sizes": "0.001", "compute_seconds": 0.05, "dir": None, "persist_timeout": 60.0}


def parse_args(argv: list[str] | None = None):
    p = base_parser(__doc__, "checkpoint.json", "measured trials per size and method (after one warm-up)")
    p.set_defaults(trials=3)
    p.add_argument("--sizes", default="0.1,0.5,1,2", help="state sizes in GB, comma-separated")
    p.add_argument("--compute-seconds", type=float, default=1.0,
                   help="the next step's forward/backward, run between checkpoint and optimizer step")
    p.add_argument("--compute-threads", type=int, default=1,
                   help="torch threads of the compute phase (on a GPU node the host cores are free for I/O; "
                   "0 = torch's default, every core)")
    p.add_argument("--dir", default=str(OUT / "ckpt-bench"),
                   help="where checkpoints are written (a real disk; with --smoke: a temp dir unless given)")
    p.add_argument("--persist-timeout", type=float, default=600.0,
                   help="hotspare: fail when a checkpoint is not persisted within this many seconds")
    a = parse_args_smoke(p, argv, SMOKE)
    try:
        a.sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: not a list of numbers: {a.sizes!r}")
    if not a.sizes or any(s <= 0 for s in a.sizes):
        p.error("--sizes must name at least one size > 0")
    if a.trials < 1:
        p.error("--trials must be >= 1")
    if a.dir is None:
        a.dir = tempfile.mkdtemp(prefix="hotspare-ckpt-smoke-")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.compute_threads:
        import torch

        torch.set_num_threads(a.compute_threads)
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for gb in a.sizes:
            results.append(measure(gb, a.trials, base, a.compute_seconds, a.persist_timeout))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for r in results:
        for m in METHODS:
            x = r[m]
            rows.append([f"{r['gb']:g} GB", m, fmt(x["blocked_s"]), fmt(x["end_to_end_s"]), fmt(x["gb_per_s"], 2)])
    print("\n" + table(["state", "method", "blocked s", "durable after s", "GB/s"], rows, left=2))
    for r in results:
        bt, tp = r["blocked_vs_torch_save"], r["throughput_vs_async_save"]
        ok_b = "n/a" if bt is None else ("met" if bt <= AIM_BLOCKED else "NOT met")
        ok_t = "n/a" if tp is None else ("met" if tp >= 1.0 else "NOT met")
        print(f"{r['gb']:g} GB: hotspare blocked = {fmt(bt)} x torch.save's (aim <= {AIM_BLOCKED}: {ok_b}); "
              f"throughput = {fmt(tp, 2)} x async_save's (aim >= 1: {ok_t})")
    problems = [pr for r in results for pr in r["problems"]]
    path = write_json(a.json, {"benchmark": "checkpoint", "smoke": a.smoke, "ok": not problems,
                               "problems": problems, "machine": machine_info(), "dir": str(base),
                               "compute_seconds": a.compute_seconds,
                               "compute_threads": a.compute_threads, "trials": a.trials, "results": results})
    print(f"wrote {path}")
    return finish("checkpoint", problems)


if __name__ == "__main__":
    sys.exit(main())
