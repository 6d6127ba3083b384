"""Optimizer state on disk: hotspare's OffloadedAdamW vs in-RAM AdamW, a naive offload, and
DeepSpeed ZeRO-Infinity (NVMe optimizer offload), against the disk's own bandwidth.

One model (``--blocks`` blocks of Linear(width, width) + GELU, fp32), the same data, M
micro-batches per step (gradient accumulation), AdamW (lr 1e-3, weight decay 0.01). Two
scenarios: ``io-bound`` (small micro-batches: the step's I/O dominates) and ``compute-bound``
(large ones: the I/O fits under forward/backward). The optimizer state is several times the
RAM budget given to the offloading variants (``--budget-layers`` blocks' worth). Variants, each
in its own process (peak RSS = ``ru_maxrss`` of that process):

* compute      forward/backward only, no optimizer: the compute time and the RSS floor
* inram        ``torch.optim.AdamW``: the lower bound
* naive        after backward: read all moments, step, write them all back; synchronous
* hotspare-h   OffloadedAdamW, horizontal accumulation loop, overlap=True
* hotspare-h-sync   the same with overlap=False (step() waits for every layer)
* hotspare-v   OffloadedAdamW with ``vertical_step`` (all micro-batches block by block)
* hotspare-v-nocrc   the same with ``verify=False`` (no checksums: lengths only), for the CPU cost
* deepspeed    ZeRO-3, ``offload_optimizer: nvme`` on DeepSpeed's CPU accelerator, run by
               ``--deepspeed-python`` (its own venv); it swaps fp32 master weights too (12
               bytes/param each way, vs 8 for hotspare, whose parameters stay in RAM)
* disk         the roofline: sequential O_DIRECT write and read of a state-sized file on
               ``--dir`` (4 threads, 4 MiB requests), and both at once

Every file I/O uses O_DIRECT (DeepSpeed's aio does too): the page cache is bypassed, so the
numbers are the disk's, not RAM's. Reported per variant: step time; bytes per step and the
achieved rate (bytes / step time) as a fraction of the roofline for that traffic; the overlap
fraction (share of the I/O busy time hidden behind compute: 1 - max(0, step - inram step) /
I/O busy time); peak RSS, and above the ``compute`` variant's (for hotspare: the state buffers
plus torch's AdamW temporaries, ~3x the largest parameter, and what glibc keeps of them). ``--trials`` runs per variant,
round robin in alternating order (the machine is shared and drifts); the median trial is shown. Final parameters and moments of
inram, naive and hotspare-* must be bit-identical (SHA-256), else the run fails.

    .venv/bin/python benchmarks/offload.py --json benchmarks/out/offload.json
    .venv/bin/python benchmarks/offload.py --smoke     # tiny, every variant but deepspeed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import base_parser, finish, fmt, machine_info, parse_args_smoke, table, write_json

OURS = ("inram", "naive", "hotspare-h", "hotspare-h-sync", "hotspare-v", "hotspare-v-nocrc")
VARIANTS = ("compute", *OURS, "deepspeed")
AIM_FIT, AIM_NAIVE, AIM_DISK = 1.15, 1.9, 0.80
DS_DEFAULT = "/work/ds-venv/bin/python"


# -- the worker: one variant, one process -------------------------------------------------------
def build(cfg: dict[str, Any]):
    import torch
    from torch import nn

    torch.manual_seed(0)
    w = cfg["width"]
    model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.GELU()) for _ in range(cfg["blocks"])])
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(cfg["micro"], w, generator=g), torch.randn(cfg["micro"], w, generator=g))
             for _ in range(cfg["m"])] for _ in range(cfg["warmup"] + cfg["steps"])]
    return model, data


def digest(model, state: dict) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        for k in ("exp_avg", "exp_avg_sq"):
            if p in state:
                h.update(state[p][k].numpy().tobytes())
    return h.hexdigest()


class Naive:
    """Load all moments, step, write all back: one O_DIRECT file, synchronous, no overlap."""

    def __init__(self, model, path: Path, lr: float, wd: float) -> None:
        import torch
        from torch.optim.optimizer import _get_scalar_dtype

        from hotspare.recovery.offload_io import Buffer

        self.params, self.lr, self.wd = list(model.parameters()), lr, wd
        self.offs, off = [], 0
        for _ in range(2):
            for p in self.params:
                self.offs.append(off)
                off += (p.numel() * 4 + 63) // 64 * 64
        self.buf = Buffer(off)
        self.fd = os.open(path / "naive.bin", os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        self.steps = [torch.tensor(0.0, dtype=_get_scalar_dtype()) for _ in self.params]
        self.io_s, self.bytes = 0.0, 0

    def _io(self, write: bool) -> None:
        t0, view, done = time.perf_counter(), self.buf.view, 0
        while done < len(view):
            part = view[done:done + (1 << 30)]
            n = os.pwritev(self.fd, [part], done) if write else os.preadv(self.fd, [part], done)
            done += n
        self.io_s += time.perf_counter() - t0
        self.bytes += len(view)

    def views(self):
        n = len(self.params)
        return [[self.buf.tensor(self.offs[k * n + i], p.numel(), p.dtype).view(p.shape)
                 for i, p in enumerate(self.params)] for k in range(2)]

    def step(self) -> None:
        import torch
        from torch.optim.adam import adam

        if float(self.steps[0]) > 0:
            self._io(write=False)
        else:
            self.buf.zero(0, self.buf.nbytes)
        m, v = self.views()
        with torch.no_grad():
            adam(self.params, [p.grad for p in self.params], m, v, [], self.steps, foreach=False,
                 decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=self.lr,
                 weight_decay=self.wd, eps=1e-8, maximize=False)
        self._io(write=True)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state(self) -> dict:
        m, v = self.views()
        return {p: {"exp_avg": m[i], "exp_avg_sq": v[i]} for i, p in enumerate(self.params)}


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import resource

    import torch

    from hotspare.recovery.offload import OffloadedAdamW, vertical_step

    warm = torch.nn.Parameter(torch.zeros(1))  # every variant pays torch.optim's imports (dynamo): same RSS floor
    warm.grad = torch.zeros(1)
    torch.optim.AdamW([warm]).step()
    model, data = build(cfg)
    variant, m, lr, wd = cfg["variant"], cfg["m"], 1e-3, 0.01
    d = Path(cfg["dir"])
    opt: Any = None
    if variant == "inram":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    elif variant == "naive":
        opt = Naive(model, d, lr, wd)
    elif variant.startswith("hotspare"):
        kw = dict(lr=lr, weight_decay=wd, layers=list(model), overlap=variant != "hotspare-h-sync",
                  accumulation_steps=m, io_threads=cfg["io_threads"], verify=not variant.endswith("nocrc"))
        probe = OffloadedAdamW(model, d / "probe", **kw)
        budget = cfg["budget_layers"] * probe.slot_bytes
        probe.close()
        shutil.rmtree(d / "probe", ignore_errors=True)
        opt = OffloadedAdamW(model, d / "state", ram_budget_bytes=budget, **kw)

    def loss_fn(out, y):
        return ((out - y) ** 2).mean() / m

    times, io0, io1, t_all = [], None, None, 0.0
    for i, mbs in enumerate(data):
        if i == cfg["warmup"] and variant.startswith("hotspare"):
            opt.finish()
            io0 = dict(opt.stats())
        elif i == cfg["warmup"] and variant == "naive":
            opt.bytes, opt.io_s = 0, 0.0  # the first step reads nothing: count measured steps only
        t0 = time.perf_counter()
        if variant.startswith("hotspare-v"):
            vertical_step(model, mbs, loss_fn, opt)
        else:
            for x, y in mbs:
                loss_fn(model(x), y).backward()
            if opt is not None:
                opt.step()
        if opt is not None:
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=True)
        if i == len(data) - 1 and variant.startswith("hotspare"):
            opt.finish()  # the last step's deferred updates count
            io1 = dict(opt.stats())  # before reads for a next step that never comes
        dt = time.perf_counter() - t0
        if i >= cfg["warmup"]:
            times.append(dt)
            t_all += dt
    out: dict[str, Any] = {"step_s": t_all / len(times), "times": times,
                           "params": sum(p.numel() for p in model.parameters()),
                           "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # before digests
    if variant == "inram":
        out["digest"] = digest(model, opt.state)
    elif variant == "naive":
        out.update(digest=digest(model, opt.state()), bytes_per_step=opt.bytes / cfg["steps"],
                   io_busy_s=opt.io_s / cfg["steps"])
    elif variant.startswith("hotspare"):
        st = io1
        moved = (st["bytes_read"] + st["bytes_written"]) - (io0["bytes_read"] + io0["bytes_written"])
        out.update(bytes_per_step=moved / cfg["steps"], io_busy_s=(st["io_busy_s"] - io0["io_busy_s"]) / cfg["steps"],
                   wait_s=(st["wait_s"] - io0["wait_s"]) / cfg["steps"], direct=st["direct"],
                   budget_bytes=opt.ram_budget_bytes, state_bytes=sum(L.data_len for L in opt.layers))
        out["digest"] = digest(model, opt.read_state())
        opt.close()
    return out


def disk_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Sequential O_DIRECT bandwidth of --dir: write, read, and both at once (two files)."""
    from concurrent.futures import ThreadPoolExecutor

    from hotspare.recovery.offload_io import Buffer

    size, chunk = cfg["bytes"], 4 << 20
    bufs = [Buffer(size), Buffer(size)]
    for b in bufs:
        b.view[:] = os.urandom(1 << 20) * (len(b.view) >> 20) + os.urandom(len(b.view) % (1 << 20))
    fds = [os.open(Path(cfg["dir"]) / f"disk{i}.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600) for i in (0, 1)]
    size = len(bufs[0].view)
    pool = ThreadPoolExecutor(4)

    def run(jobs) -> float:
        def one(j):
            kind, k, off = j
            part = bufs[k].view[off:off + chunk]
            return os.pwritev(fds[k], [part], off) if kind == "w" else os.preadv(fds[k], [part], off)

        t0 = time.perf_counter()
        list(pool.map(one, jobs))
        return time.perf_counter() - t0

    offs = range(0, size, chunk)
    run([("w", k, o) for k in (0, 1) for o in offs])  # allocate both files
    res = {}
    for _ in range(2):  # best of two passes
        res["write_gbps"] = max(res.get("write_gbps", 0), size / run([("w", 0, o) for o in offs]) / 1e9)
        res["read_gbps"] = max(res.get("read_gbps", 0), size / run([("r", 0, o) for o in offs]) / 1e9)
        mixed = [j for o in offs for j in (("r", 0, o), ("w", 1, o))]
        res["mixed_gbps"] = max(res.get("mixed_gbps", 0), 2 * size / run(mixed) / 1e9)
    res["bytes"] = size
    return res


DS_NOTE = ("ZeRO-3, offload_optimizer nvme (aio: 4 threads, 1 MiB blocks, queue depth 8), sub_group_size = one "
           "block, the default non-pipelined swapper: pipeline_read/write with buffer_count 4 or 8 failed "
           "('PipelinedOptimizerSwapper ran out of swap buffers'); with 16 it ran no faster (1024x8: 0.377 vs "
           "0.361 s/step) with 116 MB more RSS. Its AdamW kernel is DeepSpeedCPUAdam: not bit-compared")
DS_SCRIPT = r"""
import json, os, resource, sys, time
for k, v in (("DS_ACCELERATOR", "cpu"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"),
             ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(k, v)
import deepspeed, torch
cfg = json.loads(sys.argv[1])
nn = torch.nn
torch.manual_seed(0)
w, m = cfg["width"], cfg["m"]
model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.GELU()) for _ in range(cfg["blocks"])])
g = torch.Generator().manual_seed(1)
data = [[(torch.randn(cfg["micro"], w, generator=g), torch.randn(cfg["micro"], w, generator=g))
         for _ in range(m)] for _ in range(cfg["warmup"] + cfg["steps"])]
ds = {"train_batch_size": cfg["micro"] * m, "train_micro_batch_size_per_gpu": cfg["micro"],
      "gradient_accumulation_steps": m, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 3, "sub_group_size": w * w + w,
                            "offload_optimizer": {"device": "nvme", "nvme_path": cfg["dir"], "pin_memory": False,
                                                  "buffer_count": 4, "pipeline_read": False, "pipeline_write": False}},
      "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 4, "single_submit": False,
              "overlap_events": True}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
times = []
for i, mbs in enumerate(data):
    t0 = time.perf_counter()
    for x, y in mbs:
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
    if i >= cfg["warmup"]:
        times.append(time.perf_counter() - t0)
print("RESULT " + json.dumps({"step_s": sum(times) / len(times), "times": times,
                              "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


# -- the driver ---------------------------------------------------------------------------------------
def spawn(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f}s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()
        err = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "")
        return {"ok": False, "error": f"exit code {r.returncode}: {err.strip()}"[:600]}
    return {"ok": True, **json.loads(lines[-1][7:])}


def run_variant(variant: str, cfg: dict[str, Any], a) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=a.dir))
    c = {**cfg, "variant": variant, "dir": str(d)}
    try:
        if variant == "deepspeed":
            if not a.deepspeed_python or not Path(a.deepspeed_python).exists():
                return {"ok": False, "skipped": True,
                        "error": f"not run: no DeepSpeed interpreter ({a.deepspeed_python or 'none given'})"}
            env = dict(os.environ, DS_ACCELERATOR="cpu")
            return {**spawn([a.deepspeed_python, "-c", DS_SCRIPT, json.dumps(c)], a.timeout, env), "note": DS_NOTE}
        return spawn([sys.executable, __file__, "--worker", json.dumps(c)], a.timeout)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def analyse(s: dict[str, Any], disk: dict[str, Any]) -> None:
    """Derived columns: traffic, achieved rate vs roofline, overlap, RSS above compute."""
    inram = s["inram"].get("step_s")
    floor = s["compute"].get("maxrss_mb")
    for v in OURS + ("deepspeed",):
        r = s[v]
        if not r.get("ok"):
            continue
        if v == "deepspeed":  # fp32 params + both moments, read and written once per step
            r["bytes_per_step"] = 2 * 12 * r.get("params", s["inram"].get("params", 0))
            r["bytes_estimated"] = True
        b = r.get("bytes_per_step") or 0
        if b and disk.get("ok"):
            half = b / 2
            t_roof = min(half / (disk["read_gbps"] * 1e9) + half / (disk["write_gbps"] * 1e9),
                         b / (disk["mixed_gbps"] * 1e9))
            r["achieved_gbps"] = b / r["step_s"] / 1e9
            r["roofline_gbps"] = b / t_roof / 1e9
            r["of_roofline"] = t_roof / r["step_s"]
        if v == "naive":
            r["overlap"] = 0.0  # synchronous by construction
        elif r.get("io_busy_s") and inram:
            exposed = max(0.0, r["step_s"] - inram)
            r["overlap"] = max(0.0, min(1.0, 1 - exposed / r["io_busy_s"]))
        if floor is not None and r.get("maxrss_mb") is not None:
            r["rss_above_compute_mb"] = r["maxrss_mb"] - floor


def check(name: str, s: dict[str, Any]) -> list[str]:
    problems = [f"{name} {v}: {s[v].get('error')}" for v in ("compute", *OURS) if not s[v].get("ok")]
    digests = {v: s[v].get("digest") for v in OURS if s[v].get("ok")}
    if len(set(digests.values())) > 1:
        problems.append(f"{name}: final parameters/moments differ between variants: {digests}")
    s["bit_identical"] = len(digests) == len(OURS) and len(set(digests.values())) == 1
    for v in ("compute", *OURS):
        if s[v].get("ok") and not math.isfinite(s[v]["step_s"]):
            problems.append(f"{name} {v}: step time {s[v]['step_s']}")
    return problems


def aims(name: str, s: dict[str, Any]) -> dict[str, Any]:
    """This scenario's aims, for the best CRC-checked hotspare variant and the CRC-less one."""
    inram, naive = s["inram"], s["naive"]
    crc = [s[v] for v in ("hotspare-h", "hotspare-v") if s[v].get("ok")]
    out: dict[str, Any] = {}
    for key, cands in (("crc32", crc), ("nocrc", [s["hotspare-v-nocrc"]] if s["hotspare-v-nocrc"].get("ok") else [])):
        if not cands or not inram.get("ok") or not naive.get("ok"):
            continue
        best = min(cands, key=lambda r: r["step_s"])
        x = {"vs_inram": best["step_s"] / inram["step_s"], "speedup_vs_naive": naive["step_s"] / best["step_s"],
             "of_roofline": best.get("of_roofline")}
        if name == "compute-bound":
            x["met"] = x["vs_inram"] <= AIM_FIT
        else:
            x["met"] = x["speedup_vs_naive"] >= AIM_NAIVE and (x["of_roofline"] or 0) >= AIM_DISK
        out[key] = x
    h = [s[v] for v in ("hotspare-h", "hotspare-v") if s[v].get("ok")]
    if h:
        out["rss_above_compute_mb"] = {v: round(s[v].get("rss_above_compute_mb") or 0) for v in ("hotspare-h", "hotspare-v")}
        out["budget_mb"] = h[0]["budget_bytes"] / 2**20
        out["rss_within_budget"] = all((r.get("rss_above_compute_mb") or 1e9) <= out["budget_mb"] for r in h)
    return out


SMOKE = {"width": 64, "blocks": 4, "micro_io": 2, "micro_compute": 2, "m": 2, "steps": 2, "warmup": 1,
         "scenarios": "io-bound", "deepspeed_python": "", "disk_mb": 16}


def parse_args(argv: list[str] | None = None):
    p = base_parser(__doc__, "offload.json", "runs per variant (round robin; the median is reported)")
    p.set_defaults(trials=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--m", type=int, default=4, help="micro-batches per step")
    p.add_argument("--micro-io", type=int, default=2, help="micro-batch size, io-bound scenario")
    p.add_argument("--micro-compute", type=int, default=192, help="micro-batch size, compute-bound scenario")
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="steps before measuring (the first writes the files)")
    p.add_argument("--budget-layers", type=int, default=2, help="RAM budget for offloaded state, in blocks")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--scenarios", default="io-bound,compute-bound")
    p.add_argument("--disk-mb", type=int, default=0, help="roofline file size (0: the model's moments)")
    p.add_argument("--dir", default=None, help="where state files go (default: a temp dir on /tmp's disk)")
    p.add_argument("--deepspeed-python", default=DS_DEFAULT, help="a venv's python with deepspeed ('' = skip)")
    p.add_argument("--timeout", type=float, default=600.0, help="per variant")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return parse_args_smoke(p, argv, SMOKE)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        cfg = json.loads(sys.argv[2])
        res = disk_worker(cfg) if cfg["variant"] == "disk" else worker(cfg)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    a = parse_args(argv)
    own_dir = a.dir is None
    a.dir = tempfile.mkdtemp(prefix="hotspare-offload-bench-", dir=a.dir)
    t_start = time.monotonic()
    params = a.blocks * (a.width * a.width + a.width)
    disk_bytes = (a.disk_mb << 20) or 8 * params
    results: dict[str, Any] = {}
    problems: list[str] = []
    try:
        d = Path(tempfile.mkdtemp(dir=a.dir))
        disk = spawn([sys.executable, __file__, "--worker", json.dumps({"variant": "disk", "dir": str(d),
                                                                        "bytes": disk_bytes})], a.timeout)
        shutil.rmtree(d, ignore_errors=True)
        if not disk.get("ok"):
            problems.append(f"disk roofline: {disk.get('error')}")
        print(f"disk ({fmt(disk_bytes / 1e9, 2)} GB, O_DIRECT): " + (
            f"write {fmt(disk['write_gbps'], 2)} GB/s, read {fmt(disk['read_gbps'], 2)} GB/s, "
            f"both at once {fmt(disk['mixed_gbps'], 2)} GB/s" if disk.get("ok") else disk.get("error", "")), flush=True)
        for name in [x.strip() for x in a.scenarios.split(",") if x.strip()]:
            micro = a.micro_io if name == "io-bound" else a.micro_compute
            cfg = {"width": a.width, "blocks": a.blocks, "micro": micro, "m": a.m, "steps": a.steps,
                   "warmup": a.warmup, "budget_layers": a.budget_layers, "io_threads": a.io_threads}
            s: dict[str, Any] = {"config": cfg}
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for t in range(a.trials):  # round robin, alternating order: drifts of a shared machine spread out
                for v in VARIANTS if t % 2 == 0 else VARIANTS[::-1]:
                    if v == "deepspeed" and t:
                        continue  # once: its JIT-built ops and start-up take long
                    r = run_variant(v, cfg, a)
                    runs[v].append(r)
                    print(f"  {name:<13} {v:<16} trial {t}: " + (
                        f"{r['step_s']:.3f} s/step, peak RSS {r['maxrss_mb']:.0f} MB" if r.get("ok")
                        else ("" if r.get("skipped") else "FAILED: ") + str(r.get("error"))), flush=True)
            for v, rs in runs.items():
                bad = [r for r in rs if not r.get("ok")]
                if bad:
                    s[v] = bad[0]
                else:  # the median trial (the lower middle one for an even count)
                    s[v] = sorted(rs, key=lambda r: r["step_s"])[(len(rs) - 1) // 2]
                    s[v]["trials_s"] = [r["step_s"] for r in rs]
            s["deepspeed"].setdefault("params", params)
            analyse(s, disk)
            problems += check(name, s)
            s["aims"] = aims(name, s)
            results[name] = s
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    rows = []
    for name, s in results.items():
        for v in VARIANTS:
            r = s[v]
            if not r.get("ok"):
                rows.append([name, v, "-", "-", "-", "-", "-", "-", "-",
                             str(r.get("error"))[:90] if r.get("skipped") else "FAILED: " + str(r.get("error"))[:90]])
                continue
            rows.append([name, v, fmt(r["step_s"]), fmt(r.get("bytes_per_step", 0) / 1e9, 2) + ("~" if r.get("bytes_estimated") else ""),
                         fmt(r.get("achieved_gbps"), 2), fmt(r.get("of_roofline"), 2), fmt(r.get("overlap"), 2),
                         f"{r['maxrss_mb']:.0f}", fmt(r.get("rss_above_compute_mb"), 0), ""])
    print("\n" + table(["scenario", "variant", "s/step", "GB/step", "GB/s", "of disk", "overlap", "RSS MB",
                        "+RSS MB", "note"], rows, left=2))
    for name, s in results.items():
        x = s["aims"]
        for key, label in (("crc32", "hotspare (checksums on)"), ("nocrc", "hotspare-v without checksums")):
            if key not in x:
                continue
            y = x[key]
            what = (f"{fmt(y['vs_inram'], 2)} x in-RAM AdamW (aim <= {AIM_FIT})" if name == "compute-bound" else
                    f"{fmt(y['speedup_vs_naive'], 2)} x faster than naive (aim >= {AIM_NAIVE}), "
                    f"{fmt(y['of_roofline'], 2)} of the disk (aim >= {AIM_DISK})")
            print(f"{name}: {label}: {what}: {'met' if y['met'] else 'NOT met'}")
        if "budget_mb" in x:
            print(f"{name}: RSS above the compute-only run {x['rss_above_compute_mb']} MB vs the {fmt(x['budget_mb'], 0)} MB "
                  f"budget: {'met' if x['rss_within_budget'] else 'NOT met'}; bit-identical: {s['bit_identical']}")
    path = write_json(a.json, {"benchmark": "offload", "smoke": a.smoke, "ok": not problems, "problems": problems,
                               "machine": machine_info(), "page_cache": "bypassed (O_DIRECT everywhere)",
                               "disk": disk, "scenarios": results, "wall_s": time.monotonic() - t_start,
                               "dir_default": own_dir})
    print(f"wrote {path}")
    return finish("offload", problems)


if __name__ == "__main__":
    sys.exit(main())
