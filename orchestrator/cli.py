"""``hotspare``: submit, watch and break fault-tolerant training jobs.

Where is etcd? ``--etcd URL[,URL]`` or ``$HOTSPARE_ETCD``; otherwise the embedded cluster
recorded under ``--state-dir`` (``$HOTSPARE_STATE_DIR``, default ``~/.hotspare``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from . import embedded

EPILOG = """\
examples:
  hotspare run configs/demo.yaml          submit, watch progress, print the recovery summary
  hotspare status demo                    ranks, nodes, steps, spares, epoch
  hotspare events demo                    the timeline with each recovery's phases
  hotspare chaos demo --action kill-rank --rank 2
"""


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


# -- etcd resolution ------------------------------------------------------------------------
def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir).expanduser() if args.state_dir else embedded.default_state_dir()


def _endpoints(args: argparse.Namespace, spec_endpoints: tuple[str, ...] = (), start: bool = False) -> list[str]:
    if getattr(args, "etcd", None):
        return [e for e in args.etcd.split(",") if e]
    if os.environ.get("HOTSPARE_ETCD"):
        return [e for e in os.environ["HOTSPARE_ETCD"].split(",") if e]
    if spec_endpoints:
        return list(spec_endpoints)
    sd = _state_dir(args)
    c = embedded.up(sd, log=lambda m: print(m, file=sys.stderr)) if start else embedded.load(sd)
    if c is None:
        raise CliError(
            f"no etcd: the embedded cluster is not up (state dir {sd}). Run `hotspare up`, "
            "or pass --etcd URL / set HOTSPARE_ETCD"
        )
    return [c.endpoint]


def _store(endpoints: list[str]):
    """A checked connection; TLS and auth come from the environment (flags and the spec's etcd
    section are exported there, so agents and workers started from here connect the same way)."""
    from .store import Store, StoreError, connect_error, store_options_from_env

    try:
        opts = store_options_from_env()
    except ValueError as e:
        raise CliError(str(e)) from e
    st = None
    try:
        st = Store(endpoints, timeout=5, **opts)
        st.ping()
    except (ValueError, StoreError) as e:
        if st is not None:
            st.close()
        raise CliError(connect_error(endpoints[0], e, opts)) from e
    return st


#: --etcd-* flags -> the Store option they set (through the environment, see ENV_OPTIONS).
_ETCD_FLAGS = {"etcd_ca": "ca_cert", "etcd_cert": "cert", "etcd_key": "key", "etcd_user": "user"}


def _export_etcd_flags(args: argparse.Namespace) -> None:
    """TLS/auth flags go into this process's environment: every Store made here and every
    agent and worker started from here uses them."""
    from .store import ENV_OPTIONS, PASSWORD_FILE_ENV

    for flag, opt in _ETCD_FLAGS.items():
        value = getattr(args, flag, None)
        if value:
            os.environ[ENV_OPTIONS[opt]] = value if opt == "user" else os.path.abspath(value)
    if getattr(args, "etcd_password_file", None):
        os.environ[PASSWORD_FILE_ENV] = os.path.abspath(args.etcd_password_file)
        os.environ.pop(ENV_OPTIONS["password"], None)  # the explicit flag wins


def _export_spec_etcd(spec) -> None:
    """The spec's etcd TLS and auth settings, for this process and the ones it starts, where
    flags and the environment give none (they win, as --etcd wins over etcd.endpoints)."""
    from .store import ENV_OPTIONS, PASSWORD_FILE_ENV

    for opt, var in ENV_OPTIONS.items():
        value = getattr(spec.etcd, opt)
        given = os.environ.get(var) or (opt == "password" and os.environ.get(PASSWORD_FILE_ENV))
        if value and not given:
            os.environ[var] = value


def _launched(args: argparse.Namespace, job: str | None) -> dict | None:
    """What `hotspare submit` recorded about a job it sent to a scheduler (None: local/unknown)."""
    from .launchers import load_record

    if not job or getattr(args, "etcd", None) or os.environ.get("HOTSPARE_ETCD"):
        return None
    rec = load_record(_state_dir(args), job)
    return rec if rec and rec.get("backend") != "local" else None


def _job_endpoints(args: argparse.Namespace, job: str | None) -> list[str]:
    """Endpoints for a command about one job: flags/env, then the job's launch record, then
    the embedded cluster."""
    from .launchers import get, record_endpoints

    rec = _launched(args, job)
    if rec is None:
        return _endpoints(args)
    eps = record_endpoints(rec)
    if eps:
        return eps
    if rec["info"].get("note"):  # e.g. an etcd inside a Kubernetes cluster: not reachable from here
        raise CliError(f"job {job!r} runs on {rec['backend']} with its own etcd: {rec['info']['note']}")
    where = get(rec["backend"]).describe(rec["info"]) or "no scheduler state"
    raise CliError(f"job {job!r} was submitted to {rec['backend']} and its etcd is not up yet "
                   f"({where}); try again in a moment")


def _jobstore(args: argparse.Namespace):
    from .store import JobStore

    js = JobStore(_store(_job_endpoints(args, args.job)), args.job)
    if not js.exists():
        raise CliError(f"no job named {args.job!r} in this etcd (see `hotspare status` for jobs)")
    return js


# -- commands -------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    c = embedded.up(_state_dir(args))
    print(f"etcd {c.endpoint} (pid {c.etcd_pid}), controller pid {c.controller_pid}, state {c.state_dir}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    sd = _state_dir(args)
    print("stopped embedded etcd and controller; state kept in", sd if embedded.down(sd) else "")
    return 0


def _load(args: argparse.Namespace):
    from .spec import SpecError, load_spec, parse_overrides

    try:
        spec = load_spec(args.spec, parse_overrides(args.set or []))
    except SpecError as e:
        raise CliError(str(e)) from e
    d = spec.to_dict()
    _export_spec_etcd(spec)
    d["etcd"]["password"] = None  # never stored, printed or shipped: processes inherit it (env)
    if not d.get("output_dir"):
        d["output_dir"] = str(_state_dir(args) / "jobs" / spec.name)
    return spec, d


def _explicit_endpoints(args: argparse.Namespace, spec) -> bool:
    return bool(getattr(args, "etcd", None) or os.environ.get("HOTSPARE_ETCD") or spec.etcd.endpoints)


def _launcher(backend: str):
    from .launchers import get

    try:
        return get(backend)
    except ImportError as e:
        raise CliError(f"backend {backend!r} needs a package that is not installed: {e} "
                       f"(pip install 'hotspare[{backend}]')") from e


def _submit(args: argparse.Namespace):
    """Register the job in etcd (unless the backend brings its own etcd) and launch it.
    Returns (JobStore or None, resolved spec dict, endpoints, launch info)."""
    from .launchers import LaunchError, save_record
    from .store import Conflict, JobStore

    spec, d = _load(args)
    os.environ["HOTSPARE_STATE_DIR"] = str(_state_dir(args))  # agents and workers inherit it
    launcher = _launcher(spec.backend)
    js = None
    if spec.backend == "local" or _explicit_endpoints(args, spec) or not launcher.brings_etcd:
        eps = _endpoints(args, spec.etcd.endpoints, start=True)
        js = JobStore(_store(eps), spec.name)
        try:
            js.submit(d, secrets.token_bytes(32))
        except Conflict as e:
            raise CliError(f"{e}; cancel it first (`hotspare cancel {spec.name}`) or pick another name") from e
    else:
        eps = []  # the backend starts etcd and registers the job from inside the cluster
        from .launchers import load_record

        old = load_record(_state_dir(args), spec.name)
        if old and old.get("backend") == spec.backend and not launcher.ended(old["info"]):
            # its files (script, secret, endpoints) would be overwritten under the running job
            raise CliError(f"job {spec.name} is still running ({launcher.describe(old['info'])}); "
                           f"cancel it first (`hotspare cancel {spec.name}`) or pick another name")
    Path(d["output_dir"]).mkdir(parents=True, exist_ok=True)
    try:
        info = launcher.launch(d, eps)
    except LaunchError as e:
        if js is not None:  # nothing ran: forget the job, so it can be submitted again at once
            js.delete()
        raise CliError(f"{spec.backend}: {e}") from e
    save_record(_state_dir(args), spec.name, {"backend": spec.backend, "endpoints": eps, "info": info,
                                               "output_dir": d["output_dir"], "time": time.time()})
    if js is not None:
        js.event("submitted", "cli", f"job {spec.name}: {spec.ranks} ranks + {spec.spares} spare node(s), "
                 f"{spec.steps} steps on {spec.backend}")
    return js, d, eps, info


def _wait_for_etcd(args: argparse.Namespace, d: dict, out, timeout: float | None):
    """A backend that brings its own etcd: wait (with progress) until the job is registered."""
    from .launchers import load_record, record_endpoints
    from .store import JobStore, StoreError

    rec = load_record(_state_dir(args), d["name"])
    launcher = _launcher(d["backend"])
    start, last = time.monotonic(), ""
    while True:
        eps = record_endpoints(rec)
        if eps:
            try:
                js = JobStore(_store(eps), d["name"])
                if js.exists():
                    return js, eps
            except (CliError, StoreError):
                pass
        what = launcher.describe(rec["info"]) or "starting"
        if what != last:
            print(f"waiting for the job's etcd: {what}", file=out, flush=True)
            last = what
        if launcher.ended(rec["info"]):
            raise CliError(f"the {d['backend']} job ended before its etcd came up ({what}); "
                           f"see {d['output_dir']}/logs")
        if timeout and time.monotonic() - start > timeout:
            raise CliError(f"job {d['name']}'s etcd did not come up within --timeout {timeout:.0f}s ({what})")
        time.sleep(1.0)


def cmd_submit(args: argparse.Namespace) -> int:
    if args.dry_run:
        spec, d = _load(args)
        eps = list(spec.etcd.endpoints) if _explicit_endpoints(args, spec) else []
        if getattr(args, "etcd", None) or os.environ.get("HOTSPARE_ETCD"):
            eps = _endpoints(args)
        print(f"# resolved spec\n{json.dumps(d, indent=2)}\n")
        from .launchers import LaunchError

        try:
            rendered = _launcher(spec.backend).render(d, eps)
        except (LaunchError, ValueError) as e:
            raise CliError(f"{spec.backend}: {e}") from e
        print(f"# what `hotspare submit` would do ({spec.backend} backend)")
        print(rendered)
        return 0
    js, d, eps, info = _submit(args)
    where = f"etcd {','.join(eps)}" if eps else f"{d['backend']} (etcd starts inside the job)"
    print(f"submitted {d['name']} to {where}; {info.get('summary') or str(len(info.get('agents', {}))) + ' agents'}; "
          f"logs in {info.get('log_dir')}")
    print(f"watch it: hotspare status {d['name']}   hotspare events {d['name']}   hotspare logs {d['name']}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from . import timeline

    js, d, eps, info = _submit(args)
    out = sys.stderr if args.json else sys.stdout
    print(f"running {d['name']} on {d['backend']}: {d['ranks']} ranks + {d['spares']} spare node(s), "
          f"{d['steps']} steps; logs in {info.get('log_dir')}", file=out)
    if js is None:
        if not info.get("endpoints_file") and not info.get("endpoints"):
            raise CliError(f"submitted {d['name']}, but `hotspare run` cannot watch it from here: "
                           f"{info.get('note') or 'its etcd is not reachable from this machine'}")
        js, eps = _wait_for_etcd(args, d, out, args.timeout)
    embedded_dir = None
    if d["backend"] == "local" and not (args.etcd or os.environ.get("HOTSPARE_ETCD") or d["etcd"].get("endpoints")):
        embedded_dir = _state_dir(args)
    state = _watch(js, d, out, timeout=args.timeout, embedded_dir=embedded_dir)
    events = js.events()
    recs = timeline.recoveries(events)
    snap = js.snapshot()
    steps_done = d["steps"] if state == "succeeded" else (
        max((p.step + 1 for p in snap.progress.values()), default=0))
    print(f"\njob {d['name']} {state}: {steps_done}/{d['steps']} steps, epoch {snap.epoch}"
          + (f" ({snap.state_message})" if snap.state_message and state != "succeeded" else ""), file=out)
    if recs:
        print("recoveries:\n" + timeline.format_recoveries(recs), file=out)
    losses = {r: p.metrics.get("loss") for r, p in sorted(snap.progress.items()) if "loss" in p.metrics}
    if losses:
        print("final loss per rank: " + ", ".join(f"{r}: {v:.4f}" for r, v in losses.items()), file=out)
    if embedded_dir is not None:
        print(f"(the embedded etcd and controller keep running for `hotspare status|events|logs {d['name']}`; "
              "`hotspare down` stops them)", file=out)
    if args.json:
        print(json.dumps({"job": d["name"], "state": state, "steps_done": steps_done, "recoveries": [
            {k: r[k] for k in ("failed_rank", "failed_node", "spare_node", "kind", "detect_s",
                               "decide_s", "rebuild_s", "restore_s", "total_s")} for r in recs]}))
    return 0 if state == "succeeded" else 1


def _watch(js, d: dict, out, timeout: float | None, embedded_dir: Path | None = None) -> str:
    from .store import StoreError

    seen: set[tuple[float, str]] = set()
    show = {"placed", "failure", "swap", "shrink", "waiting", "assigned", "resumed", "chaos",
            "succeeded", "failed", "cancelled", "leader", "node-joined"}
    start = time.monotonic()
    last_line = ""
    tty = out.isatty()
    while True:
        try:
            snap = js.snapshot()
            for ev in js.events():
                key = (ev.time, ev.kind + ev.message)
                if key in seen:
                    continue
                seen.add(key)
                if ev.kind in show and not (ev.kind == "assigned" and snap.epoch <= 1 and ev.data.get("epoch") == 1):
                    ts = time.strftime("%H:%M:%S", time.localtime(ev.time))
                    print(("\r" if tty else "") + f"{ts} {ev.kind:<10} {ev.message}", file=out, flush=True)
            if snap.state.terminal:
                return snap.state.value
            steps = [p.step + 1 for p in snap.progress.values()]
            line = (f"epoch {snap.epoch} | steps {min(steps) if steps else 0}/{d['steps']} | "
                    f"{len(snap.nodes)} nodes up")
            loss = [p.metrics["loss"] for p in snap.progress.values() if "loss" in p.metrics]
            if loss:
                line += f" | loss {sum(loss) / len(loss):.4f}"
            if tty:
                print("\r" + line.ljust(70), end="", file=out, flush=True)
            elif line != last_line and int(time.monotonic() - start) % 5 == 0:
                print(line, file=out, flush=True)
            last_line = line
        except StoreError as e:
            print(f"(etcd: {e}; retrying)", file=out)
        if embedded_dir is not None:
            embedded.ensure_controller(embedded_dir, log=lambda m: print(m, file=out))
        if timeout and time.monotonic() - start > timeout:
            js.request_cancel()
            raise CliError(f"job {d['name']} did not finish within --timeout {timeout:.0f}s; cancelled it")
        time.sleep(0.5)


def cmd_status(args: argparse.Namespace) -> int:
    from .store import list_jobs

    if not args.job:
        st = _store(_endpoints(args))
        from .store import JobStore

        jobs = [(j, JobStore(st, j).state()[0].value) for j in list_jobs(st)]
        if args.json:
            print(json.dumps([{"job": j, "state": s} for j, s in jobs]))
        else:
            print("\n".join(f"{j:<24} {s}" for j, s in jobs) or "no jobs")
        return 0
    from .decide import straggler_scores

    rec = _launched(args, args.job)
    sched = _launcher(rec["backend"]).describe(rec["info"]) if rec else None
    try:
        js = _jobstore(args)
    except CliError as e:
        data = _final_status(rec)
        if data is None:
            raise CliError(f"{e}" + (f"; {rec['backend']}: {sched}" if sched else "")) from e
        # the job's own etcd is gone with its allocation: show what it left behind
        data["scheduler"] = sched
        print(json.dumps(data) if args.json else
              f"job {args.job}: {data.get('state')} (from {rec['output_dir']}/final-status.json; its etcd is gone)\n"
              f"  {rec['backend']}: {sched or '-'}")
        return 0
    snap = js.snapshot()
    w = snap.world
    now = time.time()
    scores = straggler_scores(snap, w) if w else {}
    threshold = snap.spec.straggler_threshold if snap.spec else 2.0
    ranks = []
    for r, seat in enumerate(w.seats if w else ()):
        p = snap.progress.get(r)
        alive = seat.node in snap.nodes and snap.nodes[seat.node].incarnation == seat.incarnation
        state = "done" if r in snap.done else ("running" if alive else "lost")
        score = scores.get(r)
        if state == "running" and score is not None and score >= threshold:
            state = "straggler"
        ranks.append({"rank": r, "node": seat.node, "state": state, "step": p.step if p else -1,
                      "since_epoch": seat.since, "step_time": p.step_time if p else None,
                      "compute_time": p.compute_time if p else None,
                      "straggler_score": round(score, 2) if score is not None else None,
                      "age_s": round(now - p.time, 1) if p else None})
    used = {s.node for s in (w.seats if w else ())}
    spares = [n.name for n in snap.nodes.values() if n.name not in used]
    data = {"job": js.job, "state": snap.state.value, "message": snap.state_message,
            "epoch": snap.epoch, "ranks": ranks, "spares": spares, "nodes": sorted(snap.nodes),
            "leader": snap.leader, "scheduler": sched}
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"job {js.job}: {snap.state.value}, epoch {snap.epoch}, controller {snap.leader or '-'}"
          + (f"\n  {snap.state_message}" if snap.state_message else "")
          + (f"\n  {rec['backend']}: {sched}" if sched else ""))
    print(f"{'rank':>4}  {'node':<10} {'state':<10} {'step':>6} {'since':>5} {'s/step':>8} {'compute':>8} {'score':>6}")
    for r in ranks:
        st_ = f"{r['step_time']:.3f}" if r["step_time"] else "-"
        ct = f"{r['compute_time']:.3f}" if r["compute_time"] else "-"
        sc = f"{r['straggler_score']:.2f}" if r["straggler_score"] is not None else "-"
        print(f"{r['rank']:>4}  {r['node']:<10} {r['state']:<10} {r['step']:>6} {r['since_epoch']:>5} {st_:>8} {ct:>8} {sc:>6}")
    print("score = compute time per step / median of all ranks; >= "
          f"{threshold:g} is a straggler (on_straggler: {snap.spec.on_straggler if snap.spec else 'report'})")
    print(f"spares: {', '.join(spares) or 'none'}")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from . import timeline
    from .launchers import left_behind
    from .store.records import Event

    rec = _launched(args, args.job)
    try:
        events = _jobstore(args).events()
    except CliError:
        final = left_behind(rec, "final-events.json")
        if final is None:
            raise
        # the job's own etcd is gone with its allocation: the timeline it left behind
        events = [Event(**e) for e in final.get("events", [])]
        if not args.json:
            print(f"(from {rec['output_dir']}/final-events.json; the job's etcd is gone)")
    recs = timeline.recoveries(events)
    if args.json:
        print(json.dumps({"events": [e.__dict__ for e in events], "recoveries": recs}))
        return 0
    t0 = events[0].time if events else 0
    for e in events:
        print(f"{time.strftime('%H:%M:%S', time.localtime(e.time))}.{int(e.time * 1000) % 1000:03d} "
              f"+{e.time - t0:8.3f}s {e.kind:<12} {e.source:<10} {e.message}")
    print("\nrecoveries:\n" + timeline.format_recoveries(recs))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    rec = _launched(args, args.job)
    if rec is not None:  # scheduler jobs write logs to output_dir (a shared filesystem)
        log_dir = Path(rec["output_dir"]) / "logs"
    else:
        log_dir = _job_spec(_jobstore(args)).log_dir
    if args.rank is not None:
        files = [log_dir / f"rank{args.rank}.log"]
    elif args.node:
        files = [log_dir / f"agent-{args.node}.log"]
    else:
        files = sorted(log_dir.glob("*.log"))
    for f in files:
        if not f.exists():
            raise CliError(f"no log {f} (logs live on the node that ran it; local backend: {log_dir})")
        lines = f.read_text(errors="replace").splitlines()
        print(f"==> {f} <==")
        print("\n".join(lines[-args.tail:] if args.tail else lines))
    return 0


def _next_point(snap, every: int, margin_s: float) -> int:
    """The first replication point every rank will reach at least ``margin_s`` from now.
    Progress is published every few seconds: extrapolate each rank's step from its step time."""
    now, est, step_time = time.time(), -1.0, 0.0
    for p in snap.progress.values():
        guess = p.step + (max(0.0, now - p.time) / p.step_time if p.step_time > 0 else 0.0)
        est, step_time = max(est, guess), max(step_time, p.step_time)
    ahead = margin_s / step_time if step_time > 0 else 0.0
    return (int(est + ahead) // every + 1) * every


def _job_spec(js):
    """The job's stored spec; a clear error if the job is not in this etcd."""
    spec = js.spec()
    if spec is None:
        raise CliError(f"no job {js.job!r} in this etcd (`hotspare status` with no JOB lists the jobs it has)")
    return spec


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Persist the job's state at an upcoming replication point, out of schedule."""
    from recovery import persist

    js = _jobstore(args)
    snap = js.snapshot()
    if snap.spec is None:
        raise CliError(f"no job {args.job!r} in this etcd")
    spec = snap.spec
    if snap.state.terminal:
        raise CliError(f"job {args.job} is {snap.state.value}; its final state is in {spec.output_dir}/final")
    if not spec.replication_enabled:
        raise CliError("persisting needs replication points: this job runs with replicas: 0")
    every, total, root = spec.replicate_every, spec.steps, spec.persist_root
    margin = 2.0  # seconds for the request to reach every agent
    start = time.monotonic()
    while True:
        step = _next_point(snap, every, margin)
        if step >= total:
            newest = max((p.step for p in snap.progress.values()), default=-1)
            raise CliError(f"job {args.job} is at step {newest} of {total}: no replication point "
                           f"(every {every} steps) is left before the end; the final state will be written")
        js.request_checkpoint(step)
        print(f"checkpoint requested at step {step} (a replication point); it goes to "
              f"{persist.checkpoint_path(root, step)}", flush=True)
        if args.no_wait:
            return 0
        while step not in persist.complete_steps(root):
            failed = [e for e in js.events() if e.kind == "persist-failed" and e.data.get("step") == step]
            if failed:
                raise CliError(failed[0].message)
            snap = js.snapshot()
            if snap.state.terminal:
                raise CliError(f"job {args.job} ended before step {step} was persisted")
            if args.timeout and time.monotonic() - start > args.timeout:
                raise CliError(f"step {step} not persisted after --timeout {args.timeout:.0f}s")
            if snap.progress and min(p.step for p in snap.progress.values()) >= step + 3 * every:
                break  # every rank is two points past it: the request came too late for some agent
            time.sleep(0.2)
        else:
            print(f"persisted: {persist.checkpoint_path(root, step)} (manifest written)")
            return 0
        margin *= 2
        print(f"step {step} passed before every agent saw the request; asking again further ahead", flush=True)


def _final_status(rec: dict | None) -> dict | None:
    """What a job that brought its own etcd left behind when its allocation ended."""
    from .launchers import left_behind

    data = left_behind(rec, "final-status.json")
    return data if data and data.get("state") else None


def cmd_wait(args: argparse.Namespace) -> int:
    from .store import JobStore, StoreError

    rec = _launched(args, args.job)
    js = None if rec else JobStore(_store(_endpoints(args)), args.job)
    start, said, checked = time.monotonic(), False, 0.0

    def allocation_over() -> int | None:
        """A job with its own etcd: once the scheduler says its allocation is over (and its
        etcd with it), the answer is what it left behind."""
        nonlocal checked
        if rec is None or time.monotonic() - checked < 5:
            return None
        checked = time.monotonic()
        launcher = _launcher(rec["backend"])
        if not launcher.ended(rec["info"]):
            return None
        final = _final_status(rec)
        if final is None:  # e.g. cancelled, or killed at its time limit, before it could write one
            print(f"job {args.job} did not succeed: {launcher.describe(rec['info'])}, and it left no "
                  f"{rec['output_dir']}/final-status.json; see the logs in {rec['output_dir']}/logs", flush=True)
            return 1
        print(f"job {args.job} {final['state']}" + (f": {final['message']}" if final.get("message") else "")
              + " (its allocation has ended)", flush=True)
        return 0 if final["state"] == "succeeded" else 1

    while True:
        try:
            if js is None:
                eps = _job_endpoints(args, args.job)  # CliError while its etcd is not up yet
                js = JobStore(_store(eps), args.job)
            if js.exists():
                state, msg = js.state()
                if state.terminal:
                    print(f"job {args.job} {state.value}" + (f": {msg}" if msg else ""), flush=True)
                    return 0 if state.value == "succeeded" else 1
            elif not said:
                print(f"waiting for job {args.job} to be registered", flush=True)
                said = True
        except (StoreError, CliError) as e:
            rc = allocation_over()
            if rc is not None:
                return rc
            if rec is None and isinstance(e, CliError):
                raise
            print(f"(etcd: {e}; retrying)", flush=True)
        if args.timeout and time.monotonic() - start > args.timeout:
            raise CliError(f"job {args.job} not finished after --timeout {args.timeout:.0f}s")
        time.sleep(1.0)


def cmd_cancel(args: argparse.Namespace) -> int:
    rec = _launched(args, args.job)
    try:
        js = _jobstore(args)
        js.request_cancel()
        print(f"cancellation of {args.job} requested; agents stop their workers within a second")
    except CliError as e:
        if rec is None:
            raise
        print(f"could not reach the job's etcd ({e}); cancelling through {rec['backend']} only")
    if rec is not None:
        said = _launcher(rec["backend"]).cancel(rec["info"])
        if said:
            print(said)
    return 0


AGENT_ACTIONS = ("kill-rank", "kill-node", "hang-rank", "slow-rank", "partition-node")
ALL_ACTIONS = AGENT_ACTIONS + ("kill-controller", "restart-etcd")


def inject(args: argparse.Namespace, js, action: str, rank: int | None, node: str | None,
           seconds: float | None) -> str:
    """Deliver one failure; returns a sentence saying what was done."""
    from .controller import CONTROLLER_NODE

    if action == "restart-etcd":
        sd = _state_dir(args)
        if embedded.load(sd) is None:
            raise CliError(f"restart-etcd works on the embedded etcd only; none is up in {sd}")
        secs = 5.0 if seconds is None else seconds
        js.event("chaos", "cli", f"restart-etcd: etcd down for {secs:.1f}s", action=action, seconds=secs)
        embedded.restart_etcd(sd, secs)
        js.event("etcd-restarted", "cli", f"etcd back after {secs:.1f}s", action=action)
        return f"etcd was stopped for {secs:.1f}s and is back"
    if action == "kill-controller":
        js.send_chaos(CONTROLLER_NODE, {"action": action})
        return "kill-controller sent to the leader controller"
    snap = js.snapshot()
    if node is None:
        if rank is None:
            raise CliError(f"{action} needs --rank R or --node NAME")
        if snap.world is None or not 0 <= rank < snap.world.size:
            raise CliError(f"rank {rank} is not in job {js.job}'s current world")
        node = snap.world.seats[rank].node
    elif rank is None and action in ("kill-rank", "hang-rank", "slow-rank"):
        raise CliError(f"{action} targets a rank: give --rank R")
    if node not in snap.nodes:
        raise CliError(f"node {node!r} is not a live node of {js.job} (live: {', '.join(sorted(snap.nodes))})")
    js.send_chaos(node, {"action": action, "rank": rank, "seconds": seconds})
    return f"{action} sent to {node}" + (f" (rank {rank})" if rank is not None else "")


def cmd_chaos(args: argparse.Namespace) -> int:
    js = _jobstore(args)
    if args.mtbf is None:
        if not args.action:
            raise CliError("give --action ACTION (one failure) or --mtbf SECONDS (random failures)")
        print(inject(args, js, args.action, args.rank, args.node, args.seconds))
        return 0
    return _random_chaos(args, js)


def _random_chaos(args: argparse.Namespace, js) -> int:
    """Punisher mode: failures at exponential intervals, seeded, until the job ends."""
    import random

    kinds = [k.strip() for k in (args.kinds or "kill-rank,kill-node,hang-rank").split(",") if k.strip()]
    bad = [k for k in kinds if k not in ALL_ACTIONS]
    if bad:
        raise CliError(f"--kinds: unknown action(s) {', '.join(bad)} (known: {', '.join(ALL_ACTIONS)})")
    rng = random.Random(args.seed)
    done = 0
    revive: list[tuple[float, str]] = []
    spec = _job_spec(js)
    while args.count is None or done < args.count:
        wait = rng.expovariate(1.0 / args.mtbf)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _revive_due(revive, js, spec)
            if js.state()[0].terminal:
                print(f"job {js.job} ended; {done} failure(s) injected")
                return 0
            time.sleep(0.2)
        snap = js.snapshot()
        if snap.world is None:
            continue
        kind = rng.choice(kinds)
        rank = rng.randrange(snap.world.size)
        node = snap.world.seats[rank].node if kind in ("kill-node", "partition-node") else None
        seconds = args.seconds if kind in ("slow-rank", "partition-node", "restart-etcd") else None
        try:
            what = inject(args, js, kind, rank if node is None else None, node, seconds)
        except CliError as e:
            print(f"skipped {kind}: {e}")
            continue
        done += 1
        print(f"[{done}] {what}", flush=True)
        if kind == "kill-node" and args.revive is not None:
            revive.append((time.monotonic() + args.revive, node))
    print(f"{done} failure(s) injected")
    return 0


def _revive_due(revive: list, js, spec) -> None:
    """Local backend: bring killed nodes back as spares (a rebooted machine rejoins)."""
    from .launchers.local import start_agent

    now = time.monotonic()
    for item in [r for r in revive if r[0] <= now]:
        revive.remove(item)
        start_agent(js.job, item[1], js.store.endpoints, spec.log_dir, spare=True)
        print(f"revived {item[1]} as a spare", flush=True)


def _default_node() -> str:
    import socket

    return (os.environ.get("HOTSPARE_NODE") or os.environ.get("SLURMD_NODENAME")
            or socket.gethostname().split(".")[0])


def cmd_agent(args: argparse.Namespace) -> int:
    from agents.agent import Agent

    eps = _endpoints(args)
    os.environ["HOTSPARE_ETCD"] = ",".join(eps)
    node = args.node or _default_node()
    return Agent(_store(eps), args.job, node, role="spare" if args.spare else "active",
                 slots=args.slots, wait_for_job=args.wait, host=args.host).run()


def register_job(store, spec_path: str) -> str:
    """Register a job from inside its cluster (backends that bring their own etcd).

    Idempotent: a restarted controller finds the job already there and leaves it alone, even
    if it has finished (re-registering would run it again). The job's secret comes from
    $HOTSPARE_JOB_SECRET_FILE or $HOTSPARE_JOB_SECRET (hex), else a fresh random one."""
    from .spec import JobSpec, SpecError
    from .store import Conflict, JobStore

    try:
        d = json.loads(Path(spec_path).read_text())
        JobSpec.from_dict(d)
    except (OSError, ValueError, TypeError, SpecError) as e:
        raise CliError(f"--register {spec_path}: not a resolved job spec ({e}); "
                       "write it with `hotspare submit --dry-run` or the launcher") from e
    js = JobStore(store, d["name"])
    if js.exists():
        return f"job {d['name']} already registered; leaving it as it is"
    secret = None
    if os.environ.get("HOTSPARE_JOB_SECRET_FILE"):
        secret = Path(os.environ["HOTSPARE_JOB_SECRET_FILE"]).read_bytes().strip()
    elif os.environ.get("HOTSPARE_JOB_SECRET"):
        secret = os.environ["HOTSPARE_JOB_SECRET"].encode()
    try:
        js.submit(d, bytes.fromhex(secret.decode()) if secret else secrets.token_bytes(32))
    except ValueError as e:
        raise CliError(f"the job secret must be hex ({e})") from e
    except Conflict:
        return f"job {d['name']} registered concurrently by another controller"
    js.event("submitted", "controller", f"job {d['name']}: {d['ranks']} ranks + {d['spares']} spare node(s), "
             f"{d['steps']} steps on {d['backend']}")
    return f"registered job {d['name']}"


def cmd_controller(args: argparse.Namespace) -> int:
    import signal

    from .controller import Controller

    st = _store(_endpoints(args))
    if args.register:
        print(register_job(st, args.register), flush=True)
    c = Controller(st, ttl=args.ttl, job=args.job)
    signal.signal(signal.SIGTERM, lambda *_: c.stop())
    c.run()
    return 0


def cmd_etcd(args: argparse.Namespace) -> int:
    """A single-member etcd in the foreground (inside a Slurm allocation, a container, ...)."""
    import signal

    from .etcd_server import EtcdServer, free_port

    host = args.host or _host_address()
    srv = EtcdServer(Path(args.data_dir), args.port or free_port(), free_port(), host=host)
    srv.start(log_path=Path(args.log) if args.log else None)
    try:
        srv.wait_ready()
    except (RuntimeError, TimeoutError) as e:
        srv.stop()
        raise CliError(f"etcd did not start: {e}" + (f" (log: {args.log})" if args.log else "")) from e
    if args.endpoints_file:
        tmp = Path(args.endpoints_file + ".tmp")
        tmp.write_text(srv.endpoint + "\n")
        tmp.replace(args.endpoints_file)
    print(f"etcd ready at {srv.endpoint} (pid {srv.pid})", flush=True)
    stop = lambda *_: srv.stop()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rc = srv.proc.wait()
    return 0 if rc in (0, -signal.SIGTERM) else rc


def _host_address() -> str:
    """This machine's address as peers see it: $HOTSPARE_HOST, else the hostname's address."""
    import socket

    if os.environ.get("HOTSPARE_HOST"):
        return os.environ["HOTSPARE_HOST"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# -- parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--etcd", help="etcd endpoint(s), comma-separated (default: $HOTSPARE_ETCD, "
                        "else the embedded cluster)")
    common.add_argument("--state-dir", help="embedded cluster state (default: $HOTSPARE_STATE_DIR or ~/.hotspare)")
    common.add_argument("--etcd-ca", metavar="PEM", help="CA certificate of an https:// etcd "
                        "(default: $HOTSPARE_ETCD_CA, else the spec's etcd.ca_cert)")
    common.add_argument("--etcd-cert", metavar="PEM", help="client certificate for etcd (default: $HOTSPARE_ETCD_CERT)")
    common.add_argument("--etcd-key", metavar="PEM", help="client key for etcd (default: $HOTSPARE_ETCD_KEY)")
    common.add_argument("--etcd-user", help="etcd user (default: $HOTSPARE_ETCD_USER); the password comes "
                        "from $HOTSPARE_ETCD_PASSWORD or --etcd-password-file, never a flag")
    common.add_argument("--etcd-password-file", metavar="FILE", help="file whose first line is the etcd "
                        "password (default: $HOTSPARE_ETCD_PASSWORD_FILE)")
    p = argparse.ArgumentParser(
        prog="hotspare", description="Fault-tolerant elastic training for PyTorch: a failed rank is "
        "replaced by a warm hot spare while every other process keeps running.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, fn, help_: str, desc: str | None = None) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help_, description=desc or help_)
        sp.set_defaults(fn=fn)
        return sp

    add("up", cmd_up, "start the embedded etcd and controller on this machine",
        "Start a private etcd on a free loopback port and a controller, as daemons. Idempotent.")
    add("down", cmd_down, "stop the embedded etcd and controller (the state dir is kept)")
    for name, fn, h in (("submit", cmd_submit, "submit a job and return"),
                        ("run", cmd_run, "submit a job, watch it live, print a summary; exit 1 if it failed")):
        sp = add(name, fn, h, h + ". Brings the embedded cluster up if the spec uses it and none is running.")
        sp.add_argument("spec", help="job spec YAML (see configs/)")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set ranks=8 --set args.lr=0.1")
        if name == "submit":
            sp.add_argument("--dry-run", action="store_true", help="validate and print the resolved spec")
        else:
            sp.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
            sp.add_argument("--timeout", type=float, help="cancel the job if not done after this many seconds")
    sp = add("status", cmd_status, "show ranks (node, state, step), spares and epoch of a job; no JOB lists jobs")
    sp.add_argument("job", nargs="?")
    sp.add_argument("--json", action="store_true")
    sp = add("events", cmd_events, "show a job's timeline and each recovery's phase durations")
    sp.add_argument("job")
    sp.add_argument("--json", action="store_true")
    sp = add("logs", cmd_logs, "print a job's logs (a rank's, a node agent's, or all)")
    sp.add_argument("job")
    sp.add_argument("--rank", type=int)
    sp.add_argument("--node")
    sp.add_argument("--tail", type=int, default=0, help="only the last N lines")
    sp = add("checkpoint", cmd_checkpoint, "persist a job's state now (at its next replication point)",
             "Ask every rank to flush its snapshot of the next replication point to the persistent "
             "tier (persist_path, default <output_dir>/checkpoints), then wait until the checkpoint "
             "is complete (its manifest is written).")
    sp.add_argument("job")
    sp.add_argument("--no-wait", action="store_true", help="return once requested")
    sp.add_argument("--timeout", type=float, default=300, help="seconds to wait (default 300)")
    sp = add("wait", cmd_wait, "block until a job finishes; exit 0 if it succeeded, 1 if not",
             "Block until JOB is succeeded, failed or cancelled (waiting for it to be registered "
             "first). For batch scripts: exit 0 if it succeeded, 1 otherwise.")
    sp.add_argument("job")
    sp.add_argument("--timeout", type=float, help="give up (exit 2) after this many seconds")
    sp = add("cancel", cmd_cancel, "cancel a job: its agents stop the workers and exit")
    sp.add_argument("job")
    sp = add("chaos", cmd_chaos, "inject failures into a running job (delivered through etcd)",
             """Inject one failure (--action) or random failures (--mtbf). Actions:
  kill-rank       SIGKILL the rank's worker (its agent reports it within 0.1 s)
  kill-node       SIGKILL the node's agent and workers (noticed when its lease expires)
  hang-rank       SIGSTOP the worker (the agent's watchdog kills it after hang_timeout)
  slow-rank       make the worker sleep --seconds after every step (0 clears it); reported
                  as a straggler by `hotspare status`
  partition-node  the agent stops its keepalive and replica traffic and freezes its workers
                  for --seconds; past the lease TTL it is fenced out and rejoins as a new node
  kill-controller SIGKILL the leader controller (a standby takes over)
  restart-etcd    stop the embedded etcd for --seconds, then start it again
Every injection is an event (`hotspare events JOB`).""")
    sp.formatter_class = argparse.RawDescriptionHelpFormatter
    sp.add_argument("job")
    sp.add_argument("--action", choices=ALL_ACTIONS, help="one failure to inject now")
    sp.add_argument("--rank", type=int, help="target rank (for node actions: the node hosting it)")
    sp.add_argument("--node", help="target node")
    sp.add_argument("--seconds", type=float, help="duration (partition-node, restart-etcd) or delay per step (slow-rank)")
    sp.add_argument("--mtbf", type=float, help="random mode: mean seconds between failures")
    sp.add_argument("--seed", type=int, default=0, help="random mode: seed (same seed, same schedule)")
    sp.add_argument("--kinds", help="random mode: comma-separated actions (default kill-rank,kill-node,hang-rank)")
    sp.add_argument("--count", type=int, help="random mode: stop after this many failures (default: until the job ends)")
    sp.add_argument("--revive", type=float, help="random mode, local backend: restart a killed node's agent as a spare after this many seconds")
    sp = add("agent", cmd_agent, "run one node agent (what each node of a cluster runs)",
             "Run one node agent in the foreground: it registers NODE under a lease, keeps warm "
             "workers and runs the ranks the controller assigns to it.")
    sp.add_argument("--job", required=True)
    sp.add_argument("--node", help="this node's name, unique in the job (default: $HOTSPARE_NODE, "
                    "$SLURMD_NODENAME, else the short hostname)")
    sp.add_argument("--host", default=os.environ.get("HOTSPARE_HOST", "127.0.0.1"),
                    help="address peers reach this node's replica server at (default: $HOTSPARE_HOST "
                    "or 127.0.0.1; on a real cluster, the node's IP)")
    sp.add_argument("--spare", action="store_true", help="register as a hot spare")
    sp.add_argument("--slots", type=int, help="worker slots (default: the spec's ranks_per_node)")
    sp.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the job to be submitted")
    sp = add("controller", cmd_controller, "run a controller (leader-elected; a second one is a standby)")
    sp.add_argument("--job", help="only this job (default: every job in this etcd)")
    sp.add_argument("--ttl", type=float, default=3.0, help="leader lease TTL in seconds (standby takeover time)")
    sp.add_argument("--register", metavar="SPEC_JSON", help="first register this job (a resolved spec "
                    "as JSON) unless it exists: for backends whose etcd starts inside the cluster")
    sp = add("etcd", cmd_etcd, "run a single-member etcd in the foreground (used inside Slurm allocations)",
             "Run etcd on this machine, listening on all interfaces, advertising --host; writes its "
             "endpoint to --endpoints-file once it is healthy. Stops on SIGTERM.")
    sp.add_argument("--data-dir", required=True)
    sp.add_argument("--endpoints-file", help="write the client URL here when ready (atomically)")
    sp.add_argument("--host", help="address to advertise (default: $HOTSPARE_HOST, else this host's address)")
    sp.add_argument("--port", type=int, help="client port (default: a free one)")
    sp.add_argument("--log", help="etcd's log file")
    return p


def main(argv: list[str] | None = None) -> int:
    from recovery.persist import CheckpointError

    from .launchers import LaunchError
    from .store import StoreError

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # gRPC's core logs TLS handshake failures to stderr on its own; ours say what they mean
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    _export_etcd_flags(args)
    try:
        return args.fn(args)
    except CliError as e:
        print(f"hotspare {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except StoreError as e:
        print(f"hotspare {args.cmd}: error: etcd: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:  # a scheduler tool missing or refusing (cancel, status, ...)
        print(f"hotspare {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # names the file
        print(f"hotspare {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as e:
        cmd = " ".join(map(str, e.cmd)) if isinstance(e.cmd, (list, tuple)) else str(e.cmd)
        print(f"hotspare {args.cmd}: error: `{cmd}` did not answer within {e.timeout:.0f}s; "
              "is the scheduler reachable from here?", file=sys.stderr)
        return 2
    except OSError as e:  # a file we were asked to write or read (output_dir, a spec, ...)
        where = f"{e.filename}: " if e.filename else ""
        print(f"hotspare {args.cmd}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
