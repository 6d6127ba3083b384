"""GPU check: DDP and FSDP2 under hot swap on NCCL, on one GPU machine, in a few minutes.

Run it through ``bash benchmarks/gpu_check.sh`` (it picks the machine's CUDA torch, makes
hotspare importable with it without downloading anything, then runs this file), or directly
with a Python whose torch has CUDA and which can import hotspare.

What it does, on the embedded default (a private etcd and controller, local agents: like the
other benchmarks, ``benchmarks/common.BenchCluster`` running ``hotspare run SPEC --json``):

1. Picks how ``--ranks`` ranks (default 2, plus one spare) share the GPU. NCCL normally
   refuses two ranks of one communicator on one device ("Duplicate GPU detected"), so a
   two-process NCCL all-reduce *probe* (the same ``ProcessGroupNCCL`` construction hotspare
   uses) tries, in order, until one works (``--config`` picks one):

   * ``shared``   every rank on GPU 0 (``CUDA_VISIBLE_DEVICES=0``);
   * ``hostid``   every rank on GPU 0, each with its own ``NCCL_HOSTID`` (NCCL takes them
                  for ranks on different hosts and connects them over loopback sockets);
   * ``split``    rank r on visible GPU r % n (needs 2+ GPUs);
   * ``mig``      rank r on MIG instance r % n, through ``CUDA_VISIBLE_DEVICES`` (needs 2+
                  MIG instances).

   None works: it says so with each probe's error and exits 1 (``--force`` runs the jobs
   in ``--config``, default ``shared``, anyway).
2. Runs benchmarks/gpu/ddp_train.py (DDP) and benchmarks/gpu/fsdp_train.py (FSDP2 on a "cuda"
   mesh), the examples moved to the GPU, each undisturbed and with a ``kill-rank`` of rank 1
   at ``--kill-at`` (a spare takes its seat). The session picks NCCL because CUDA is
   available; each rank prints the backend it got into its log, and the check reads it.
3. Checks: every job succeeded; each kill run recovered once; its final state
   (``hotspare.load_final``: every tensor of every rank, and every component's JSON state) is
   bit-identical to the undisturbed run's (numpy's and Python's global generators are left
   out: the scripts never seed them, see tests/e2e/test_frameworks.py); DDP's replicas agree
   with each other in every run.
4. Prints the recovery phases (``hotspare run --json``'s ``recoveries``: detect, decide,
   rebuild, restore, total) and the group rebuild times (each ``rebuilt`` event's
   ``seconds``, from ``hotspare events JOB --json``), and writes all of it as JSON.

``--dry`` runs the same sequence on the CPU with gloo and tiny sizes (no GPU needed; the
test suite runs it: tests/integration/test_gpu_check_dry.py), so this script cannot rot.

What ``rebuilt.seconds`` measures: the session's ``configure()`` of the epoch's backend. On
gloo that is the whole connection set-up; hotspare's NCCL group is created without a
``device_id``, so NCCL builds its communicator lazily, at the first collective (the restore
agreement): that time shows up in the ``restore`` phase, not in ``rebuilt``. The probe's
``first_allreduce_s`` (communicator init + one all-reduce, outside hotspare) is printed next to
it for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from common import BenchCluster, finish, fmt, machine_info, table, write_json

HERE = Path(__file__).resolve().parent
GPU_EXAMPLES = HERE / "gpu"
FRAMEWORKS = {"ddp": "ddp_train.py", "fsdp": "fsdp_train.py"}
CONFIGS = ("shared", "hostid", "split", "mig")
#: the lines of a rank's log worth showing when its job failed
ERROR_LINE = re.compile(r"Error|error:|failed|abandoned|NCCL WARN|Traceback|giving up")
PHASES = ("detect_s", "decide_s", "rebuild_s", "restore_s", "total_s")
#: rng states the examples never seed (they differ between any two runs)
UNSEEDED = {"rng/numpy", "rng/python"}
#: sizes: the GPU run's, and --dry's (tiny: the suite runs it on a shared CPU machine)
GPU = {"steps": 40, "batch_size": 16, "job_timeout": 120.0, "hang_timeout": 30.0, "deadline": 420.0}
DRY = {"steps": 12, "batch_size": 8, "job_timeout": 200.0, "hang_timeout": 15.0, "deadline": 3600.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU and gloo, tiny sizes: no GPU needed (the test suite's run)")
    p.add_argument("--json", help="where to write the results (default benchmarks/out/gpu_check.json; "
                   "--dry: a temp file)")
    p.add_argument("--ranks", type=int, default=2, help="training ranks (one per node), plus one spare node")
    p.add_argument("--steps", type=int, help=f"steps per job (GPU {GPU['steps']}, --dry {DRY['steps']})")
    p.add_argument("--kill-at", type=int, help="the kill runs kill rank 1 at this step (default: steps // 2)")
    p.add_argument("--batch-size", type=int, help="per-rank micro-batch (x2 accumulation)")
    p.add_argument("--frameworks", default="ddp,fsdp", help="comma-separated subset of ddp,fsdp")
    p.add_argument("--config", choices=CONFIGS, help="how the ranks share the GPU (default: the first of "
                   f"{', '.join(CONFIGS)} whose NCCL probe works)")
    p.add_argument("--force", action="store_true", help="run the jobs even when no NCCL probe worked")
    p.add_argument("--no-zygote", action="store_true", help="start every worker as its own process "
                   "(HOTSPARE_ZYGOTE=off) instead of forking it from a zygote")
    p.add_argument("--probe-timeout", type=float, default=90.0, help="seconds for one NCCL probe")
    p.add_argument("--job-timeout", type=float, help="give up on one job after this many seconds")
    p.add_argument("--hang-timeout", type=float, help="the jobs' spec hang_timeout")
    p.add_argument("--deadline", type=float, help="start no job that could end after this many seconds "
                   "from the start (the whole check must fit in 8 minutes)")
    p.add_argument("--workdir", help="keep etcd data, specs and every log here (default: a temp dir, kept "
                   "only when something failed)")
    a = p.parse_args(argv)
    sizes = DRY if a.dry else GPU
    for k, v in sizes.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.kill_at is None:
        a.kill_at = a.steps // 2
    a.frameworks = [f.strip() for f in a.frameworks.split(",") if f.strip()]
    if not a.frameworks or any(f not in FRAMEWORKS for f in a.frameworks):
        p.error(f"--frameworks: choose from {list(FRAMEWORKS)}")
    if a.ranks < 2:
        p.error("--ranks must be >= 2 (rank 1 is killed)")
    if not 0 < a.kill_at < a.steps:
        p.error("--kill-at must be inside (0, steps)")
    if a.dry and a.config:
        p.error("--config is for the GPU run; --dry always runs on the CPU with gloo")
    if a.json is None:
        if a.dry:
            fd, a.json = tempfile.mkstemp(prefix="hotspare-gpu-check-dry-", suffix=".json")
            os.close(fd)
        else:
            a.json = str(HERE / "out" / "gpu_check.json")
    return a


# -- the machine's GPUs and NCCL -----------------------------------------------------------------
def gpu_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - a CPU build has none
        info["nccl"] = f"unavailable ({type(e).__name__})"
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi_L"] = r.stdout.strip().splitlines()
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,mig.mode.current",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["gpus"] = r.stdout.strip().splitlines()
    else:
        info["nvidia_smi_L"] = []
    info["device_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info["mig_devices"] = re.findall(r"\(UUID: (MIG-[^)]+)\)", "\n".join(info["nvidia_smi_L"]))
    return info


PROBE_WORKER = r"""
import json, os, sys, time, datetime
import torch, torch.distributed as dist
rank, world, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = {"rank": rank}
try:
    t0 = time.time()
    torch.cuda.set_device(int(os.environ.get("PROBE_DEVICE_INDEX", "0")))
    out["device"] = torch.cuda.get_device_name()
    store = dist.FileStore(path, world)
    opts = dist.ProcessGroupNCCL.Options()   # as hotspare's ReconfigurableProcessGroup.configure
    opts.is_high_priority_stream = False
    pg = dist.ProcessGroupNCCL(store, rank, world, opts)
    out["construct_s"] = round(time.time() - t0, 4)
    t = torch.full((1 << 16,), float(rank + 1), device="cuda")
    t1 = time.time()
    pg.allreduce([t]).wait()
    torch.cuda.synchronize()
    out["first_allreduce_s"] = round(time.time() - t1, 4)
    want = world * (world + 1) / 2
    out["ok"] = bool((t == want).all().item())
    if not out["ok"]:
        out["error"] = f"all-reduce gave {t[0].item()} (want {want})"
    try:
        pg.abort()
    except Exception:
        pass
except BaseException as e:
    out["ok"] = False
    out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
print("PROBE " + json.dumps(out), flush=True)
sys.stdout.flush()
os._exit(0)
"""


def config_env(name: str, info: dict[str, Any], ranks: int) -> tuple[dict[str, str], list[str] | None, str]:
    """(the jobs' extra environment, per-rank device list or None, a sentence) for a configuration;
    ({}, None, why) when the machine cannot have it."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0] or "0"
    base = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS: the runs must match bit for bit
    if name == "shared":
        return ({**base, "CUDA_VISIBLE_DEVICES": first}, None,
                f"all {ranks} ranks and the spare on one GPU (CUDA_VISIBLE_DEVICES={first})")
    if name == "hostid":
        return ({**base, "CUDA_VISIBLE_DEVICES": first, "HOTSPARE_GPU_CHECK_HOSTID": "1", "NCCL_IB_DISABLE": "1",
                 "NCCL_SOCKET_IFNAME": "lo"}, None,
                f"all {ranks} ranks and the spare on one GPU (CUDA_VISIBLE_DEVICES={first}), each rank with its "
                "own NCCL_HOSTID: NCCL connects them over loopback sockets as if on different hosts")
    if name == "split":
        n = info["device_count"]
        if n < 2:
            return {}, None, f"{n} visible GPU(s): split needs 2 or more"
        devs = [str(i) for i in range(min(n, ranks))]
        return ({**base, "HOTSPARE_GPU_CHECK_DEVICES": ",".join(devs)}, devs,
                f"rank r on visible GPU r % {len(devs)} (torch.cuda.set_device); the spare takes the dead rank's")
    if name == "mig":
        migs = info["mig_devices"]
        if len(migs) < 2:
            return {}, None, f"{len(migs)} MIG instance(s): mig needs 2 or more"
        devs = migs[:ranks]
        return ({**base, "HOTSPARE_GPU_CHECK_DEVICES": ",".join(devs), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}, devs,
                f"rank r on MIG instance r % {len(devs)} (its own CUDA_VISIBLE_DEVICES)")
    raise ValueError(name)


def probe(name: str, env: dict[str, str], devices: list[str] | None, timeout: float, work: Path) -> dict[str, Any]:
    """Two processes, one NCCL all-reduce, the environment the jobs of ``name`` get."""
    d = Path(tempfile.mkdtemp(prefix=f"probe-{name}-", dir=work))
    procs = []
    t0 = time.monotonic()
    for r in range(2):
        e = {**os.environ, **env, "NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1"}
        e.pop("HOTSPARE_GPU_CHECK_DEVICES", None)
        if env.get("HOTSPARE_GPU_CHECK_HOSTID"):
            e["NCCL_HOSTID"] = f"hotspare-gpu-check-probe{r}"
        if devices:
            mine = devices[r % len(devices)]
            if mine.isdigit():
                e["PROBE_DEVICE_INDEX"] = mine
            else:
                e["CUDA_VISIBLE_DEVICES"] = mine
        log = open(d / f"rank{r}.log", "wb")
        procs.append((subprocess.Popen([sys.executable, "-c", PROBE_WORKER, str(r), "2", str(d / "store")],
                                       env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    results: list[dict[str, Any]] = []
    timed_out = False
    for p, log in procs:
        try:
            p.wait(max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, 9)
            p.wait()
        log.close()
    rec: dict[str, Any] = {"config": name, "seconds": round(time.monotonic() - t0, 2)}
    warns = []
    for r in range(2):
        text = (d / f"rank{r}.log").read_text(errors="replace")
        got = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("PROBE ")]
        results.append(got[-1] if got else {"rank": r, "ok": False, "error": "no result" + (
            f" within {timeout:.0f}s (hang?)" if timed_out else "") + ": " + " | ".join(text.strip().splitlines()[-3:])})
        warns += [ln.strip() for ln in text.splitlines() if "NCCL WARN" in ln][:3]
    rec["ok"] = all(x.get("ok") for x in results)
    rec["ranks"] = results
    if warns:
        rec["nccl_warnings"] = warns
    if rec["ok"]:
        rec["first_allreduce_s"] = max(x.get("first_allreduce_s", 0) for x in results)
    else:
        rec["error"] = "; ".join(f"rank {x['rank']}: {x.get('error')}" for x in results if not x.get("ok"))
    shutil.rmtree(d, ignore_errors=True)
    return rec


def choose_config(a: argparse.Namespace, info: dict[str, Any], work: Path) -> dict[str, Any]:
    """The configuration the jobs run in, and every probe tried (``ok``: a probe worked)."""
    order = [a.config] if a.config else list(CONFIGS)
    probes: list[dict[str, Any]] = []
    chosen = None
    for name in order:
        env, devices, what = config_env(name, info, a.ranks)
        if not env:
            probes.append({"config": name, "ok": False, "skipped": what})
            print(f"  probe {name:<7} skipped: {what}", flush=True)
            continue
        rec = probe(name, env, devices, a.probe_timeout, work)
        rec["description"] = what
        probes.append(rec)
        print(f"  probe {name:<7} {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']:.1f}s"
              + (f" (communicator + first all-reduce {rec['first_allreduce_s']:.3f}s)" if rec["ok"]
                 else f": {rec['error']}"), flush=True)
        for w in rec.get("nccl_warnings", []):
            print(f"      {w}", flush=True)
        if rec["ok"]:
            chosen = (name, env, devices, what)
            break
    ok = chosen is not None
    if chosen is None and a.force:
        name = a.config or "shared"
        env, devices, what = config_env(name, info, a.ranks)
        chosen = (name, env, devices, what + " (--force: no NCCL probe worked)")
    out: dict[str, Any] = {"ok": ok, "probes": probes}
    if chosen is not None:
        out.update(name=chosen[0], env=chosen[1], devices=chosen[2], description=chosen[3])
    return out


# -- the jobs ------------------------------------------------------------------------------------
def job_spec(a: argparse.Namespace, fw: str, name: str, env: dict[str, str], kill: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "entrypoint": f"{GPU_EXAMPLES / FRAMEWORKS[fw]}:train",
        "ranks": a.ranks,
        "spares": 1,
        "ranks_per_node": 1,
        "steps": a.steps,
        "lease_ttl": 2.0 if a.dry else 3.0,
        "hang_timeout": a.hang_timeout,
        "on_no_spare": "wait",
        "args": {"batch_size": a.batch_size, "accum": 2, "device": "cpu" if a.dry else "cuda"},
    }
    if env:
        spec["env"] = env
    if kill:
        spec["chaos"] = [{"at_step": a.kill_at, "action": "kill-rank", "rank": 1}]
    return spec


def run_job(cluster: BenchCluster, a: argparse.Namespace, fw: str, name: str, env: dict[str, str],
            kill: bool) -> dict[str, Any]:
    res = cluster.run_timed(job_spec(a, fw, name, env, kill), timeout=a.job_timeout)
    s, events = res["summary"] or {}, res["events"]
    out_dir = cluster.output_dir(name)
    rec: dict[str, Any] = {"job": name, "framework": fw, "kill_rank": kill, "state": s.get("state"),
                           "wall_s": round(res["wall_s"], 2), "steps_done": s.get("steps_done"),
                           "output_dir": str(out_dir), "recoveries": s.get("recoveries") or []}
    for k in ("message", "error"):
        if s.get(k):
            rec[k] = s[k]
    rec["rebuilt"] = [{k: e["data"].get(k) for k in ("epoch", "rank", "seconds", "node")}
                      for e in events if e["kind"] == "rebuilt"]
    rec["restored"] = [{k: e["data"].get(k) for k in ("epoch", "rank", "restore_step", "source", "seconds")}
                       for e in events if e["kind"] == "restored"]
    backends = set()
    for log in sorted((out_dir / "logs").glob("rank*.log")):
        for ln in log.read_text(errors="replace").splitlines():
            m = re.search(r"gpu_check: rank (\d+) trains on ([^\s,(]+).*backend (\w+)", ln)
            if m:
                backends.add((m.group(2), m.group(3)))
    rec["device_backend"] = sorted(f"{d} {b}" for d, b in backends)
    want = "gloo" if a.dry else "nccl"
    problems = []
    if not res["summary"]:
        tail = [ln for ln in res["log_tail"].strip().splitlines() if ln.strip()]
        problems.append("no JSON summary from `hotspare run`" + (f": {tail[-1].strip()[:300]}" if tail else ""))
    elif s.get("state") != "succeeded":
        problems.append(f"job {s.get('state')}" + (f": {s['message']}" if s.get("message") else "")
                        + (f" -- {s['error'].strip().splitlines()[-1]}" if s.get("error") else ""))
    if backends and {b for _, b in backends} != {want}:
        problems.append(f"ranks ran with backend(s) {sorted({b for _, b in backends})}, expected {want}")
    if not backends and s.get("state") == "succeeded":
        problems.append("no rank log says which device and backend it trained on")
    n = len(rec["recoveries"])
    if kill and n != 1:
        problems.append(f"{n} recoveries (expected 1)")
    if not kill and n:
        problems.append(f"{n} recoveries in an undisturbed run")
    rec["ok"] = not problems
    if problems:
        rec["problems"] = problems
        rec["log_tail"] = res["log_tail"]
        logs = {p.name: p.read_text(errors="replace") for p in sorted((out_dir / "logs").glob("*.log"))
                if p.name.startswith(("rank", "agent"))}
        rec["rank_log_tails"] = {k: v[-2500:] for k, v in logs.items()}
        rec["first_errors"] = [f"{k}: {ln.strip()[:300]}" for k, v in logs.items() if k.startswith("rank")
                               for ln in v.splitlines() if ERROR_LINE.search(ln)][:6]
    return rec


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``other``'s final state against ``ref``'s, bit for bit (load_final)."""
    import torch

    from hotspare.recovery import load_final

    try:
        a, b = load_final(ref["output_dir"]), load_final(other["output_dir"])
    except Exception as e:  # noqa: BLE001 - reported
        return {"identical": False, "why": f"load_final raised {type(e).__name__}: {e}"}
    if a.manifest["world_size"] != b.manifest["world_size"] or set(a.ranks) != set(b.ranks):
        return {"identical": False, "why": f"world {a.manifest['world_size']} vs {b.manifest['world_size']}"}
    diff, compared = [], 0
    for r, tensors in a.ranks.items():
        if set(tensors) != set(b.ranks[r]):
            return {"identical": False, "why": f"rank {r}: different tensor names"}
        for k, t in tensors.items():
            if k in UNSEEDED:
                continue
            compared += 1
            if not torch.equal(t, b.ranks[r][k]):
                diff.append(f"rank{r}:{k}")
        if a.meta[r] != b.meta[r]:
            diff.append(f"rank{r}:JSON state")
    out: dict[str, Any] = {"identical": not diff, "tensors_compared": compared}
    if diff:
        out["why"] = f"{len(diff)} differ, e.g. {diff[:4]}"
    return out


def replicas_agree(rec: dict[str, Any]) -> dict[str, Any]:
    """DDP: every rank's parameters and optimizer state equal rank 0's (a collective that
    returned before it finished would make them drift apart)."""
    import torch

    from hotspare.recovery import load_final

    try:
        f = load_final(rec["output_dir"])
    except Exception as e:  # noqa: BLE001 - reported
        return {"agree": False, "why": f"load_final raised {type(e).__name__}: {e}"}
    keys = [k for k in f.ranks[0] if k.startswith(("model.", "optimizer/"))]
    bad = [f"rank{r}:{k}" for r in f.ranks if r for k in keys if not torch.equal(f.ranks[0][k], f.ranks[r][k])]
    return {"agree": not bad, "tensors": len(keys)} | ({"why": f"{len(bad)} differ, e.g. {bad[:4]}"} if bad else {})


# -- report --------------------------------------------------------------------------------------
def rebuilt_summary(rec: dict[str, Any]) -> dict[str, Any]:
    """The slowest rank's ``rebuilt.seconds`` at the first epoch and at the recovery's epochs."""
    first = [x["seconds"] for x in rec["rebuilt"] if x["epoch"] == 1 and x["seconds"] is not None]
    later = [x["seconds"] for x in rec["rebuilt"] if (x["epoch"] or 0) > 1 and x["seconds"] is not None]
    return {"epoch1_max_s": round(max(first), 4) if first else None,
            "recovery_max_s": round(max(later), 4) if later else None}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    info = machine_info()
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: cannot import torch: {e}", file=sys.stderr)
        return 2
    gi = gpu_info()
    info["gpu"] = gi
    mode = "dry (CPU, gloo)" if a.dry else "GPU (NCCL)"
    print(f"gpu_check {mode}: {a.ranks} ranks + 1 spare, {a.steps} steps, kill-rank of rank 1 at step {a.kill_at}; "
          f"torch {torch.__version__} (CUDA {gi['torch_cuda']}, NCCL {gi['nccl']}), {info['cpu_count']} CPUs", flush=True)
    for ln in gi.get("gpus", []):
        print(f"  GPU: {ln}", flush=True)
    problems: list[str] = []
    result: dict[str, Any] = {"benchmark": "gpu_check", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dry": a.dry,
                              "config": {"ranks": a.ranks, "spares": 1, "steps": a.steps, "kill_at": a.kill_at,
                                         "kill_rank": 1, "batch_size": a.batch_size, "accum": 2,
                                         "frameworks": a.frameworks, "job_timeout_s": a.job_timeout,
                                         "hang_timeout_s": a.hang_timeout, "zygote": not a.no_zygote},
                              "machine": info}
    if a.no_zygote:
        os.environ["HOTSPARE_ZYGOTE"] = "off"
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="hotspare-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, dict[str, Any]] = {}
    checks: dict[str, Any] = {}
    if a.dry:
        if gi["cuda_available"]:
            problems.append("--dry: CUDA is visible (run it through gpu_check.sh, which hides the GPUs)")
        setup = {"ok": True, "name": "dry", "env": {}, "devices": None,
                 "description": f"CPU, gloo: {a.ranks} ranks + 1 spare, device='cpu'"}
    elif not gi["cuda_available"]:
        setup = {"ok": False, "probes": []}
        problems.append(f"torch {torch.__version__} here has no usable CUDA (torch.version.cuda={gi['torch_cuda']}): "
                        "run it with the machine's CUDA torch (gpu_check.sh finds it), or --dry for the CPU")
    else:
        print("choosing how the ranks share the GPU (a 2-process NCCL all-reduce per configuration):", flush=True)
        setup = choose_config(a, gi, work)
        if not setup["ok"]:
            problems.append("no NCCL configuration worked on this machine: " + "; ".join(
                f"{p['config']}: {p.get('error') or p.get('skipped')}" for p in setup["probes"])
                + ("" if a.force else " (--force runs the jobs anyway)"))
    result["gpu_config"] = setup
    if "name" in setup:
        print(f"configuration: {setup['name']}: {setup['description']}", flush=True)
        if setup.get("env"):
            result["config"]["job_env"] = setup["env"]
        if setup.get("env", {}).get("PYTORCH_NVML_BASED_CUDA_CHECK"):
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # the zygote's environment must match the jobs'
        cluster = None
        tag = "gc-" + secrets.token_hex(2)
        try:
            cluster = BenchCluster(work / "cluster", keep=True)
            for fw in a.frameworks:
                for kill in (False, True):
                    key = f"{fw}_{'kill' if kill else 'ref'}"
                    left = (a.deadline - (time.monotonic() - t_start))
                    if kill and not jobs.get(f"{fw}_ref", {}).get("ok"):
                        jobs[key] = {"ok": False, "skipped": True, "after_failed_ref": True,
                                     "problems": [f"skipped: {fw}_ref failed"]}
                    elif left < a.job_timeout + 30:
                        jobs[key] = {"ok": False, "skipped": True,
                                     "problems": [f"skipped: {left:.0f}s left of the {a.deadline:.0f}s deadline"]}
                    else:
                        print(f"  {key:<10} running ...", flush=True)
                        try:
                            jobs[key] = run_job(cluster, a, fw, f"{tag}-{fw}-{'kill' if kill else 'ref'}",
                                                setup.get("env") or {}, kill)
                        except Exception as e:  # noqa: BLE001 - one broken job must not hide the others
                            jobs[key] = {"ok": False, "problems": [f"raised {type(e).__name__}: {e}"],
                                         "log_tail": traceback.format_exc()}
                    r = jobs[key]
                    if r.get("skipped"):
                        print(f"  {key:<10} {r['problems'][0]}", flush=True)
                        continue
                    rb = rebuilt_summary(r) if "rebuilt" in r else {}
                    print(f"  {key:<10} {r.get('state')} in {fmt(r.get('wall_s'), 1)}s, "
                          f"{r.get('steps_done')}/{a.steps} steps, {', '.join(r.get('device_backend') or ['?'])}; "
                          f"group build {fmt(rb.get('epoch1_max_s'))}s"
                          + (f", rebuild after the kill {fmt(rb.get('recovery_max_s'))}s" if kill else "")
                          + ("" if r["ok"] else "  PROBLEM: " + "; ".join(r["problems"])), flush=True)
                    for ln in r.get("first_errors", []):
                        print(f"      {ln}", flush=True)
                ref, kil = jobs.get(f"{fw}_ref", {}), jobs.get(f"{fw}_kill", {})
                c: dict[str, Any] = {}
                if ref.get("state") == "succeeded" and kil.get("state") == "succeeded":
                    c["kill_vs_ref"] = compare(ref, kil)
                    print(f"  {fw}: kill run bit-identical to the undisturbed run: {c['kill_vs_ref']['identical']}"
                          + (f" ({c['kill_vs_ref']['why']})" if c["kill_vs_ref"].get("why") else
                             f" ({c['kill_vs_ref']['tensors_compared']} tensors)"), flush=True)
                    if not c["kill_vs_ref"]["identical"]:
                        problems.append(f"{fw}: the kill run's final state differs from the undisturbed run's: "
                                        f"{c['kill_vs_ref'].get('why')}")
                else:  # the failed run is a problem of its own
                    c["kill_vs_ref"] = {"identical": None, "why": "a run did not succeed"}
                if fw == "ddp":
                    for k in ("ddp_ref", "ddp_kill"):
                        if jobs.get(k, {}).get("state") == "succeeded":
                            c[f"replicas_agree_{k}"] = ra = replicas_agree(jobs[k])
                            if not ra["agree"]:
                                problems.append(f"{k}: DDP replicas differ between ranks: {ra.get('why')}")
                            print(f"  {k}: DDP replicas equal on every rank: {ra['agree']}", flush=True)
                checks[fw] = c
        except Exception as e:  # noqa: BLE001 - the cluster itself (etcd, controller)
            problems.append(f"the check raised {type(e).__name__}: {e}")
            result["traceback"] = traceback.format_exc()
        finally:
            if cluster is not None:
                cluster.close()
        for key, r in jobs.items():
            if not r.get("after_failed_ref"):
                problems += [f"{key}: {pr}" for pr in r.get("problems", [])]
    result["jobs"] = jobs
    result["checks"] = checks
    # the headline numbers
    recs = {k: r["recoveries"][0] for k, r in jobs.items() if r.get("recoveries")}
    result["recovery_s"] = {k: {p: v.get(p) for p in PHASES} for k, v in recs.items()}
    result["rebuilt_s"] = {k: rebuilt_summary(r) for k, r in jobs.items() if "rebuilt" in r}
    ok_probe = next((p for p in setup.get("probes", []) if p.get("ok")), None)
    result["nccl_probe_first_allreduce_s"] = ok_probe.get("first_allreduce_s") if ok_probe else None
    result["definitions"] = {
        "recovery_s": "hotspare run --json 'recoveries' of the kill run: failure -> seen (detect), -> new world "
                      "written (decide), -> last rank joined the new group (rebuild), -> last rank restored "
                      "(restore), -> every rank completed a step in the new world (total)",
        "rebuilt_s": "each 'rebuilt' event's 'seconds' (hotspare events JOB --json): the session's configure() of "
                     "the epoch's backend, max over ranks, at epoch 1 and at the recovery's epoch(s). NCCL builds "
                     "its communicator lazily at the first collective (no device_id given), i.e. in the restore "
                     "phase; nccl_probe_first_allreduce_s is communicator init + one all-reduce outside hotspare",
        "bit_identical": "load_final of the kill run vs the undisturbed run: every tensor of every rank (but "
                         "rng/numpy, rng/python: never seeded by the scripts) and every component's JSON state",
    }
    if recs:
        print("\nrecovery phases (seconds, the kill runs):")
        print(table(["job", *[p[:-2] for p in PHASES]], [[k, *[fmt(v.get(p)) for p in PHASES]]
                                                         for k, v in recs.items()]))
    built = {k: v for k, v in result["rebuilt_s"].items() if v["epoch1_max_s"] is not None}
    if built:
        print("\nprocess-group build, slowest rank (rebuilt.seconds):")
        print(table(["job", "epoch 1", "after kill"], [[k, fmt(v["epoch1_max_s"], 4), fmt(v["recovery_max_s"], 4)]
                                                         for k, v in built.items()]))
    if result["nccl_probe_first_allreduce_s"] is not None:
        print(f"NCCL probe, communicator init + first all-reduce (outside hotspare): "
              f"{result['nccl_probe_first_allreduce_s']:.3f}s")
    result["ok"] = not problems
    result["problems"] = problems
    result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    kept = bool(a.workdir) or bool(problems and jobs)
    if kept:
        result["workdir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    path = write_json(a.json, result)
    summary = "ok" if result["ok"] else f"{len(problems)} problem(s)"
    print(f"\ngpu_check {mode}: {summary} in {result['elapsed_s']:.0f}s; wrote {path}"
          + (f"; logs kept in {work}" if kept else ""), flush=True)
    return finish("gpu_check", problems)


if __name__ == "__main__":
    sys.exit(main())
