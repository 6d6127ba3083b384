"""Recovery time of a real hotspare job: worker kill and node loss, phase by phase.

Starts a private etcd and controller, then per trial runs the GPT demo workload
(examples/gpt.py, small settings) with ``--ranks`` ranks on one-rank nodes plus one hot
spare node, twice, each time as a fresh job:

* worker-kill: a scheduled ``kill-rank`` SIGKILLs one rank's worker process; its agent
  reports it, the controller swaps in the spare.
* node-loss:   a scheduled ``kill-node`` SIGKILLs that rank's node agent (its workers
  follow); the controller only learns of it when the node's etcd lease (``lease_ttl``)
  expires.

Each job's ``hotspare run --json`` summary gives the recovery breakdown (from the job's
event timeline): detect, decide, rebuild, restore and total seconds (total = failure to
the moment every rank completed its first step in the new world).

    .venv/bin/python benchmarks/recovery_time.py --trials 5
    .venv/bin/python benchmarks/recovery_time.py --smoke   # both scenarios, tiny and short: does it work?
"""

from __future__ import annotations

import argparse
import secrets
import sys
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
    summarize,
    table,
    write_json,
)

PHASES = ("detect_s", "decide_s", "rebuild_s", "restore_s", "total_s")
SCENARIOS = {
    # scenario -> (chaos action, expected recovery kind in the summary)
    "worker_kill": ("kill-rank", "signal"),
    "node_loss": ("kill-node", "node-loss"),
}
AIM_WORKER_KILL_S = 2.0
AIM_NODE_LOSS_EXTRA_S = 1.0  # node loss: lease TTL + this
#: --smoke: every scenario once, 2 ranks, a tiny model, a few steps, short timeouts
SMOKE = {"ranks": 2, "steps": 20, "lease_ttl": 2.0, "hang_timeout": 10.0, "n_layer": 1, "n_embd": 32,
         "job_timeout": 240.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__, "recovery.json", "jobs per scenario")
    p.add_argument("--ranks", type=int, default=4, help="training ranks (one per node); plus one spare node")
    p.add_argument("--steps", type=int, default=150, help="training steps per job")
    p.add_argument("--kill-at", type=int, default=None,
                   help="step at which the failure is injected (default: steps // 2)")
    p.add_argument("--rank", type=int, default=1, help="the rank whose worker / node is killed")
    p.add_argument("--lease-ttl", type=float, default=3.0, help="node lease TTL in seconds (spec lease_ttl)")
    p.add_argument("--hang-timeout", type=float, default=30.0, help="spec hang_timeout")
    p.add_argument("--controller-ttl", type=float, default=2.0, help="controller leader lease TTL")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated subset of " + ", ".join(SCENARIOS))
    p.add_argument("--job-timeout", type=float, default=600, help="cancel a job after this many seconds")
    p.add_argument("--workdir", help="keep etcd data, specs and job logs here (default: a temp dir, removed)")
    a = parse_args_smoke(p, argv, SMOKE)
    a.scenarios = [s.strip().replace("-", "_") for s in a.scenarios.split(",") if s.strip()]
    bad = [s for s in a.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario(s) {bad}; choose from {list(SCENARIOS)}")
    if a.kill_at is None:
        a.kill_at = a.steps // 2
    if not 0 < a.kill_at < a.steps:
        p.error("--kill-at must be inside (0, steps)")
    if not 0 <= a.rank < a.ranks:
        p.error("--rank must be < --ranks")
    if a.trials < 1:
        p.error("--trials must be >= 1")
    return a


def job_spec(a: argparse.Namespace, name: str, action: str) -> dict[str, Any]:
    return gpt_job_spec(a, name, {"n_layer": a.n_layer, "n_embd": a.n_embd},
                        chaos=[{"at_step": a.kill_at, "action": action, "rank": a.rank}])


def run_trial(cluster: BenchCluster, a: argparse.Namespace, scenario: str, trial: int, tag: str) -> dict[str, Any]:
    action, kind = SCENARIOS[scenario]
    name = f"{tag}-{scenario.replace('_', '-')}-{trial}"
    t0 = time.monotonic()
    summary, tail = cluster.run_job(job_spec(a, name, action), timeout=a.job_timeout)
    wall = round(time.monotonic() - t0, 2)
    rec: dict[str, Any] = {"scenario": scenario, "trial": trial, "job": name, "wall_s": wall,
                           "state": summary.get("state") if summary else None}
    problems = []
    if summary is None:
        problems.append("no JSON summary from `hotspare run`")
    else:
        if summary.get("state") != "succeeded":
            problems.append(f"job {summary.get('state')}")
        recs = summary.get("recoveries") or []
        rec["recoveries"] = recs
        if len(recs) != 1:
            problems.append(f"{len(recs)} recoveries (expected 1)")
        if recs:
            r = recs[0]
            rec.update({k: r.get(k) for k in ("failed_rank", "failed_node", "spare_node", "kind", *PHASES)})
            if r.get("kind") != kind:
                problems.append(f"recovery kind {r.get('kind')!r} (expected {kind!r})")
            missing = [ph for ph in PHASES if r.get(ph) is None]
            if missing:
                problems.append(f"timeline lacks {', '.join(missing)}")
    ev = cluster.events(name) if summary else None
    if ev and ev.get("recoveries"):
        epoch = ev["recoveries"][0].get("epoch")
        restored = [e["data"] for e in ev.get("events", [])
                    if e.get("kind") == "restored" and e.get("data", {}).get("epoch") == epoch]
        if restored:
            steps = {d.get("restore_step") for d in restored}
            rec["restore_step"] = min(s for s in steps if s is not None) if steps - {None} else None
            if rec["restore_step"] is not None:
                rec["steps_redone"] = a.kill_at - 1 - rec["restore_step"]  # finished before the kill, done again
            rec["restore_sources"] = {str(d.get("rank")): d.get("source") for d in restored}
            rec["restore_bytes"] = {str(d.get("rank")): d.get("bytes") for d in restored}
    rec["ok"] = not problems
    if problems:
        rec["problems"] = problems
        rec["log_tail"] = tail
    return rec


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    info = machine_info()
    tag = "bench-" + secrets.token_hex(2)
    print(f"recovery benchmark: {a.trials} trial(s) x {', '.join(a.scenarios)}; {a.ranks} ranks + 1 spare node, "
          f"{a.steps} steps, failure at step {a.kill_at} on rank {a.rank}, lease TTL {a.lease_ttl:g}s; "
          f"{info['cpu_count']} CPUs, torch {info['torch']}", flush=True)
    trials: list[dict[str, Any]] = []
    cluster = BenchCluster(Path(a.workdir) if a.workdir else None, controller_ttl=a.controller_ttl,
                           keep=bool(a.workdir))
    try:
        for t in range(a.trials):
            for sc in a.scenarios:
                try:
                    rec = run_trial(cluster, a, sc, t, tag)
                except Exception as e:  # one broken job must not hide the others' results
                    rec = {"scenario": sc, "trial": t, "wall_s": None, "ok": False,
                           "problems": [f"raised {type(e).__name__}: {e}"], "log_tail": traceback.format_exc()}
                trials.append(rec)
                status = "ok" if rec["ok"] else "PROBLEM: " + "; ".join(rec["problems"])
                src = (rec.get("restore_sources") or {}).get(str(a.rank))
                print(f"  trial {t} {sc:<12} total {fmt(rec.get('total_s'))}s (detect {fmt(rec.get('detect_s'))} "
                      f"decide {fmt(rec.get('decide_s'))} rebuild {fmt(rec.get('rebuild_s'))} "
                      f"restore {fmt(rec.get('restore_s'))}); rank {a.rank} from {src or '?'}, "
                      f"{rec.get('steps_redone', '?')} step(s) redone; job wall {rec.get('wall_s')}s  {status}",
                      flush=True)
    except KeyboardInterrupt:
        print("interrupted; writing what was measured", file=sys.stderr)
    finally:
        cluster.close()

    stats: dict[str, dict[str, Any]] = {}
    for sc in a.scenarios:
        # phases come from every trial that recovered (a failed job's numbers are kept raw only)
        good = [r for r in trials if r["scenario"] == sc and r["ok"]]
        stats[sc] = {ph: summarize(r.get(ph) for r in good) for ph in PHASES}
        stats[sc]["trials"] = sum(1 for r in trials if r["scenario"] == sc)
        stats[sc]["ok"] = len(good)

    rows = []
    for sc in a.scenarios:
        for ph in PHASES:
            s = stats[sc][ph]
            rows.append([sc if ph == PHASES[0] else "", ph[:-2], f"{stats[sc]['ok']}/{stats[sc]['trials']}",
                         fmt(s["median"]), fmt(s["min"]), fmt(s["max"])])
    print()
    print(table(["scenario", "phase", "ok/trials", "median s", "min s", "max s"], rows, left=2))

    aims = {}
    if "worker_kill" in stats:
        m = stats["worker_kill"]["total_s"]["median"]
        aims["worker_kill_total_s"] = {"aim_le": AIM_WORKER_KILL_S, "median": m,
                                       "met": None if m is None else m <= AIM_WORKER_KILL_S}
    if "node_loss" in stats:
        m = stats["node_loss"]["total_s"]["median"]
        lim = a.lease_ttl + AIM_NODE_LOSS_EXTRA_S
        aims["node_loss_total_s"] = {"aim_le": lim, "median": m, "met": None if m is None else m <= lim}
    print()
    for key, v in aims.items():
        verdict = "n/a" if v["met"] is None else ("met" if v["met"] else "NOT met")
        what = f" (lease TTL {a.lease_ttl:g} s + {AIM_NODE_LOSS_EXTRA_S:g} s)" if key.startswith("node") else ""
        print(f"aim: {key} median <= {v['aim_le']:g} s{what}: {fmt(v['median'])} s -> {verdict}")

    problems = [f"trial {r['trial']} {r['scenario']} (job {r.get('job', '?')}): {pr}"
                for r in trials for pr in r.get("problems", [])]
    ran = {r["scenario"] for r in trials}
    problems += [f"scenario {sc}: no trial ran" for sc in a.scenarios if sc not in ran]
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke": a.smoke,
        "ok": not problems,
        "problems": problems,
        "lease_ttl_s": a.lease_ttl,
        "config": {"trials": a.trials, "ranks": a.ranks, "spares": 1, "ranks_per_node": 1, "steps": a.steps,
                   "kill_at_step": a.kill_at, "rank": a.rank, "hang_timeout_s": a.hang_timeout,
                   "controller_ttl_s": a.controller_ttl,
                   "workload": {"entrypoint": "examples/gpt.py:train", "n_layer": a.n_layer, "n_embd": a.n_embd},
                   "scenarios": {sc: SCENARIOS[sc][0] for sc in a.scenarios}},
        "machine": info,
    }
    for sc in a.scenarios:
        result[f"{sc}_total_s_median"] = stats[sc]["total_s"]["median"]
    for sc in a.scenarios:
        for ph in PHASES:
            result[f"{sc}_{ph}_median"] = stats[sc][ph]["median"]
    result.update({"stats": stats, "aims": aims, "trials": trials})
    path = write_json(a.json, result)
    print(f"\nwrote {path}")
    return finish("recovery_time", problems)


if __name__ == "__main__":
    sys.exit(main())
