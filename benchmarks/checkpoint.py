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

from common import OUT, REPO, base_parser, fmt, machine_info, shm_base, table, write_json

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
    while not done:  # callbacks run just after waiters are woken
        time.sleep(0.0005)
    return blocked, done[0] - t0


class Hotspare:
    """A SnapshotEngine over /dev/shm plus a Persister stand-in process, kept across trials
    (as in a job: the agent and the slots live for the whole run)."""

    def __init__(self, model, opt, d: Path) -> None:
        from recovery.snapshot import SnapshotEngine
        from recovery.state import provider_for

        self.shm = Path(tempfile.mkdtemp(prefix="hs-ckpt-bench-", dir=shm_base()))
        self.eng = SnapshotEngine(self.shm, 0, replicate_every=10, replication_timeout=600)
        self.eng.providers = provider_for("model", model) + provider_for("optimizer", opt)
        d.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="hotspare-", dir=d))  # never an earlier run's files
        self.step = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PERSISTER, str(self.shm), str(self.root)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)

    def run(self, compute_s: float) -> tuple[float, float]:
        from agents.replica import ReplicaStore
        from recovery import persist

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
        while self.step not in persist.complete_steps(self.root):
            time.sleep(0.002)
        # durable when the manifest (written last, after every fsync) was: its mtime
        manifest = persist.step_dir(self.root, self.step) / "manifest.json"
        return blocked, manifest.stat().st_mtime - wall0

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self.eng.close()
        shutil.rmtree(self.shm, ignore_errors=True)


PERSISTER = """
import sys, threading
sys.path.insert(0, '.')
from pathlib import Path
from agents.node_view import NodeView
from agents.persist import Persister
from orchestrator.spec import JobSpec
spec = JobSpec(name="bench", entrypoint="x:y", ranks=1, steps=1, persist_every=10,
               persist_path=sys.argv[2], output_dir=sys.argv[2], persist_keep=1)
view = NodeView(epoch=1, world_size=1, seats={0: 0})
p = Persister(Path(sys.argv[1]), spec, job="bench", view=lambda: view,
              event=lambda *a, **k: None).start()  # the agent's own settings
sys.stdin.read()
p.stop()
"""


def measure(gb: float, trials: int, base: Path, compute_s: float) -> dict[str, Any]:
    model, opt, nbytes = build_state(gb)
    res: dict[str, Any] = {"gb": gb, "bytes": nbytes}
    runners = {"torch.save": run_torch_save, "dcp.save": run_dcp_save, "dcp.async_save": run_dcp_async}
    hs = Hotspare(model, opt, base)
    try:
        samples: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
        for t in range(trials + 1):  # trial 0 warms up (page cache, allocator, imports)
            order = list(METHODS) if t % 2 else list(reversed(METHODS))
            for m in order:
                d = base / f"{m}-{t}"
                d.mkdir(parents=True, exist_ok=True)
                b, e = hs.run(compute_s) if m == "hotspare" else runners[m](model, opt, d, compute_s)
                if t:
                    samples[m].append((b, e))
                shutil.rmtree(d, ignore_errors=True)
                print(f"  {gb:g} GB {m:<15} trial {t}: blocked {b:.3f}s, durable after {e:.3f}s", flush=True)
    finally:
        hs.close()
    for m, xs in samples.items():
        blocked = statistics.median(x[0] for x in xs)
        e2e = statistics.median(x[1] for x in xs)
        res[m] = {"blocked_s": blocked, "end_to_end_s": e2e, "gb_per_s": nbytes / 1e9 / e2e,
                  "trials": [{"blocked_s": b, "end_to_end_s": e} for b, e in xs]}
    res["blocked_vs_torch_save"] = res["hotspare"]["blocked_s"] / res["torch.save"]["blocked_s"]
    res["throughput_vs_async_save"] = res["hotspare"]["gb_per_s"] / res["dcp.async_save"]["gb_per_s"]
    return res


def main() -> None:
    p = base_parser(__doc__, "checkpoint.json", "measured trials per size and method (after one warm-up)")
    p.set_defaults(trials=3)
    p.add_argument("--sizes", default="0.1,0.5,1,2", help="state sizes in GB, comma-separated")
    p.add_argument("--compute-seconds", type=float, default=1.0,
                   help="the next step's forward/backward, run between checkpoint and optimizer step")
    p.add_argument("--compute-threads", type=int, default=1,
                   help="torch threads of the compute phase (on a GPU node the host cores are free for I/O; "
                   "0 = torch's default, every core)")
    p.add_argument("--dir", default=str(OUT / "ckpt-bench"), help="where checkpoints are written (a real disk)")
    a = p.parse_args()
    sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    if a.compute_threads:
        import torch

        torch.set_num_threads(a.compute_threads)
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for gb in sizes:
            results.append(measure(gb, a.trials, base, a.compute_seconds))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for r in results:
        for m in METHODS:
            x = r[m]
            rows.append([f"{r['gb']:g} GB", m, fmt(x["blocked_s"]), fmt(x["end_to_end_s"]), fmt(x["gb_per_s"], 2)])
    print("\n" + table(["state", "method", "blocked s", "durable after s", "GB/s"], rows, left=2))
    for r in results:
        ok_b = r["blocked_vs_torch_save"] <= AIM_BLOCKED
        ok_t = r["throughput_vs_async_save"] >= 1.0
        print(f"{r['gb']:g} GB: hotspare blocked = {r['blocked_vs_torch_save']:.3f} x torch.save's "
              f"(aim <= {AIM_BLOCKED}: {'met' if ok_b else 'NOT met'}); throughput = "
              f"{r['throughput_vs_async_save']:.2f} x async_save's (aim >= 1: {'met' if ok_t else 'NOT met'})")
    path = write_json(a.json, {"benchmark": "checkpoint", "machine": machine_info(), "dir": str(base),
                               "compute_seconds": a.compute_seconds,
                               "compute_threads": a.compute_threads, "trials": a.trials, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
