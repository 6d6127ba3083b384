"""What hotspare's snapshots cost a training step, measured in one process without etcd.

(a) step-time ratio: the demo workload (examples/gpt.py ``build``) trained with the exact
    per-step snapshot work a Session does -- a ``SnapshotEngine`` over shared memory with
    the model / optimizer / scheduler / data / RNG providers, ``engine.wait()`` in the
    optimizer's step pre-hook and ``engine.capture(step)`` after every step -- versus the
    same loop without the engine. With ``--replication process`` (the default, matching a
    default spec: ``replicas: 1``, ``replicate_every: 10``) an agent stand-in process runs
    the real ``hotspare.agents.replica.Replicator``, pushing every replication point to a buddy
    ``ReplicaServer`` over loopback and confirming it, as a node agent would.
    After one untimed run of the workload, paired trials alternate which mode runs first;
    each run rebuilds the workload from the same seed, warms up, then times ``--steps`` steps. Ratio = median over trials of
    (median step time on / median step time off).
(b) stall vs torch.save: per step, the time the training thread is blocked by snapshots
    (``capture`` wall time + the pre-hook's ``wait``) versus a synchronous ``torch.save`` of
    the same state (model, optimizer, scheduler, data position, RNG states) to a file in
    /dev/shm, timed in a third loop of the same trial. Ratio of medians over all steps.

    .venv/bin/python benchmarks/overhead.py --trials 5
    .venv/bin/python benchmarks/overhead.py --smoke   # both replication modes, tiny and short: does it work?
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
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from common import (
    base_parser,
    finish,
    fmt,
    import_gpt,
    machine_info,
    parse_args_smoke,
    shm_base,
    table,
    write_json,
)

AIM_RATIO = 1.03
AIM_STALL = 0.05
#: --smoke: both replication modes, one trial of a few steps (replication points included) of a
#: tiny model
SMOKE = {"steps": 10, "warmup": 2, "replication": "both", "replicate_every": 5, "replication_timeout": 30.0,
         "n_layer": 1, "n_embd": 32}
REPLICATION_MODES = {"process": ["process"], "none": ["none"], "both": ["process", "none"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__, "overhead.json", "paired on/off trials")
    p.add_argument("--steps", type=int, default=200, help="timed steps per mode per trial")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before each timed run")
    p.add_argument("--replication", choices=list(REPLICATION_MODES), default="process",
                   help="process: an agent stand-in replicates points to a buddy over loopback; "
                   "none: snapshots only (replicate_every 0); both: the whole benchmark once with each "
                   "(the JSON's top level is process's, by_replication has both)")
    p.add_argument("--replicate-every", type=int, default=10, help="spec replicate_every")
    p.add_argument("--replication-timeout", type=float, default=120.0,
                   help="the engine's wait for a point's replication (a run that waited this long fails)")
    p.add_argument("--slots", type=int, default=2, help="spec snapshot_slots")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    # the demo workload's defaults (configs/demo.yaml passes no args)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--_replicator", metavar="DIR", help=argparse.SUPPRESS)
    a = parse_args_smoke(p, argv, SMOKE)
    if a.trials < 1 or a.steps < 1 or a.warmup < 0 or a.replicate_every < 1:
        p.error("--trials, --steps and --replicate-every must be >= 1, --warmup >= 0")
    return a


# -- the agent stand-in (child process) -------------------------------------------------------
def replicator_main(snap_dir: str) -> int:
    """Serve as this rank's node agent: push points from ``snap_dir`` to a buddy and confirm
    them. Prints the buddy port, runs until stdin closes, then prints what it shipped."""
    from hotspare.agents.node_view import NodeView
    from hotspare.agents.replica import ReplicaServer, ReplicaStore, Replicator
    from hotspare.recovery.bell import AGENT_BELL, Bell

    secret = os.urandom(32)
    buddy_dir = Path(tempfile.mkdtemp(prefix="hotspare-bench-buddy-", dir=shm_base()))
    server = ReplicaServer(ReplicaStore(buddy_dir), secret).start()
    view = NodeView(epoch=1, world_size=1, buddies=(("buddy", "127.0.0.1", server.port),), seats={0: 0})
    rep = Replicator(ReplicaStore(Path(snap_dir)), secret, view=lambda: view).start()
    bell = Bell(Path(snap_dir) / AGENT_BELL)  # rung by the engine at each point, as for a real agent

    def answer() -> None:
        while True:
            if bell.wait(None):
                rep.kick()

    threading.Thread(target=answer, daemon=True).start()
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.read()
    rep.stop()
    server.stop()
    shutil.rmtree(buddy_dir, ignore_errors=True)
    print(json.dumps({"bytes_sent": rep.bytes_sent, "confirmed": rep.confirmed.get(0)}), flush=True)
    return 0


class AgentStandIn:
    def __init__(self, snap_dir: Path) -> None:
        self.err = tempfile.TemporaryFile()  # its stderr, for the problem report
        self.proc = subprocess.Popen([sys.executable, __file__, "--_replicator", str(snap_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the replicator stand-in did not start (exit code {self.proc.returncode}): "
                               f"{self.stderr_tail()}")
        self.port = json.loads(line)["port"]

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-2000:].strip()

    def stop(self) -> dict[str, Any]:
        """Stop it; what it shipped. Raises if it failed."""
        try:
            try:
                out, _ = self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError("the replicator stand-in did not stop within 30s") from None
            if self.proc.returncode != 0:
                raise RuntimeError(f"the replicator stand-in exited with {self.proc.returncode}: "
                                   f"{self.stderr_tail()}")
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if not lines:
                raise RuntimeError("the replicator stand-in reported nothing")
            return json.loads(lines[-1])
        finally:
            self.err.close()


# -- the workload -----------------------------------------------------------------------------
def build_workload(a: argparse.Namespace):
    import numpy as np
    import torch

    torch.use_deterministic_algorithms(True)
    random.seed(1234)
    np.random.seed(1234)
    return import_gpt().build(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, block_size=a.block_size,
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
    from hotspare.recovery.snapshot import SnapshotEngine
    from hotspare.recovery.state import RNGState, provider_for

    model, opt, sched, data = build_workload(a)
    snap_dir = Path(tempfile.mkdtemp(prefix="hotspare-bench-snap-", dir=shm_base()))
    agent = None
    try:
        agent = AgentStandIn(snap_dir) if a.replication == "process" else None
        every = a.replicate_every if agent else 0
        engine = SnapshotEngine(snap_dir, 0, slots=a.slots, replicate_every=every,
                                replication_timeout=a.replication_timeout)
    except BaseException:
        if agent:
            agent.proc.kill()
            agent.proc.wait()
        shutil.rmtree(snap_dir, ignore_errors=True)
        raise
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
        try:
            if agent:
                repl = agent.stop()
        finally:
            shutil.rmtree(snap_dir, ignore_errors=True)
    if agent:
        # a point is written only once the previous one is confirmed: by the end, every point but
        # the newest must be (the newest may still be in flight when the stand-in stops)
        points = [s for s in range(-1, a.warmup + a.steps) if engine.is_candidate(s)]
        need = points[-2] if len(points) > 1 else None
        got = (repl.get("confirmed") or [None])[0]
        if need is not None and (got is None or got < need):
            raise RuntimeError(f"replication: newest confirmed point {got}, expected >= {need}")
        if replication_wait >= a.replication_timeout:
            raise RuntimeError(f"replication: training waited {replication_wait:.0f}s in all for points to be "
                               f"replicated (timeout {a.replication_timeout:g}s per point)")
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


MODE_NAMES = {"off": "snapshots off (baseline)", "on": "snapshots on", "save": "torch.save (baseline)"}


def run_trials(a: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The paired trials of one replication mode; (trials that completed, problems)."""
    tag = f"replication {a.replication}"
    problems = []
    try:
        # one untimed run first, so that whichever mode the first trial times is not also paying
        # for the process's first use of the workload (lazy initialisation, allocator growth)
        run_off(argparse.Namespace(**{**vars(a), "steps": max(1, a.warmup)}))
    except Exception as e:
        problems.append(f"{tag}, untimed first run: {type(e).__name__}: {e}")
        traceback.print_exc()
    trials = []
    for t in range(a.trials):
        order = ("off", "on") if t % 2 == 0 else ("on", "off")
        res: dict[str, Any] = {"trial": t, "order": [*order, "save"]}
        failed = False
        for mode in (*order, "save"):
            try:
                res[mode] = {"off": run_off, "on": run_on, "save": run_save}[mode](a)
            except Exception as e:  # a failed mode must not hide the others' results
                failed = True
                problems.append(f"{tag}, trial {t}, {MODE_NAMES[mode]}: {type(e).__name__}: {e}")
                print(f"  trial {t} {MODE_NAMES[mode]}: FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
        if failed:
            continue
        on_m, off_m = med(res["on"]["step_s"]), med(res["off"]["step_s"])
        res["ratio"] = on_m / off_m
        res["mean_ratio"] = statistics.fmean(res["on"]["step_s"]) / statistics.fmean(res["off"]["step_s"])
        trials.append(res)
        print(f"  trial {t} ({'/'.join(order)}): step on {on_m * 1e3:.3f} ms, off {off_m * 1e3:.3f} ms, "
              f"ratio {res['ratio']:.4f}; stall {med(res['on']['stall_s']) * 1e3:.3f} ms, "
              f"torch.save {med(res['save']['torch_save_s']) * 1e3:.3f} ms", flush=True)
    return trials, problems


def report(a: argparse.Namespace, trials: list[dict[str, Any]], problems: list[str]) -> dict[str, Any]:
    """Print one replication mode's table and aims; its result for the JSON."""
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke": a.smoke,
        "ok": not problems,
        "problems": problems,
        "config": {"trials": a.trials, "steps": a.steps, "warmup": a.warmup, "replication": a.replication,
                   "replicate_every": a.replicate_every if a.replication == "process" else 0,
                   "snapshot_slots": a.slots, "torch_threads": a.threads, "snapshot_dir": str(shm_base()),
                   "workload": {"entrypoint": "examples/gpt.py:build", "n_layer": a.n_layer, "n_embd": a.n_embd,
                                "n_head": a.n_head, "block_size": a.block_size, "batch_size": a.batch_size}},
    }
    if not trials:
        print(f"\nreplication {a.replication}: no trial completed")
        result.update({"step_time_ratio": None, "stall_vs_torch_save": None, "trials": []})
        return result
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
    print(f"replication {a.replication}:")
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

    result.update({
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
        "trials": [
            {"trial": r["trial"], "order": r["order"], "ratio": r["ratio"], "mean_ratio": r["mean_ratio"],
             "off_step_s": rounded(r["off"]["step_s"]), "on_step_s": rounded(r["on"]["step_s"]),
             "on_capture_s": rounded(r["on"]["capture_s"]), "on_hook_wait_s": rounded(r["on"]["hook_wait_s"]),
             "on_replication_wait_s": r["on"]["replication_wait_s"], "replication": r["on"]["replication"],
             "save_step_s": rounded(r["save"]["step_s"]), "save_state_dict_s": rounded(r["save"]["state_dict_s"]),
             "save_torch_save_s": rounded(r["save"]["torch_save_s"])}
            for r in trials
        ],
    })
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a._replicator:
        return replicator_main(a._replicator)
    import torch

    torch.set_num_threads(a.threads)
    info = machine_info()
    modes = REPLICATION_MODES[a.replication]
    print(f"overhead benchmark: {a.trials} paired trial(s) x {a.steps} steps (+{a.warmup} warmup); gpt n_layer "
          f"{a.n_layer} n_embd {a.n_embd} block {a.block_size} batch {a.batch_size}; replication "
          f"{' and '.join(modes)}; {a.threads} torch thread(s); {info['cpu_count']} CPUs, torch {info['torch']}",
          flush=True)
    results = []
    for mode in modes:
        am = argparse.Namespace(**{**vars(a), "replication": mode})
        if len(modes) > 1:
            print(f"replication {mode}:", flush=True)
        trials, problems = run_trials(am)
        results.append(report(am, trials, problems))
    # the top level is the first mode's result (the only one unless --replication both)
    result = dict(results[0])
    problems = [pr for r in results for pr in r["problems"]]
    result.update({"ok": not problems, "problems": problems, "machine": info})
    if len(results) > 1:
        result["by_replication"] = {r["config"]["replication"]: r for r in results}
    path = write_json(a.json, result)
    print(f"\nwrote {path}")
    return finish("overhead", problems)


if __name__ == "__main__":
    sys.exit(main())
