"""Looking at a job: its ranks and nodes (status), its timeline (events), its logs (:mod:`.logs`).

A job that brought its own etcd leaves its status and timeline in its output_dir as its
allocation ends (``launchers.LEFT_BEHIND``): status and events read them once that etcd is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from .. import status, timeline
from ..launchers import left_behind
from ..store import QUOTA_FIX, Event, JobSnapshot, JobStore, Store, StoreError, list_jobs
from . import logs
from .common import (
    CliError,
    Command,
    connect,
    endpoints,
    final_status,
    jobstore,
    launched,
    launcher,
)

_HEAD = (f"{'rank':>4}  {'node':<10} {'state':<10} {'step':>6} {'since':>5} {'s/step':>8} "
         f"{'compute':>8} {'score':>6}  metrics")


def _list_jobs(args: argparse.Namespace) -> int:
    st = connect(args, endpoints(args))
    jobs = [(j, JobStore(st, j).state()[0].value) for j in list_jobs(st)]
    if args.json:
        print(json.dumps([{"job": j, "state": s} for j, s in jobs]))
    else:
        print("\n".join(f"{j:<24} {s}" for j, s in jobs) or "no jobs")
    return 0


def _row(r: status.RankRow) -> str:
    st_ = f"{r.step_time:.3f}" if r.step_time else "-"
    ct = f"{r.compute_time:.3f}" if r.compute_time else "-"
    sc = f"{r.straggler_score:.2f}" if r.straggler_score is not None else "-"
    return (f"{r.rank:>4}  {r.node:<10} {r.state:<10} {r.step:>6} {r.since_epoch:>5} {st_:>8} {ct:>8} {sc:>6}  "
            f"{status.format_metrics(r.metrics) or '-'}").rstrip()


def _progress(snap: JobSnapshot, rows: list[status.RankRow]) -> str:
    """``step 57/120, loss 0.2301 acc 0.91`` (the slowest rank's step; metrics: mean of the ranks)."""
    total = status.total_steps(snap)
    line = f"step {status.job_step(rows)}/{total if total is not None else '?'}"
    metrics = status.format_metrics(status.mean_metrics(rows))
    return line + (f", {metrics}" if metrics else "")


def _print_status(snap: JobSnapshot, rows: list[status.RankRow], where: str | None) -> None:
    print(f"job {snap.job}: {snap.state.value}, epoch {snap.epoch}, {_progress(snap, rows)}, "
          f"controller {snap.leader or '-'}"
          + (f"\n  {snap.state_message}" if snap.state_message else "")
          + (f"\n{status.error_excerpt(snap.state_error, indent='    ')}" if snap.state_error else "")
          + (f"\n  {where}" if where else ""))
    print(_HEAD)
    for r in rows:
        print(_row(r))
    print("score = compute time per step / median of all ranks; >= "
          f"{status.threshold(snap):g} is a straggler (on_straggler: {status.on_straggler(snap)})")
    print(f"spares: {', '.join(status.spares(snap)) or 'none'}")


def _left_behind_status(args: argparse.Namespace, rec: dict | None, sched: str | None, e: CliError) -> int:
    """The job's own etcd is gone with its allocation: show what it left behind."""
    data = final_status(rec)
    if data is None:
        raise CliError(f"{e}" + (f"; {rec['backend']}: {sched}" if sched else "")) from e
    data["scheduler"] = sched
    print(json.dumps(data) if args.json else
          f"job {args.job}: {data.get('state')} (from {rec['output_dir']}/final-status.json; its etcd is gone)\n"
          + (f"  {data['message']}\n" if data.get("message") else "")
          + f"  {rec['backend']}: {sched or '-'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if not args.job:
        return _list_jobs(args)
    rec = launched(args, args.job)
    sched = launcher(rec["backend"]).describe(rec["info"]) if rec else None
    try:
        js = jobstore(args)
    except CliError as e:
        return _left_behind_status(args, rec, sched, e)
    snap = js.snapshot()
    now = time.time()
    alarm = etcd_alarm(js.store)
    if args.json:
        print(json.dumps({**status.job_status(snap, now), "scheduler": sched, "etcd_alarm": alarm or None}))
        return 0
    _print_status(snap, status.rank_rows(snap, now), f"{rec['backend']}: {sched}" if sched else None)
    if alarm:
        print(alarm)
    return 0


def etcd_alarm(store: Store) -> str:
    """A sentence about the alarms etcd has raised ("": none, or they cannot be listed). Under
    NOSPACE etcd still answers reads, so the job looks alive but stuck: this says why."""
    try:
        names = store.alarms()
    except StoreError:
        return ""
    if "NOSPACE" in names:
        return ("etcd: its space quota is exhausted (NOSPACE alarm): it refuses every write, so nothing of "
                f"this job (progress, recoveries, its end) can be recorded until then: {QUOTA_FIX}")
    return f"etcd: alarm(s) raised: {', '.join(names)} (`etcdctl alarm list`)" if names else ""


def cmd_events(args: argparse.Namespace) -> int:
    rec = launched(args, args.job)
    try:
        events = jobstore(args).events()
    except CliError:
        final = left_behind(rec, "final-events.json")
        if final is None:
            raise
        # the job's own etcd is gone with its allocation: the timeline it left behind
        events = [Event.from_json(json.dumps(e)) for e in final.get("events", [])]
        if not args.json:
            print(f"(from {rec['output_dir']}/final-events.json; the job's etcd is gone)")
    recs = timeline.recoveries(events)
    if args.json:
        print(json.dumps({"events": [dataclasses.asdict(e) for e in events], "recoveries": recs}))
        return 0
    t0 = events[0].time if events else 0
    for e in events:
        print(timeline.format_event(e, t0))
    print("\n" + timeline.format_section(recs))
    return 0


# -- flags ------------------------------------------------------------------------------------
def _status_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job", nargs="?")
    sp.add_argument("--json", action="store_true")


def _events_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job")
    sp.add_argument("--json", action="store_true")


COMMANDS = [
    Command("status", cmd_status, "show ranks (node, state, step), spares and epoch of a job; no JOB lists jobs",
            arguments=_status_arguments),
    Command("events", cmd_events, "show a job's timeline and each recovery's phase durations",
            arguments=_events_arguments),
    Command("logs", logs.cmd_logs, "print a job's logs (a rank's, a node agent's, or all); --follow like tail -f",
            arguments=logs.logs_arguments),
]
