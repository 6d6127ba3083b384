"""Time lost per failure: hotspare vs torchrun with checkpoint/restart, same GPT workload.

Per trial, five runs of the GPT demo workload (``examples/gpt.py``: ``build(...)`` with the
same arguments and seed everywhere, ``--ranks`` ranks, ``--steps`` steps, one torch thread
per process, gloo on loopback):

* hotspare, no failure     ``hotspare run`` of ``examples/gpt.py:train``, ``--ranks`` ranks on
                           one-rank nodes + 1 hot spare node (a private etcd and controller).
* hotspare, one failure    the same with the spec's ``chaos: [{at_step: F, action: kill-rank}]``:
                           rank ``--fail-rank``'s worker SIGKILLs itself at the start of step F.
* torchrun, no failure     ``torchrun --standalone --nproc-per-node N --max-restarts R
                           benchmarks/torchrun_worker.py``: the same training step (flat-buffer
                           gradient allreduce like ``Session.allreduce_grads``), a rank-local
                           checkpoint (model, optimizer, scheduler, data position, RNGs; atomic
                           rename) every ``--K`` steps, resume from the newest complete one.
* torchrun, one failure    the same; the worker of rank ``--fail-rank`` SIGKILLs itself at the
                           start of step F in the first attempt only; torchrun restarts the
                           whole group, which reloads the checkpoint and recomputes the steps
                           since it (F = 150, K = 20: resume after step 139, ~10 steps redone,
                           the expected K/2).
* plain                    torchrun with ``--max-restarts 0``, no checkpoints: training with no
                           fault tolerance at all (for the steady-state overhead).

Wall time, defined identically for both systems (the *training span*): from the moment the
last rank is about to run step 0 (its process group built, workload built, state restored)
to the moment the last rank has finished the last step. Both sides take ``time.time()``
on the same host:

* hotspare: the span from the newest ``restored`` event of epoch 1 (each rank emits it right
  before its first step) to the controller's ``succeeded`` event (it follows the first rank's
  done-mark, which each rank writes after its last step, its final-state write and the final
  barrier; so all ranks are past their last step), read with
  ``python -m hotspare.orchestrator.cli events JOB --json``. (The ranks' own ``finished`` events would
  be a few ms closer, but the agents SIGTERM workers as soon as the job is ``succeeded``, so
  some of them are lost; the extra tens of ms count against hotspare, equally in both runs.)
* torchrun: the span from the newest ``a0-r*-start.json`` record (written by each worker of
  the first attempt right before its first step) to the newest ``end`` record of the last
  attempt (written after the last step).

Everything that a failure costs happens inside the span (torchrun: group teardown, new
processes, ``import torch``, rendezvous, rebuilding the workload, loading the checkpoint and
recomputing; hotspare: detection, the swap to the warm spare, the group rebuild and the
restore), while the start-up before step 0 (etcd/agents/warm workers for hotspare, the
first spawn for torchrun), which a failure does not change but which is noisy on a shared
machine, is excluded from both in the same way. Time lost per failure = span with the
failure - span without it, paired within a trial, median over trials. The whole-command
wall times (``hotspare run`` process; whole ``torchrun`` command) are measured and
reported too, with the same difference, as a cross-check; on a small shared machine they are
dominated by start-up and shutdown (hotspare: 15-40 s of warm-worker start before placement;
torchrun: 5-8 s of worker interpreter teardown after the last step), which a single failure
barely changes but which varies by seconds from run to run, so their difference is mostly
noise and the span is the headline number.

Same workload, checked: every run saves its final parameters (hotspare's ``final/`` state,
the torchrun worker's ``--final-dir``, after the span) and each trial compares all five
bit for bit (``identical_final_params``); torchrun's resume is exact, and so is hotspare's.

Steady-state overhead: ``overhead_ratio`` = hotspare's no-failure span / plain's span
(per-trial ratio, median): what hotspare's per-step snapshots, control thread and
final-state write cost when nothing fails. ``torchrun_ckpt_overhead_ratio`` is the same for
torchrun with its checkpoints.

``--step-sleep S`` adds S seconds to every step on both sides (a model whose step takes
longer); for hotspare the entrypoint is then this file's ``hotspare_train``, which runs
``examples/gpt.py:train`` unchanged with a session whose ``steps()`` sleeps after each step.

    .venv/bin/python benchmarks/lost_time.py --trials 5
    .venv/bin/python benchmarks/lost_time.py --trials 1 --steps 60 --fail-step 30   # quick check
    .venv/bin/python benchmarks/lost_time.py --smoke   # all five runs, tiny and short: does it work?
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
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
    import_gpt,
    machine_info,
    parse_args_smoke,
    run_torchrun_cmd,
    summarize,
    table,
    write_json,
)

HERE = Path(__file__).resolve()
WORKER = HERE.parent / "torchrun_worker.py"
AIM_RATIO = 0.2  # hotspare loses at most 1/5 of what torchrun loses per failure (at K = 20)
# hotspare's agents SIGTERM their workers as soon as the job is 'succeeded' (the first rank's
# done-mark), so a rank still flushing its own 'finished' event can lose it: the end of the
# span is the 'succeeded' event, which comes after every rank's last step.
END_NOTE = "hotspare end = 'succeeded' event (ranks' 'finished' events can be lost when agents exit)"
SYSTEMS = ("hotspare_nofail", "hotspare_fail", "torchrun_nofail", "torchrun_fail", "plain")
#: --smoke: all five runs once, 2 ranks, a tiny model, a few steps (a checkpoint before and after
#: the failure), short timeouts
SMOKE = {"ranks": 2, "steps": 12, "fail_step": 7, "K": 3, "n_layer": 1, "n_embd": 32,
         "hang_timeout": 10.0, "run_timeout": 240.0}


# -- hotspare entrypoint for --step-sleep (runs inside hotspare's workers) ---------------------
class _SleepySession:
    """A session whose steps() sleeps after every step body: a slower model, same code."""

    def __init__(self, session: Any, step_sleep: float) -> None:
        self._session = session
        self._step_sleep = step_sleep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def steps(self, total: int | None = None):
        for step in self._session.steps(total):
            yield step
            time.sleep(self._step_sleep)


_gpt = import_gpt


def hotspare_train(session: Any, step_sleep: float = 0.0, **args: Any) -> None:
    """``examples/gpt.py:train`` with ``step_sleep`` extra seconds per step."""
    _gpt().train(_SleepySession(session, step_sleep) if step_sleep > 0 else session, **args)


def warmup(step_sleep: float = 0.0, **args: Any) -> None:
    """The warm-up hotspare runs in a spare before it has a rank (gpt.py's own)."""
    _gpt().warmup(**args)


# -- arguments ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__, "lost_time.json", "trials (each: all five runs)")
    p.add_argument("--ranks", type=int, default=4, help="training ranks (hotspare: one per node, plus one spare)")
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    p.add_argument("--fail-step", type=int, default=150, help="the failed rank dies at the start of this step")
    p.add_argument("--fail-rank", type=int, default=1, help="the rank that dies")
    p.add_argument("--K", type=int, default=20, help="torchrun: checkpoint every K steps")
    p.add_argument("--replicate-interval", type=float, default=None,
                   help="hotspare: the spec's replicate_interval in seconds (default: the spec's default, 5)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (models a bigger model)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts for the checkpointed runs")
    p.add_argument("--n-layer", type=int, default=2, help="gpt.build n_layer")
    p.add_argument("--n-embd", type=int, default=64, help="gpt.build n_embd")
    p.add_argument("--lease-ttl", type=float, default=3.0, help="hotspare spec lease_ttl")
    p.add_argument("--hang-timeout", type=float, default=30.0, help="hotspare spec hang_timeout")
    p.add_argument("--run-timeout", type=float, default=600, help="give up on one run after this many seconds")
    p.add_argument("--runs", default=",".join(SYSTEMS),
                   help="comma-separated subset of the runs per trial (default: all five)")
    p.add_argument("--workdir", help="keep etcd data, specs, logs and records here (default: a temp dir, removed)")
    a = parse_args_smoke(p, argv, SMOKE)
    a.runs = [r.strip().replace("-", "_") for r in a.runs.split(",") if r.strip()]
    bad = [r for r in a.runs if r not in SYSTEMS]
    if bad or not a.runs:
        p.error(f"unknown run(s) {bad}; choose from {list(SYSTEMS)}")
    if a.trials < 1:
        p.error("--trials must be >= 1")
    if not 0 < a.fail_step < a.steps:
        p.error("--fail-step must be inside (0, steps)")
    if not 0 <= a.fail_rank < a.ranks:
        p.error("--fail-rank must be < --ranks")
    if a.K < 1:
        p.error("--K must be >= 1")
    if a.step_sleep < 0:
        p.error("--step-sleep must be >= 0")
    return a


def gpt_args(a: argparse.Namespace) -> dict[str, Any]:
    """gpt.build/gpt.train arguments: gpt.py's defaults, spelled out so both sides get the same."""
    return {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": 4, "block_size": 64, "batch_size": 8,
            "lr": 3e-3, "seed": 1234, "dropout": 0.1, "warmup_steps": 10, "decay_steps": 2000}


# -- hotspare ----------------------------------------------------------------------------------
LostTimeCluster = BenchCluster  # run_timed: summary, wall time and events of one job


def hotspare_spec(a: argparse.Namespace, name: str, fail: bool) -> dict[str, Any]:
    args, entry = gpt_args(a), None
    if a.step_sleep > 0:
        entry = f"{HERE}:hotspare_train"
        args["step_sleep"] = a.step_sleep
    chaos = [{"at_step": a.fail_step, "action": "kill-rank", "rank": a.fail_rank}] if fail else None
    spec = gpt_job_spec(a, name, args, entrypoint=entry, chaos=chaos)
    if a.replicate_interval is not None:
        spec["replicate_interval"] = a.replicate_interval
    return spec


def run_hotspare(cluster: LostTimeCluster, a: argparse.Namespace, name: str, fail: bool) -> dict[str, Any]:
    res = cluster.run_timed(hotspare_spec(a, name, fail), timeout=a.run_timeout)
    s, events = res["summary"], res["events"]
    rec: dict[str, Any] = {"job": name, "wall_s": round(res["wall_s"], 3), "output_dir": str(cluster.output_dir(name)),
                           "state": s.get("state") if s else None}

    def times(kind: str, epoch: int | None = None) -> list[float]:
        return [e["time"] for e in events if e["kind"] == kind and (epoch is None or e["data"].get("epoch") == epoch)]

    started, finished = times("restored", 1), times("finished")
    placed, succeeded = times("placed"), times("succeeded")
    problems = []
    if s is None:
        problems.append("no JSON summary from `hotspare run`")
    elif s.get("state") != "succeeded":
        problems.append(f"job {s.get('state')}")
    if len(started) < a.ranks or not succeeded:
        problems.append(f"timeline has {len(started)} epoch-1 'restored' events (expected >= {a.ranks}) and "
                        f"{len(succeeded)} 'succeeded'")
    else:
        # end: the controller's 'succeeded' (it follows the first rank's done-mark, which follows the
        # final barrier, so every rank has finished its last step); the ranks' own 'finished' events
        # can be missing, see END_NOTE
        rec["span_s"] = round(max(succeeded) - max(started), 3)
        t0 = min(placed) if placed else max(started)
        rec["timeline_s"] = {  # relative to 'placed'
            "first_rank_started": round(min(started) - t0, 3), "last_rank_started": round(max(started) - t0, 3),
            "finished": sorted(round(x - t0, 3) for x in finished), "succeeded": round(max(succeeded) - t0, 3)}
        if finished:
            rec["finished_events"] = len(finished)
    if placed and succeeded:
        rec["placed_to_succeeded_s"] = round(max(succeeded) - min(placed), 3)
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
                 max_restarts: int) -> dict[str, Any]:
    d = workdir / name
    shutil.rmtree(d, ignore_errors=True)
    out = d / "records"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ranks),
           "--max-restarts", str(max_restarts), str(WORKER), "--steps", str(a.steps), "--out", str(out)]
    if ckpt:
        cmd += ["--ckpt-dir", str(d / "ckpt"), "--K", str(a.K)]
    cmd += ["--final-dir", str(d / "final")]
    if fail:
        cmd += ["--fail-step", str(a.fail_step), "--fail-rank", str(a.fail_rank)]
    if a.step_sleep > 0:
        cmd += ["--step-sleep", str(a.step_sleep)]
    for k, v in gpt_args(a).items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return run_torchrun_cmd(cmd, d, {"run": name, "checkpoint_every": a.K if ckpt else None,
                                     "max_restarts": max_restarts},
                            ranks=a.ranks, fail=fail, fail_step=a.fail_step, run_timeout=a.run_timeout,
                            keep_ckpt=bool(a.workdir))


def final_params(rec: dict[str, Any], ranks: int) -> dict[int, dict[str, Any]] | None:
    """A finished run's final model parameters per rank (hotspare: ``<output_dir>/final``,
    torchrun: the worker's ``--final-dir``); None if missing."""
    import torch

    try:
        if "output_dir" in rec:
            from hotspare.recovery.final import load_final

            pre = "model.params/"
            hs = load_final(rec["output_dir"])
            return {r: {k[len(pre):]: v for k, v in hs.ranks[r].items() if k.startswith(pre)} for r in range(ranks)}
        d = Path(rec["final_dir"])
        return {r: torch.load(d / f"rank{r}.pt", weights_only=True) for r in range(ranks)}
    except (OSError, KeyError, RuntimeError, ValueError):
        return None


def same_params(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> bool:
    import torch

    return set(a) == set(b) and all(
        set(a[r]) == set(b[r]) and all(torch.equal(a[r][k], b[r][k]) for k in a[r]) for r in a)


def check_identical(trial: dict[str, Any], ranks: int) -> dict[str, bool | None]:
    """Each run's final parameters vs the first ok run's (all five train the same thing)."""
    keys = [k for k in SYSTEMS if trial.get(k, {}).get("ok")]
    if len(keys) < 2:
        return {}
    ref = final_params(trial[keys[0]], ranks)
    out: dict[str, bool | None] = {"reference": keys[0]}  # type: ignore[dict-item]
    for k in keys[1:]:
        other = final_params(trial[k], ranks)
        out[k] = None if ref is None or other is None else same_params(ref, other)
    return out


# -- statistics --------------------------------------------------------------------------------
def paired(trials: list[dict[str, Any]], x: str, y: str, key: str, op: str) -> list[float]:
    """Per trial: x[key] - y[key] (op '-') or x[key] / y[key] (op '/'), where both runs were ok."""
    vals = []
    for t in trials:
        rx, ry = t.get(x), t.get(y)
        if not (rx and ry and rx.get("ok") and ry.get("ok")):
            continue
        vx, vy = rx.get(key), ry.get(key)
        if vx is None or vy is None or (op == "/" and vy <= 0):
            continue
        vals.append(round(vx - vy if op == "-" else vx / vy, 4))
    return vals


def problems_of(trials: list[dict[str, Any]], runs: list[str]) -> list[str]:
    """One line per problem, naming the trial and run: a run that failed or did not run, and a
    run whose final parameters differ from the others' (all train the same thing)."""
    out = [] if trials else ["no trial ran"]
    for t in trials:
        for k in runs:
            if k not in t:
                out.append(f"trial {t['trial']} {k}: did not run")
            elif not t[k].get("ok"):
                out += [f"trial {t['trial']} {k}: {pr}" for pr in t[k].get("problems") or ["not ok"]]
        same = t.get("identical_final_params") or {}
        for k, v in same.items():
            if k == "reference" or v:
                continue
            why = "differ from" if v is False else "could not be compared with"
            out.append(f"trial {t['trial']} {k}: final parameters {why} {same['reference']}'s")
    return out


def med(vals: list[float]) -> float | None:
    return round(statistics.median(vals), 3) if vals else None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    info = machine_info()
    tag = "lt-" + secrets.token_hex(2)
    print(f"lost-time benchmark: {a.trials} trial(s); {a.ranks} ranks, {a.steps} steps, rank {a.fail_rank} killed at "
          f"step {a.fail_step}; torchrun checkpoints every K={a.K} steps"
          + (f"; +{a.step_sleep:g}s per step" if a.step_sleep else "")
          + f"; {info['cpu_count']} CPUs, torch {info['torch']}", flush=True)
    cluster: LostTimeCluster | None = None
    scratch: Path | None = None
    if any(k.startswith("hotspare") for k in a.runs):
        cluster = LostTimeCluster(Path(a.workdir) if a.workdir else None, keep=bool(a.workdir))
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
            }
            order = [k for k in SYSTEMS if k in a.runs]
            if t % 2:
                order.reverse()  # spread slow drift of the machine's load over all runs
            for key in order:
                try:
                    rec = runs[key]()
                except Exception as e:  # one broken run must not hide the others' results
                    rec = {"ok": False, "problems": [f"raised {type(e).__name__}: {e}"],
                           "log_tail": traceback.format_exc()}
                trial[key] = rec
                extra = ""
                if "recovery_total_s" in rec:
                    extra = f" recovery {fmt(rec['recovery_total_s'])}s"
                if "kill_to_resume_s" in rec:
                    extra = f" kill->resumed {fmt(rec['kill_to_resume_s'])}s"
                if "recomputed_steps" in rec:
                    extra += f", {rec['recomputed_steps']} steps redone"
                status = "ok" if rec["ok"] else "PROBLEM: " + "; ".join(rec["problems"])
                print(f"  trial {t} {key:<16} span {fmt(rec.get('span_s'))}s  wall {fmt(rec.get('wall_s'))}s"
                      f"{extra}  {status}", flush=True)
            trial["identical_final_params"] = same = check_identical(trial, a.ranks)
            if same:
                print(f"  trial {t} final parameters identical to {same['reference']}'s: "
                      + ", ".join(f"{k} {v}" for k, v in same.items() if k != "reference"), flush=True)
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
    hs_l, tr_l = med(hs_lost), med(tr_lost)
    ratio = round(hs_l / tr_l, 4) if hs_l is not None and tr_l else None
    hs_lw, tr_lw = med(hs_lost_w), med(tr_lost_w)
    ratio_w = round(hs_lw / tr_lw, 4) if hs_lw is not None and tr_lw else None
    per_run = {k: {"span_s": summarize(t[k].get("span_s") for t in trials if k in t and t[k]["ok"]),
                   "wall_s": summarize(t[k].get("wall_s") for t in trials if k in t and t[k]["ok"]),
                   "placed_to_succeeded_s": summarize(t[k].get("placed_to_succeeded_s") for t in trials
                                                      if k in t and t[k]["ok"]),
                   "ok": sum(1 for t in trials if k in t and t[k]["ok"]),
                   "runs": sum(1 for t in trials if k in t)} for k in SYSTEMS}

    def m(k: str, f: str) -> str:
        return fmt(per_run[k][f]["median"], 2)

    hs_rec = med([t["hotspare_fail"]["recovery_total_s"] for t in trials
                  if t.get("hotspare_fail", {}).get("recovery_total_s") is not None])
    tr_res = med([t["torchrun_fail"]["kill_to_resume_s"] for t in trials
                  if t.get("torchrun_fail", {}).get("kill_to_resume_s") is not None])
    rows = [
        [f"hotspare ({a.ranks}+1 spare)", m("hotspare_nofail", "span_s"), m("hotspare_fail", "span_s"), fmt(hs_l, 2),
         fmt(hs_rec, 2) + " (fail->all resumed)", fmt(hs_lw, 2)],
        [f"torchrun (ckpt K={a.K})", m("torchrun_nofail", "span_s"), m("torchrun_fail", "span_s"), fmt(tr_l, 2),
         fmt(tr_res, 2) + " (kill->resumed)", fmt(tr_lw, 2)],
        ["plain (no FT)", m("plain", "span_s"), "-", "-", "-", "-"],
    ]
    print()
    print("median seconds; span = first training step -> last step done (same definition for both):")
    print(table(["system", "span no-fail", "span 1 fail", "lost/failure", "down time", "lost (whole cmd)"], rows))
    print()
    verdict = "n/a" if ratio is None else ("met" if ratio <= AIM_RATIO else "NOT met")
    print(f"K = {a.K} (torchrun checkpoint interval; failure at step {a.fail_step}: "
          f"{a.fail_step % a.K} steps after the last checkpoint)")
    print(f"time lost per failure: hotspare {fmt(hs_l, 2)} s, torchrun {fmt(tr_l, 2)} s -> ratio hotspare/torchrun "
          f"{fmt(ratio, 3)} (aim <= {AIM_RATIO:g}: {verdict}); whole-command wall: {fmt(ratio_w, 3)}")
    if hs_l is not None and hs_l < 0:
        print("  (hotspare's loss is below this machine's run-to-run noise: the failure run was faster than the "
              "no-failure run; more trials or a quieter machine narrow it)")
    print(f"steady-state overhead: hotspare no-failure span / plain span = {fmt(med(ovh), 3)} "
          f"(whole-command {fmt(med(ovh_w), 3)}); torchrun with checkpoints / plain = {fmt(med(tr_ovh), 3)}")
    losses = [(t["torchrun_nofail"].get("final_loss"), t["torchrun_fail"].get("final_loss")) for t in trials
              if t.get("torchrun_nofail", {}).get("ok") and t.get("torchrun_fail", {}).get("ok")]
    exact = all(x == y for x, y in losses) if losses else None
    if losses:
        print(f"torchrun resume exact (final loss with failure == without, every trial): {exact}")

    problems = problems_of(trials, a.runs)
    result: dict[str, Any] = {
        "benchmark": "lost_time",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke": a.smoke,
        "ok": not problems,
        "problems": problems,
        "hotspare_lost_s": hs_l,
        "torchrun_lost_s": tr_l,
        "ratio": ratio,
        "K": a.K,
        "overhead_ratio": med(ovh),
        "aim": {"ratio_le": AIM_RATIO, "met": None if ratio is None else ratio <= AIM_RATIO},
        "definition": (
            "span = newest 'about to run step 0' timestamp of the first attempt/epoch -> newest 'last step done' "
            "timestamp (hotspare: epoch-1 'restored' events -> the 'succeeded' event; torchrun: worker records). "
            "lost = span(one failure) - span(no failure), paired per trial, median over trials. "
            "overhead_ratio = span(hotspare, no failure) / span(plain torchrun, no checkpoints), median of per-trial "
            "ratios. *_wall variants use whole-command wall time (hotspare run process; torchrun command)."),
        "end_note": END_NOTE,
        "hotspare_lost_wall_s": hs_lw,
        "torchrun_lost_wall_s": tr_lw,
        "ratio_wall": ratio_w,
        "overhead_ratio_wall": med(ovh_w),
        "torchrun_ckpt_overhead_ratio": med(tr_ovh),
        "hotspare_recovery_total_s_median": hs_rec,
        "torchrun_kill_to_resume_s_median": tr_res,
        "torchrun_resume_exact": exact,
        "lost_per_trial": {"hotspare_s": hs_lost, "torchrun_s": tr_lost, "hotspare_wall_s": hs_lost_w,
                           "torchrun_wall_s": tr_lost_w},
        "overhead_per_trial": {"span": ovh, "wall": ovh_w, "torchrun_ckpt_span": tr_ovh},
        "per_run": per_run,
        "config": {"trials": a.trials, "ranks": a.ranks, "steps": a.steps, "fail_step": a.fail_step,
                   "fail_rank": a.fail_rank, "K": a.K, "step_sleep_s": a.step_sleep,
                   "torchrun_max_restarts": a.max_restarts, "hotspare_spares": 1, "ranks_per_node": 1,
                   "lease_ttl_s": a.lease_ttl, "hang_timeout_s": a.hang_timeout, "torch_threads_per_rank": 1,
                   "workload": {"file": "examples/gpt.py", **gpt_args(a)},
                   "torchrun_env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo"}},
        "machine": info,
        "trials": trials,
    }
    path = write_json(a.json, result)
    print(f"\nwrote {path}")
    return finish("lost_time", problems)


if __name__ == "__main__":
    sys.exit(main())
