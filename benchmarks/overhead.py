"""What hotspare's snapshots cost a training step, measured in one process without etcd.

(a) step-time ratio: the demo workload (examples/gpt.py ``build``) trained with the exact
    per-step snapshot work a Session does -- a ``SnapshotEngine`` over shared memory with
    the model / optimizer / scheduler / data / RNG providers, ``engine.wait()`` in the
    optimizer's step pre-hook and ``engine.capture(step)`` after every step -- versus the
    same loop without the engine. With ``--replication process`` (the default, matching a
    default spec: ``replicas: 1``, ``replicate_every: 10``) an agent stand-in process runs
    the real ``agents.replica.Replicator``, pushing every replication point to a buddy
    ``ReplicaServer`` over loopback and confirming it, as a node agent would.
    After one untimed run of the workload, paired trials alternate which mode runs first;
    each run rebuilds the workload from the same seed, warms up, then times ``--steps`` steps. Ratio = median over trials of
    (median step time on / median step time off).
(b) stall vs torch.save: per step, the time the training thread is blocked by snapshots
    (``capture`` wall time + the pre-hook's ``wait``) versus a synchronous ``torch.save`` of
    the same state (model, optimizer, scheduler, data position, RNG states) to a file in
    /dev/shm, timed in a third loop of the same trial. Ratio of medians over all steps.

    .venv/bin/python benchmarks/overhead.py --trials 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import base_parser, fmt, machine_info, shm_base, table, write_json

AIM_RATIO = 1.03
AIM_STALL = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__, "overhead.json", "paired on/off trials")
    p.add_argument("--steps", type=int, default=200, help="timed steps per mode per trial")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before each timed run")
    p.add_argument("--replication", choices=["process", "none"], default="process",
                   help="process: an agent stand-in replicates points to a buddy over loopback; "
                   "none: snapshots only (replicate_every 0)")
    p.add_argument("--replicate-every", type=int, default=10, help="spec replicate_every")
    p.add_argument("--slots", type=int, default=2, help="spec snapshot_slots")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    # the demo workload's defaults (configs/demo.yaml passes no args)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--_replicator", metavar="DIR", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trials < 1 or a.steps < 1 or a.warmup < 0:
        p.error("--trials and --steps must be >= 1, --warmup >= 0")
    return a


# -- the agent stand-in (child process) -------------------------------------------------------
def replicator_main(snap_dir: str) -> int:
    """Serve as this rank's node agent: push points from ``snap_dir`` to a buddy and confirm
    them. Prints the buddy port, runs until stdin closes, then prints what it shipped."""
    from agents.node_view import NodeView
    from agents.replica import ReplicaServer, ReplicaStore, Replicator

    secret = os.urandom(32)
    buddy_dir = Path(tempfile.mkdtemp(prefix="hotspare-bench-buddy-", dir=shm_base()))
    server = ReplicaServer(ReplicaStore(buddy_dir), secret).start()
    view = NodeView(epoch=1, world_size=1, buddies=(("buddy", "127.0.0.1", server.port),), seats={0: 0})
    rep = Replicator(ReplicaStore(Path(snap_dir)), secret, view=lambda: view).start()
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.read()
    rep.stop()
    server.stop()
    shutil.rmtree(buddy_dir, ignore_errors=True)
    print(json.dumps({"bytes_sent": rep.bytes_sent, "confirmed": rep.confirmed.get(0)}), flush=True)
    return 0


class AgentStandIn:
    def __init__(self, snap_dir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--_replicator", str(snap_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the replicator stand-in did not start")
        self.port = json.loads(line)["port"]

    def stop(self) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=30)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {}


# -- the workload -----------------------------------------------------------------------------
def build_workload(a: argparse.Namespace):
    import numpy as np
    import torch

    from examples.gpt import build

    torch.use_deterministic_algorithms(True)
    random.seed(1234)
    np.random.seed(1234)
    return build(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, block_size=a.block_size,
                 batch_size=a.batch_size)


def train_step(model, opt, sched, data) -> float:
    import torch

    x, y = data.next_batch()
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=False)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def full_state(model, opt, sched, data) -> dict[str, Any]:
    """What a synchronous checkpoint saves: the same components a Session tracks."""
    import numpy as np
    import torch

    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "data": data.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}


def run_off(a: argparse.Namespace) -> dict[str, Any]:
    model, opt, sched, data = build_workload(a)
    for _ in range(a.warmup):
        train_step(model, opt, sched, data)
    steps = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        train_step(model, opt, sched, data)
        steps.append(time.perf_counter() - t0)
    return {"step_s": steps}


def run_on(a: argparse.Namespace) -> dict[str, Any]:
    from recovery.snapshot import SnapshotEngine
    from recovery.state import RNGState, provider_for

    model, opt, sched, data = build_workload(a)
    snap_dir = Path(tempfile.mkdtemp(prefix="hotspare-bench-snap-", dir=shm_base()))
    agent = AgentStandIn(snap_dir) if a.replication == "process" else None
    every = a.replicate_every if agent else 0
    engine = SnapshotEngine(snap_dir, 0, slots=a.slots, replicate_every=every)
    engine.providers = [("rng", RNGState())]
    for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched), ("data", data)):
        engine.providers += provider_for(name, obj)
    hook_wait = [0.0]

    def pre_hook(*_: object) -> None:
        t0 = time.perf_counter()
        engine.wait()
        hook_wait[0] += time.perf_counter() - t0

    opt.register_step_pre_hook(pre_hook)
    repl: dict[str, Any] = {}
    try:
        engine.capture(-1)  # what a fresh Session does before step 0
        engine.wait()
        for s in range(a.warmup):
            train_step(model, opt, sched, data)
            engine.capture(s)
        steps, capture, wait = [], [], []
        for s in range(a.warmup, a.warmup + a.steps):
            hook_wait[0] = 0.0
            t0 = time.perf_counter()
            train_step(model, opt, sched, data)
            t1 = time.perf_counter()
            engine.capture(s)
            t2 = time.perf_counter()
            steps.append(t2 - t0)
            capture.append(t2 - t1)
            wait.append(hook_wait[0])
        engine.wait()
        state_bytes = sum(t.numel() * t.element_size() for _, p in engine.providers for t in p.tensors().values())
        replication_wait = engine.replication_wait_s
    finally:
        engine.close()
        if agent:
            repl = agent.stop()
        shutil.rmtree(snap_dir, ignore_errors=True)
    return {"step_s": steps, "capture_s": capture, "hook_wait_s": wait,
            "stall_s": [c + w for c, w in zip(capture, wait, strict=True)], "state_bytes": state_bytes,
            "replication_wait_s": replication_wait, "replication": repl}


def run_save(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    model, opt, sched, data = build_workload(a)
    d = Path(tempfile.mkdtemp(prefix="hotspare-bench-ckpt-", dir=shm_base()))
    path = d / "checkpoint.pt"
    try:
        for _ in range(a.warmup):
            train_step(model, opt, sched, data)
            torch.save(full_state(model, opt, sched, data), path)
        steps, collect, save = [], [], []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            train_step(model, opt, sched, data)
            t1 = time.perf_counter()
            state = full_state(model, opt, sched, data)
            t2 = time.perf_counter()
            torch.save(state, path)
            t3 = time.perf_counter()
            steps.append(t3 - t0)
            collect.append(t2 - t1)
            save.append(t3 - t2)
        file_bytes = path.stat().st_size
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"step_s": steps, "state_dict_s": collect, "torch_save_s": save, "file_bytes": file_bytes,
            "dir": str(shm_base())}


# -- report -----------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def rounded(xs: list[float]) -> list[float]:
    return [round(x, 7) for x in xs]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a._replicator:
        return replicator_main(a._replicator)
    import torch

    torch.set_num_threads(a.threads)
    info = machine_info()
    print(f"overhead benchmark: {a.trials} paired trial(s) x {a.steps} steps (+{a.warmup} warmup); gpt n_layer "
          f"{a.n_layer} n_embd {a.n_embd} block {a.block_size} batch {a.batch_size}; replication {a.replication}; "
          f"{a.threads} torch thread(s); {info['cpu_count']} CPUs, torch {info['torch']}", flush=True)

    # one untimed run first, so that whichever mode the first trial times is not also paying
    # for the process's first use of the workload (lazy initialisation, allocator growth)
    run_off(argparse.Namespace(**{**vars(a), "steps": max(1, a.warmup)}))
    trials = []
    for t in range(a.trials):
        order = ("off", "on") if t % 2 == 0 else ("on", "off")
        res: dict[str, Any] = {"trial": t, "order": [*order, "save"]}
        for mode in (*order, "save"):
            res[mode] = {"off": run_off, "on": run_on, "save": run_save}[mode](a)
        on_m, off_m = med(res["on"]["step_s"]), med(res["off"]["step_s"])
        res["ratio"] = on_m / off_m
        res["mean_ratio"] = statistics.fmean(res["on"]["step_s"]) / statistics.fmean(res["off"]["step_s"])
        trials.append(res)
        print(f"  trial {t} ({'/'.join(order)}): step on {on_m * 1e3:.3f} ms, off {off_m * 1e3:.3f} ms, "
              f"ratio {res['ratio']:.4f}; stall {med(res['on']['stall_s']) * 1e3:.3f} ms, "
              f"torch.save {med(res['save']['torch_save_s']) * 1e3:.3f} ms", flush=True)

    on_steps = [x for r in trials for x in r["on"]["step_s"]]
    off_steps = [x for r in trials for x in r["off"]["step_s"]]
    save_steps = [x for r in trials for x in r["save"]["step_s"]]
    stall = [x for r in trials for x in r["on"]["stall_s"]]
    capture = [x for r in trials for x in r["on"]["capture_s"]]
    hook = [x for r in trials for x in r["on"]["hook_wait_s"]]
    tsave = [x for r in trials for x in r["save"]["torch_save_s"]]
    collect = [x for r in trials for x in r["save"]["state_dict_s"]]
    tsave_full = [c + s for c, s in zip(collect, tsave, strict=True)]
    ratio = med([r["ratio"] for r in trials])
    stall_ratio = med(stall) / med(tsave)
    state_mb = trials[0]["on"]["state_bytes"] / 2**20
    file_mb = trials[0]["save"]["file_bytes"] / 2**20

    ms = 1e3
    rows = [
        ["step, snapshots off", fmt(med(off_steps) * ms), fmt(statistics.fmean(off_steps) * ms), fmt(pct(off_steps, .99) * ms)],
        ["step, snapshots on", fmt(med(on_steps) * ms), fmt(statistics.fmean(on_steps) * ms), fmt(pct(on_steps, .99) * ms)],
        ["step + torch.save", fmt(med(save_steps) * ms), fmt(statistics.fmean(save_steps) * ms), fmt(pct(save_steps, .99) * ms)],
        ["stall (capture + hook wait)", fmt(med(stall) * ms), fmt(statistics.fmean(stall) * ms), fmt(pct(stall, .99) * ms)],
        ["  capture", fmt(med(capture) * ms), fmt(statistics.fmean(capture) * ms), fmt(pct(capture, .99) * ms)],
        ["  pre-hook wait", fmt(med(hook) * ms), fmt(statistics.fmean(hook) * ms), fmt(pct(hook, .99) * ms)],
        ["torch.save", fmt(med(tsave) * ms), fmt(statistics.fmean(tsave) * ms), fmt(pct(tsave, .99) * ms)],
        ["state_dict() + torch.save", fmt(med(tsave_full) * ms), fmt(statistics.fmean(tsave_full) * ms),
         fmt(pct(tsave_full, .99) * ms)],
    ]
    print()
    print(table(["per step", "median ms", "mean ms", "p99 ms"], rows))
    print(f"\nstate: {state_mb:.3f} MB of tensors in a snapshot; torch.save file {file_mb:.3f} MB")
    repl = [r["on"]["replication"] for r in trials]
    if a.replication == "process":
        print("replication: " + "; ".join(
            f"trial {r['trial']}: {x.get('bytes_sent', 0) / 2**20:.2f} MB shipped, newest confirmed point "
            f"{x.get('confirmed')}, training waited {r['on']['replication_wait_s'] * 1e3:.1f} ms"
            for r, x in zip(trials, repl, strict=True)))
    ratio_ok, stall_ok = ratio <= AIM_RATIO, stall_ratio <= AIM_STALL
    print(f"\nstep_time_ratio (median over trials of median on / median off): {ratio:.4f}   "
          f"aim <= {AIM_RATIO} -> {'met' if ratio_ok else 'NOT met'}")
    print(f"stall_vs_torch_save (median stall / median torch.save): {stall_ratio:.4f} "
          f"({stall_ratio * 100:.1f}%)   aim <= {AIM_STALL:.0%} -> {'met' if stall_ok else 'NOT met'}")

    result = {
        "benchmark": "overhead",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "step_time_ratio": ratio,
        "stall_vs_torch_save": stall_ratio,
        "stall_vs_state_dict_plus_torch_save": med(stall) / med(tsave_full),
        "step_time_mean_ratio": statistics.fmean(on_steps) / statistics.fmean(off_steps),
        "aims": {"step_time_ratio": {"aim_le": AIM_RATIO, "value": ratio, "met": ratio_ok},
                 "stall_vs_torch_save": {"aim_le": AIM_STALL, "value": stall_ratio, "met": stall_ok}},
        "absolute_s": {
            "step_off_median": med(off_steps), "step_on_median": med(on_steps),
            "step_with_torch_save_median": med(save_steps),
            "stall_median": med(stall), "stall_mean": statistics.fmean(stall), "stall_p99": pct(stall, .99),
            "stall_max": max(stall), "capture_median": med(capture), "hook_wait_median": med(hook),
            "torch_save_median": med(tsave), "state_dict_plus_torch_save_median": med(tsave_full),
        },
        "state_mb": state_mb,
        "torch_save_file_mb": file_mb,
        "config": {"trials": a.trials, "steps": a.steps, "warmup": a.warmup, "replication": a.replication,
                   "replicate_every": a.replicate_every if a.replication == "process" else 0,
                   "snapshot_slots": a.slots, "torch_threads": a.threads, "snapshot_dir": str(shm_base()),
                   "workload": {"entrypoint": "examples/gpt.py:build", "n_layer": a.n_layer, "n_embd": a.n_embd,
                                "n_head": a.n_head, "block_size": a.block_size, "batch_size": a.batch_size}},
        "machine": info,
        "trials": [
            {"trial": r["trial"], "order": r["order"], "ratio": r["ratio"], "mean_ratio": r["mean_ratio"],
             "off_step_s": rounded(r["off"]["step_s"]), "on_step_s": rounded(r["on"]["step_s"]),
             "on_capture_s": rounded(r["on"]["capture_s"]), "on_hook_wait_s": rounded(r["on"]["hook_wait_s"]),
             "on_replication_wait_s": r["on"]["replication_wait_s"], "replication": r["on"]["replication"],
             "save_step_s": rounded(r["save"]["step_s"]), "save_state_dict_s": rounded(r["save"]["state_dict_s"]),
             "save_torch_save_s": rounded(r["save"]["torch_save_s"])}
            for r in trials
        ],
    }
    path = write_json(a.json, result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
