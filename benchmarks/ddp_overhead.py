"""A user's DDP script under torchrun vs under hotspare: steady-state cost and time lost per failure.

The workload is ``examples/ddp_train.py`` (DDP on the session's process group, ``no_sync``
gradient accumulation, AdamW, cosine schedule, clipping, ``session.data_loader``), run
unchanged, with a bigger model so that a step takes tens of milliseconds:
``benchmarks/ddp_workload.py`` (``--width`` x ``--depth`` hidden layers; default 1024 x 2,
about 1.07 M parameters; 64 x 1 is the example's own model). Per trial, six runs of it,
``--ranks`` ranks, ``--steps`` steps, one torch thread per process, gloo on loopback:

* hotspare, no failure     ``hotspare run --no-check`` of ``benchmarks/ddp_workload.py:train``
                           (which runs ``ddp_train.train``), ``--ranks`` ranks on one-rank nodes
                           + 1 hot spare node, a private etcd and controller.
* hotspare, one failure    the same with ``chaos: [{at_step: F, action: kill-rank}]``: rank
                           ``--fail-rank``'s worker SIGKILLs itself at the start of step F.
* torchrun, no failure     ``torchrun --standalone --nproc-per-node N --max-restarts R
                           benchmarks/ddp_torchrun_worker.py``: the example's training step under
                           plain DDP, a rank-local ``torch.save`` checkpoint (model, optimizer,
                           scheduler, data position, RNGs; atomic rename) every ``--K`` steps,
                           resume from the newest complete one.
* torchrun, one failure    the same; the worker of rank ``--fail-rank`` SIGKILLs itself at the
                           start of step F in the first attempt only; torchrun restarts the whole
                           group, which reloads the newest checkpoint and recomputes since it.
* plain                    torchrun with ``--max-restarts 0``, no checkpoints: DDP with no fault
                           tolerance at all (the steady-state reference).
* plain, param-order       plain with DDP's gradient buckets fixed in parameter order before the
                           first step (``--buckets param-order``), as hotspare fixes them at every
                           join: the part of hotspare's overhead that is DDP's lost overlap of
                           all-reduce and backward, measured without hotspare.

The *training span* is defined exactly as in ``benchmarks/lost_time.py`` (read its docstring):
from the moment the last rank is about to run step 0 (hotspare: the newest epoch-1
``restored`` event; torchrun: the newest first-attempt ``start`` record) to the moment every
rank is past the last step (hotspare: the controller's ``succeeded`` event; torchrun: the
newest ``end`` record of the last attempt), all ``time.time()`` on the same host. Everything a
failure costs is inside it; the start-up before step 0 is outside it on both sides. Whole-command
wall times are recorded as a cross-check.

* ``overhead_ratio`` (the steady-state step-time ratio) = hotspare's no-failure span / plain's
  span, per trial, median over trials: what hotspare costs a DDP job when nothing fails (its
  per-step snapshot of parameters and AdamW state, replication points, the control thread,
  the final-state write, the other processes on the machine -- and DDP's gradient buckets in
  parameter order, which hotspare sets at every join so that every rank reduces the same
  layout, see ``hotspare.recovery.frameworks``). ``bucket_order_ratio`` = plain param-order's
  span / plain's: that last part alone. ``torchrun_ckpt_overhead_ratio``: the same for torchrun
  with its checkpoints. The JSON has each no-failure run's span / steps too.
* Time lost per failure = span with the failure - span without, paired per trial, median over
  trials, for hotspare and for torchrun with checkpoints every K steps.

Final state, compared after every trial (``identical`` in each trial's JSON):

* ``hotspare_fail`` vs ``hotspare_nofail`` (required): every tensor of every rank's final
  state (``hotspare.load_final``: DDP parameters, AdamW ``exp_avg``/``exp_avg_sq``/``step``,
  torch's RNG state, ...) bit for bit, and every component's JSON state (scheduler, data
  position, optimizer hyper-parameters); only numpy's and Python's RNG tensors are left out:
  the example never seeds them (as a torchrun script would not), so they start from OS
  entropy in every process and differ between any two runs.
* ``torchrun_fail`` and ``plain`` vs ``torchrun_nofail`` (required): every rank's parameters
  and AdamW state tensors (the worker's ``--final-dir``): torchrun's resume is exact.
* ``plain_param_order`` vs ``hotspare_nofail`` (required): the same parameters and AdamW state
  tensors across the two systems. Both read the same batches (the torchrun worker uses
  hotspare's ``ElasticDataLoader`` stand-alone, the example's ``session.data_loader``) from the
  same initial weights and reduce the same bucket layout.
* ``torchrun_nofail`` vs ``hotspare_nofail`` (required with 2 ranks): the same, but torch's own
  bucket layout (ready order) differs from hotspare's (parameter order). That does not change
  a sum of two ranks' values; with more than two ranks gloo's ring all-reduce adds an element
  up in an order that depends on where its bucket puts it, and the last bits differ, so
  ``--ranks`` > 2 only reports this comparison.

A run that fails -- a baseline included (plain or torchrun), as well as a job that did not
succeed or recovered other than once -- or a required comparison that differs makes the
benchmark print one ``ddp_overhead: FAILED: trial T RUN: problem`` line per problem and exit 1.

    .venv/bin/python benchmarks/ddp_overhead.py --trials 3
    .venv/bin/python benchmarks/ddp_overhead.py --trials 1 --steps 80 --fail-step 45 --K 10   # quick check
    .venv/bin/python benchmarks/ddp_overhead.py --smoke   # all six runs, tiny and short: does it work?
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from common import (
    BenchCluster,
    base_parser,
    finish,
    fmt,
    gpt_job_spec,
    machine_info,
    parse_args_smoke,
    run_torchrun_cmd,
    summarize,
    table,
    write_json,
)
from lost_time import END_NOTE, med, paired

HERE = Path(__file__).resolve()
WORKER = HERE.parent / "ddp_torchrun_worker.py"
WORKLOAD = HERE.parent / "ddp_workload.py"
AIM_RATIO = 0.2  # lost_time.py's aim: hotspare loses at most 1/5 of what torchrun loses per failure (K = 20)
SYSTEMS = ("hotspare_nofail", "hotspare_fail", "torchrun_nofail", "torchrun_fail", "plain", "plain_param_order")
BASELINES = ("torchrun_nofail", "torchrun_fail", "plain", "plain_param_order")
DATASET_SAMPLES = 1024  # ddp_train.make_dataset's default n
#: tensors of hotspare's final state that differ between any two runs (never seeded by the example)
UNSEEDED = {"rng/numpy", "rng/python"}
#: --smoke: all six runs once, 2 ranks, the example's own tiny model, a few steps (a checkpoint
#: before and after the failure), short timeouts
SMOKE = {"ranks": 2, "steps": 12, "fail_step": 7, "K": 3, "width": 64, "depth": 1,
         "hang_timeout": 10.0, "run_timeout": 240.0}


# -- arguments ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__, "ddp_overhead.json", "trials (each: all six runs)")
    p.add_argument("--ranks", type=int, default=2, help="training ranks (hotspare: one per node, plus one spare)")
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    p.add_argument("--fail-step", type=int, default=150, help="the failed rank dies at the start of this step")
    p.add_argument("--fail-rank", type=int, default=1, help="the rank that dies")
    p.add_argument("--K", type=int, default=20, help="torchrun: checkpoint every K steps")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts for the checkpointed runs")
    p.add_argument("--width", type=int, default=1024, help="hidden layer width (ddp_workload.make_model)")
    p.add_argument("--depth", type=int, default=2, help="hidden layers (1 with width 64: the example's model)")
    p.add_argument("--batch-size", type=int, default=16, help="ddp_train.train batch_size (per rank, micro-batch)")
    p.add_argument("--accum", type=int, default=2, help="ddp_train.train accum (micro-batches per step)")
    p.add_argument("--lr", type=float, default=1e-2, help="ddp_train.train lr")
    p.add_argument("--seed", type=int, default=0, help="ddp_train.train seed")
    p.add_argument("--lease-ttl", type=float, default=3.0, help="hotspare spec lease_ttl")
    p.add_argument("--hang-timeout", type=float, default=30.0, help="hotspare spec hang_timeout")
    p.add_argument("--replicas", type=int, help="hotspare spec replicas (default: the spec's default, 1)")
    p.add_argument("--replicate-every", type=int, help="hotspare spec replicate_every (default: the spec's, 10)")
    p.add_argument("--run-timeout", type=float, default=600, help="give up on one run after this many seconds")
    p.add_argument("--runs", default=",".join(SYSTEMS),
                   help="comma-separated subset of the runs per trial (default: all six)")
    p.add_argument("--workdir", help="keep etcd data, specs, logs and records here (default: a temp dir, removed)")
    a = parse_args_smoke(p, argv, SMOKE)
    a.runs = [r.strip().replace("-", "_") for r in a.runs.split(",") if r.strip()]
    bad = [r for r in a.runs if r not in SYSTEMS]
    if bad or not a.runs:
        p.error(f"unknown run(s) {bad}; choose from {list(SYSTEMS)}")
    if a.trials < 1:
        p.error("--trials must be >= 1")
    if a.ranks < 1:
        p.error("--ranks must be >= 1")
    if not 0 < a.fail_step < a.steps:
        p.error("--fail-step must be inside (0, steps)")
    if not 0 <= a.fail_rank < a.ranks:
        p.error("--fail-rank must be < --ranks")
    if a.K < 1:
        p.error("--K must be >= 1")
    if a.width < 1 or a.depth < 1 or a.batch_size < 1 or a.accum < 1:
        p.error("--width, --depth, --batch-size and --accum must be >= 1")
    if a.batch_size * a.accum * a.ranks > DATASET_SAMPLES:
        p.error(f"one step reads batch_size x accum x ranks = {a.batch_size * a.accum * a.ranks} samples, more "
                f"than the example's dataset has ({DATASET_SAMPLES}; the loader drops the last partial step)")
    return a


def train_args(a: argparse.Namespace) -> dict[str, Any]:
    """ddp_workload.train's arguments (the model's size + ddp_train.train's), both sides the same."""
    return {"width": a.width, "depth": a.depth, "batch_size": a.batch_size, "accum": a.accum, "lr": a.lr,
            "seed": a.seed}


def workload_info(a: argparse.Namespace) -> dict[str, Any]:
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))
    import ddp_workload

    n = ddp_workload.n_params(a.width, a.depth)
    # parameters + AdamW exp_avg and exp_avg_sq, float32
    return {"file": "examples/ddp_train.py (model: benchmarks/ddp_workload.py make_model)", **train_args(a),
            "params": n, "params_mb": round(4 * n / 2**20, 2), "params_plus_adam_mb": round(12 * n / 2**20, 2)}


# -- hotspare ----------------------------------------------------------------------------------
def hotspare_spec(a: argparse.Namespace, name: str, fail: bool) -> dict[str, Any]:
    chaos = [{"at_step": a.fail_step, "action": "kill-rank", "rank": a.fail_rank}] if fail else None
    spec = gpt_job_spec(a, name, train_args(a), entrypoint=f"{WORKLOAD}:train", chaos=chaos)
    if a.replicas is not None:
        spec["replicas"] = a.replicas
    if a.replicate_every is not None:
        spec["replicate_every"] = a.replicate_every
    return spec


def run_hotspare(cluster: BenchCluster, a: argparse.Namespace, name: str, fail: bool) -> dict[str, Any]:
    """One hotspare job; its span, wall time and recovery, read as lost_time.py reads them."""
    res = cluster.run_timed(hotspare_spec(a, name, fail), timeout=a.run_timeout)
    s, events = res["summary"], res["events"]
    rec: dict[str, Any] = {"job": name, "wall_s": round(res["wall_s"], 3), "output_dir": str(cluster.output_dir(name)),
                           "state": s.get("state") if s else None}

    def times(kind: str, epoch: int | None = None) -> list[float]:
        return [e["time"] for e in events if e["kind"] == kind and (epoch is None or e["data"].get("epoch") == epoch)]

    started, placed, succeeded = times("restored", 1), times("placed"), times("succeeded")
    problems = []
    if s is None:
        problems.append("no JSON summary from `hotspare run`")
    elif s.get("state") != "succeeded":
        problems.append(f"job {s.get('state')}" + (f": {s['error']}" if s.get("error") else ""))
    if len(started) < a.ranks or not succeeded:
        problems.append(f"timeline has {len(started)} epoch-1 'restored' events (expected >= {a.ranks}) and "
                        f"{len(succeeded)} 'succeeded'")
    else:
        rec["span_s"] = round(max(succeeded) - max(started), 3)
        if placed:
            rec["placed_to_succeeded_s"] = round(max(succeeded) - min(placed), 3)
    if s is not None and "loss" in (s.get("metrics") or {}):
        rec["final_loss"] = s["metrics"]["loss"]
    recs = (s or {}).get("recoveries") or []
    rec["recoveries"] = recs
    if fail:
        if len(recs) != 1:
            problems.append(f"{len(recs)} recoveries (expected 1)")
        else:
            rec["recovery_total_s"] = recs[0].get("total_s")
        resumed = [e["data"].get("restore_step") for e in events if e["kind"] == "restored"
                   and (e["data"].get("epoch") or 0) > 1]
        if resumed:
            rec["resumed_after_step"] = min(resumed)
            rec["recomputed_steps"] = a.fail_step - 1 - min(resumed)
    elif recs:
        problems.append(f"{len(recs)} recoveries in the no-failure run")
    rec["ok"] = not problems
    if problems:
        rec["problems"] = problems
        rec["log_tail"] = res["log_tail"]
    return rec


# -- torchrun ----------------------------------------------------------------------------------
def run_torchrun(a: argparse.Namespace, workdir: Path, name: str, *, ckpt: bool, fail: bool,
                 max_restarts: int, buckets: str = "ready-order") -> dict[str, Any]:
    """One torchrun command of ddp_torchrun_worker.py; its span from the workers' records."""
    d = workdir / name
    shutil.rmtree(d, ignore_errors=True)
    out = d / "records"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ranks),
           "--max-restarts", str(max_restarts), str(WORKER), "--steps", str(a.steps), "--out", str(out),
           "--final-dir", str(d / "final"), "--buckets", buckets]
    if ckpt:
        cmd += ["--ckpt-dir", str(d / "ckpt"), "--K", str(a.K)]
    if fail:
        cmd += ["--fail-step", str(a.fail_step), "--fail-rank", str(a.fail_rank)]
    for k, v in train_args(a).items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return run_torchrun_cmd(cmd, d, {"run": name, "checkpoint_every": a.K if ckpt else None,
                                     "max_restarts": max_restarts, "buckets": buckets},
                            ranks=a.ranks, fail=fail, fail_step=a.fail_step, run_timeout=a.run_timeout,
                            keep_ckpt=bool(a.workdir))


# -- final state -------------------------------------------------------------------------------
def final_state(rec: dict[str, Any], ranks: int, full: bool) -> tuple[dict[int, dict[str, Any]], dict | None]:
    """A finished run's final state per rank as ``{name: tensor}`` and hotspare's JSON state
    (None for torchrun). ``full`` (hotspare only): every tensor but the unseeded RNGs, named as
    in ``load_final``; else the parameters (``param/<name>``, DDP's ``module.`` prefix off) and
    the optimizer's state tensors (``optim/<param index>.<key>``), named alike on both sides.
    Raises OSError/KeyError/ValueError/RuntimeError when the state is missing or unreadable."""
    import torch

    if "output_dir" in rec:
        from hotspare.recovery.final import load_final

        hs = load_final(rec["output_dir"])
        if full:  # the unseeded generators' JSON halves (numpy's position, Python's gauss) go too
            return ({r: {k: v for k, v in hs.ranks[r].items() if k not in UNSEEDED} for r in range(ranks)},
                    {r: {**hs.meta[r], "rng": {k: v for k, v in (hs.meta[r].get("rng") or {}).items()
                                               if f"rng/{k}" not in UNSEEDED}} for r in range(ranks)})
        out: dict[int, dict[str, Any]] = {}
        for r in range(ranks):
            t: dict[str, Any] = {}
            for k, v in hs.ranks[r].items():
                if k.startswith("model.params/module."):
                    t["param/" + k[len("model.params/module."):]] = v
                elif k.startswith("optimizer/state.#"):  # optimizer/state.#<i>.<key>
                    i, key = k[len("optimizer/state.#"):].split(".", 1)
                    t[f"optim/{i}.{key}"] = v
            out[r] = t
    else:
        d = Path(rec["final_dir"])
        out = {}
        for r in range(ranks):
            st = torch.load(d / f"rank{r}.pt", weights_only=True)
            t = {f"param/{k}": v for k, v in st["model"].items()}
            for i, s in st["optimizer"]["state"].items():
                t.update({f"optim/{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
            out[r] = t
    for r, t in out.items():  # a comparison of nothing would pass: both kinds must be there
        if not any(k.startswith("param/") for k in t) or not any(k.startswith("optim/") for k in t):
            raise KeyError(f"rank {r}: no parameters or no optimizer state in the final state")
    return out, None


def compare(x: tuple[dict[int, dict[str, Any]], dict | None], y: tuple[dict[int, dict[str, Any]], dict | None]
            ) -> tuple[bool, str]:
    """(identical, what differs): the same ranks, tensor names and bits (and JSON state)."""
    import torch

    (tx, mx), (ty, my) = x, y
    if set(tx) != set(ty):
        return False, f"ranks {sorted(tx)} vs {sorted(ty)}"
    for r in tx:
        if set(tx[r]) != set(ty[r]):
            return False, f"rank {r}: tensor names differ ({sorted(set(tx[r]) ^ set(ty[r]))[:4]})"
        if not tx[r]:
            return False, f"rank {r}: no tensors"
        diff = [k for k in tx[r] if not torch.equal(tx[r][k], ty[r][k])]
        if diff:
            return False, f"rank {r}: {len(diff)} of {len(tx[r])} tensors differ, e.g. {diff[:3]}"
        if mx is not None and my is not None and mx[r] != my[r]:
            keys = sorted(k for k in set(mx[r]) | set(my[r]) if mx[r].get(k) != my[r].get(k))
            return False, f"rank {r}: JSON state differs ({keys})"
    return True, ""


#: (run, reference, what is compared, required whatever --ranks)
COMPARISONS = (
    ("hotspare_fail", "hotspare_nofail", "full", True),
    ("torchrun_fail", "torchrun_nofail", "params+optim", True),
    ("plain", "torchrun_nofail", "params+optim", True),
    ("plain_param_order", "hotspare_nofail", "params+optim", True),
    ("torchrun_nofail", "hotspare_nofail", "params+optim", False),  # required with 2 ranks (module docstring)
)


def check_identical(trial: dict[str, Any], ranks: int) -> dict[str, dict[str, Any]]:
    """Each comparison of COMPARISONS whose two runs are ok: {"<run> vs <reference>":
    {"compared", "identical" (None: could not be read), "required", "detail"}}."""
    out: dict[str, dict[str, Any]] = {}
    for run, ref, what, always in COMPARISONS:
        if not (trial.get(run, {}).get("ok") and trial.get(ref, {}).get("ok")):
            continue
        res: dict[str, Any] = {"compared": what, "required": always or ranks <= 2}
        try:
            full = what == "full"
            same, why = compare(final_state(trial[run], ranks, full), final_state(trial[ref], ranks, full))
            res["identical"] = same
            if why:
                res["detail"] = why
        except (OSError, KeyError, RuntimeError, ValueError) as e:
            res["identical"], res["detail"] = None, f"could not read the final state: {type(e).__name__}: {e}"
        out[f"{run} vs {ref}"] = res
    return out


# -- statistics --------------------------------------------------------------------------------
def problems_of(trials: list[dict[str, Any]], runs: list[str]) -> list[str]:
    """One line per problem, naming the trial and the run: a run that failed or did not run (a
    baseline says so), a required comparison of final states that differs or could not be made."""
    out = [] if trials else ["no trial ran"]
    for t in trials:
        for k in runs:
            who = f"trial {t['trial']} {k}" + (" (baseline)" if k in BASELINES else "")
            if k not in t:
                out.append(f"{who}: did not run")
            elif not t[k].get("ok"):
                out += [f"{who}: {pr}" for pr in t[k].get("problems") or ["not ok"]]
        for pair, res in (t.get("identical") or {}).items():
            if res["required"] and res["identical"] is not True:
                why = "differs" if res["identical"] is False else "could not be compared"
                out.append(f"trial {t['trial']} {pair}: final state {why}: {res.get('detail', '')}".rstrip(": "))
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    info = machine_info()
    work = workload_info(a)
    tag = "ddp-" + secrets.token_hex(2)
    print(f"ddp-overhead benchmark: {a.trials} trial(s); examples/ddp_train.py, model {a.width} x {a.depth} "
          f"({work['params']} parameters), {a.ranks} ranks, {a.steps} steps, rank {a.fail_rank} killed at step "
          f"{a.fail_step}; torchrun checkpoints every K={a.K} steps; {info['cpu_count']} CPUs, torch {info['torch']}",
          flush=True)
    cluster: BenchCluster | None = None
    scratch: Path | None = None
    if any(k.startswith("hotspare") for k in a.runs):
        cluster = BenchCluster(Path(a.workdir) if a.workdir else None, keep=bool(a.workdir))
        trdir = cluster.tmp / "torchrun"
    elif a.workdir:  # torchrun runs only: no etcd or controller needed
        trdir = Path(a.workdir) / "torchrun"
    else:
        scratch = Path(tempfile.mkdtemp(prefix="hotspare-bench-"))
        trdir = scratch / "torchrun"
    trials: list[dict[str, Any]] = []
    try:
        for t in range(a.trials):
            trial: dict[str, Any] = {"trial": t}
            trials.append(trial)
            runs = {
                "hotspare_nofail": lambda t=t: run_hotspare(cluster, a, f"{tag}-nofail-{t}", fail=False),
                "hotspare_fail": lambda t=t: run_hotspare(cluster, a, f"{tag}-fail-{t}", fail=True),
                "torchrun_nofail": lambda t=t: run_torchrun(a, trdir, f"nofail-{t}", ckpt=True, fail=False,
                                                            max_restarts=a.max_restarts),
                "torchrun_fail": lambda t=t: run_torchrun(a, trdir, f"fail-{t}", ckpt=True, fail=True,
                                                          max_restarts=a.max_restarts),
                "plain": lambda t=t: run_torchrun(a, trdir, f"plain-{t}", ckpt=False, fail=False, max_restarts=0),
                "plain_param_order": lambda t=t: run_torchrun(a, trdir, f"plain-po-{t}", ckpt=False, fail=False,
                                                              max_restarts=0, buckets="param-order"),
            }
            order = [k for k in SYSTEMS if k in a.runs]
            if t % 2:
                order.reverse()  # spread slow drift of the machine's load over all runs
            for key in order:
                load = os.getloadavg()[0]  # other work on the machine: the numbers' noise
                try:
                    rec = runs[key]()
                except Exception as e:  # one broken run must not hide the others' results
                    rec = {"ok": False, "problems": [f"raised {type(e).__name__}: {e}"],
                           "log_tail": traceback.format_exc()}
                rec["loadavg_1m_before"] = round(load, 2)
                trial[key] = rec
                extra = ""
                if "recovery_total_s" in rec:
                    extra = f" recovery {fmt(rec['recovery_total_s'])}s"
                if "kill_to_resume_s" in rec:
                    extra = f" kill->resumed {fmt(rec['kill_to_resume_s'])}s"
                if "recomputed_steps" in rec:
                    extra += f", {rec['recomputed_steps']} steps redone"
                status = "ok" if rec["ok"] else "PROBLEM: " + "; ".join(rec["problems"])
                print(f"  trial {t} {key:<17} span {fmt(rec.get('span_s'))}s  wall {fmt(rec.get('wall_s'))}s"
                      f"{extra}  (load {load:.1f})  {status}", flush=True)
            trial["identical"] = same = check_identical(trial, a.ranks)
            for pair, res in same.items():
                print(f"  trial {t} final state {pair} ({res['compared']}): "
                      + {True: "identical", False: "DIFFERENT", None: "not compared"}[res["identical"]]
                      + ("" if res["required"] else " (not required)")
                      + (f" -- {res['detail']}" if res.get("detail") else ""), flush=True)
    except KeyboardInterrupt:
        print("interrupted; writing what was measured", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    hs_lost = paired(trials, "hotspare_fail", "hotspare_nofail", "span_s", "-")
    tr_lost = paired(trials, "torchrun_fail", "torchrun_nofail", "span_s", "-")
    hs_lost_w = paired(trials, "hotspare_fail", "hotspare_nofail", "wall_s", "-")
    tr_lost_w = paired(trials, "torchrun_fail", "torchrun_nofail", "wall_s", "-")
    ovh = paired(trials, "hotspare_nofail", "plain", "span_s", "/")
    ovh_w = paired(trials, "hotspare_nofail", "plain", "wall_s", "/")
    tr_ovh = paired(trials, "torchrun_nofail", "plain", "span_s", "/")
    bk_ovh = paired(trials, "plain_param_order", "plain", "span_s", "/")
    hs_l, tr_l = med(hs_lost), med(tr_lost)
    ratio = round(hs_l / tr_l, 4) if hs_l is not None and tr_l else None
    hs_lw, tr_lw = med(hs_lost_w), med(tr_lost_w)
    ratio_w = round(hs_lw / tr_lw, 4) if hs_lw is not None and tr_lw else None

    def ok_runs(k: str) -> list[dict[str, Any]]:
        return [t[k] for t in trials if k in t and t[k]["ok"]]

    per_run = {k: {"span_s": summarize(r.get("span_s") for r in ok_runs(k)),
                   "wall_s": summarize(r.get("wall_s") for r in ok_runs(k)),
                   "placed_to_succeeded_s": summarize(r.get("placed_to_succeeded_s") for r in ok_runs(k)),
                   "ok": len(ok_runs(k)),
                   "runs": sum(1 for t in trials if k in t)} for k in SYSTEMS}
    step_ms = {k: med([1000 * r["span_s"] / a.steps for r in ok_runs(k) if r.get("span_s") is not None])
               for k in ("hotspare_nofail", "torchrun_nofail", "plain", "plain_param_order")}

    def m(k: str, f: str) -> str:
        return fmt(per_run[k][f]["median"], 2)

    hs_rec = med([r["recovery_total_s"] for r in ok_runs("hotspare_fail") if r.get("recovery_total_s") is not None])
    tr_res = med([r["kill_to_resume_s"] for r in ok_runs("torchrun_fail") if r.get("kill_to_resume_s") is not None])
    rows = [
        [f"hotspare ({a.ranks}+1 spare)", m("hotspare_nofail", "span_s"), m("hotspare_fail", "span_s"), fmt(hs_l, 2),
         fmt(hs_rec, 2) + " (fail->all resumed)", fmt(hs_lw, 2)],
        [f"torchrun (ckpt K={a.K})", m("torchrun_nofail", "span_s"), m("torchrun_fail", "span_s"), fmt(tr_l, 2),
         fmt(tr_res, 2) + " (kill->resumed)", fmt(tr_lw, 2)],
        ["plain (no FT)", m("plain", "span_s"), "-", "-", "-", "-"],
        ["plain, buckets in param order", m("plain_param_order", "span_s"), "-", "-", "-", "-"],
    ]
    print()
    print("median seconds; span = first training step -> last step done (same definition for both):")
    print(table(["system", "span no-fail", "span 1 fail", "lost/failure", "down time", "lost (whole cmd)"], rows))
    print()
    print(f"steady-state step time (no-failure span / {a.steps} steps): hotspare {fmt(step_ms['hotspare_nofail'], 1)} "
          f"ms, torchrun with checkpoints {fmt(step_ms['torchrun_nofail'], 1)} ms, plain {fmt(step_ms['plain'], 1)} ms, "
          f"plain with buckets in parameter order {fmt(step_ms['plain_param_order'], 1)} ms")
    print(f"steady-state overhead: hotspare no-failure span / plain span = {fmt(med(ovh), 3)} "
          f"(whole-command {fmt(med(ovh_w), 3)}); of which DDP buckets in parameter order alone (plain param-order / "
          f"plain) = {fmt(med(bk_ovh), 3)}; torchrun with checkpoints / plain = {fmt(med(tr_ovh), 3)}")
    verdict = "n/a" if ratio is None else ("met" if ratio <= AIM_RATIO else "NOT met")
    print(f"K = {a.K} (torchrun checkpoint interval; failure at step {a.fail_step}: "
          f"{a.fail_step % a.K} steps after the last checkpoint)")
    print(f"time lost per failure: hotspare {fmt(hs_l, 2)} s, torchrun {fmt(tr_l, 2)} s -> ratio hotspare/torchrun "
          f"{fmt(ratio, 3)} (aim <= {AIM_RATIO:g}: {verdict}); whole-command wall: {fmt(ratio_w, 3)}")
    if hs_l is not None and hs_l < 0:
        print("  (hotspare's loss is below this machine's run-to-run noise: the failure run was faster than the "
              "no-failure run; more trials or a quieter machine narrow it)")
    same_by_pair: dict[str, list[bool | None]] = {}
    for t in trials:
        for pair, res in (t.get("identical") or {}).items():
            same_by_pair.setdefault(pair, []).append(res["identical"])
    for pair, vals in same_by_pair.items():
        print(f"final state {pair}: identical in {sum(v is True for v in vals)} of {len(vals)} trial(s)")

    problems = problems_of(trials, a.runs)
    result: dict[str, Any] = {
        "benchmark": "ddp_overhead",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke": a.smoke,
        "ok": not problems,
        "problems": problems,
        "overhead_ratio": med(ovh),
        "hotspare_lost_s": hs_l,
        "torchrun_lost_s": tr_l,
        "ratio": ratio,
        "K": a.K,
        "aim": {"ratio_le": AIM_RATIO, "met": None if ratio is None else ratio <= AIM_RATIO},
        "definition": (
            "span = newest 'about to run step 0' timestamp of the first attempt/epoch -> newest 'last step done' "
            "timestamp (hotspare: epoch-1 'restored' events -> the 'succeeded' event; torchrun: worker records), "
            "as in lost_time.py. overhead_ratio = span(hotspare, no failure) / span(plain torchrun, no checkpoints), "
            "median of per-trial ratios; bucket_order_ratio = span(plain, DDP buckets in parameter order) / "
            "span(plain), likewise. lost = span(one failure) - span(no failure), paired per trial, median over "
            "trials. step_ms = no-failure span / steps. *_wall variants use whole-command wall time (hotspare run "
            "process; torchrun command)."),
        "compared": {
            "hotspare_fail vs hotspare_nofail": "every tensor of every rank's final state (parameters, AdamW state, "
                                                "torch RNG, ...) except the unseeded numpy/Python RNG states, and "
                                                "every component's JSON state; required",
            "torchrun_fail vs torchrun_nofail, plain vs torchrun_nofail": "every rank's parameters and AdamW state "
                                                                         "tensors; required",
            "plain_param_order vs hotspare_nofail": "every rank's parameters and AdamW state tensors (the same DDP "
                                                    "bucket layout); required",
            "torchrun_nofail vs hotspare_nofail": "every rank's parameters and AdamW state tensors; required with 2 "
                                                  "ranks, reported only with more (gloo's ring sum order follows the "
                                                  "DDP bucket layout, which differs)",
        },
        "end_note": END_NOTE,
        "step_ms": step_ms,
        "bucket_order_ratio": med(bk_ovh),
        "overhead_ratio_wall": med(ovh_w),
        "torchrun_ckpt_overhead_ratio": med(tr_ovh),
        "hotspare_lost_wall_s": hs_lw,
        "torchrun_lost_wall_s": tr_lw,
        "ratio_wall": ratio_w,
        "hotspare_recovery_total_s_median": hs_rec,
        "torchrun_kill_to_resume_s_median": tr_res,
        "identical": {pair: {"identical_trials": sum(v is True for v in vals), "trials": len(vals)}
                      for pair, vals in same_by_pair.items()},
        "lost_per_trial": {"hotspare_s": hs_lost, "torchrun_s": tr_lost, "hotspare_wall_s": hs_lost_w,
                           "torchrun_wall_s": tr_lost_w},
        "overhead_per_trial": {"span": ovh, "wall": ovh_w, "torchrun_ckpt_span": tr_ovh, "bucket_order_span": bk_ovh},
        "per_run": per_run,
        "config": {"trials": a.trials, "ranks": a.ranks, "steps": a.steps, "fail_step": a.fail_step,
                   "fail_rank": a.fail_rank, "K": a.K, "torchrun_max_restarts": a.max_restarts,
                   "hotspare_spares": 1, "ranks_per_node": 1, "lease_ttl_s": a.lease_ttl,
                   "hang_timeout_s": a.hang_timeout, "replicas": a.replicas, "replicate_every": a.replicate_every,
                   "torch_threads_per_rank": 1, "workload": work,
                   "torchrun_env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo"}},
        "machine": info,
        "trials": trials,
    }
    try:
        info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    path = write_json(a.json, result)
    print(f"\nwrote {path}")
    return finish("ddp_overhead", problems)


if __name__ == "__main__":
    sys.exit(main())
