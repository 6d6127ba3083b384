"""A job's life from the command line: submit (or run and watch), wait, cancel."""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from hotspare.recovery import persist

from .. import embedded, entry_check, status, timeline
from ..launchers import Launcher, LaunchError, load_record, record_endpoints, save_record
from ..spec import JobSpec, SpecError, load_spec, parse_overrides
from ..store import KV, Conflict, EventKind, JobSnapshot, JobStore, Report, StoreError, new_run_id
from ..store.records import AGENT_FAILED
from ..util import Waker
from .common import (
    CliError,
    Command,
    connect,
    endpoints,
    etcd_given,
    etcd_settings,
    export_for_children,
    final_status,
    job_endpoints,
    jobstore,
    launched,
    launcher,
    state_dir,
)
from .observe import etcd_alarm

#: The events `hotspare run` prints as they happen (the rest: `hotspare events`).
WATCHED = {EventKind.PLACED, EventKind.FAILURE, EventKind.SWAP, EventKind.SHRINK, EventKind.WAITING,
           EventKind.ASSIGNED, EventKind.RESUMED, EventKind.CHAOS, EventKind.SUCCEEDED, EventKind.FAILED,
           EventKind.CANCELLED, EventKind.LEADER, EventKind.NODE_JOINED}


def load(args: argparse.Namespace) -> JobSpec:
    """The spec file with --set applied, validated and resolved: output_dir filled in (under
    the state dir by default), the etcd password dropped (never stored, printed or shipped:
    processes inherit it through the environment)."""
    try:
        spec = load_spec(args.spec, parse_overrides(args.set or []))
    except SpecError as e:
        raise CliError(str(e)) from e
    etcd_settings(args).fill_from_spec(spec)
    return dataclasses.replace(
        spec, etcd=dataclasses.replace(spec.etcd, password=None),
        output_dir=spec.output_dir or str(state_dir(args) / "jobs" / spec.name))


def _explicit_endpoints(args: argparse.Namespace, spec: JobSpec) -> bool:
    return etcd_given(args) or bool(spec.etcd.endpoints)


def _register(args: argparse.Namespace, spec: JobSpec, backend: Launcher) -> tuple[JobStore | None, list[str]]:
    """Register the job in etcd before it is launched, unless the backend brings its own etcd
    (it then registers the job from inside the cluster): (JobStore or None, endpoints)."""
    if spec.backend == "local" or _explicit_endpoints(args, spec) or not backend.brings_etcd:
        eps = endpoints(args, spec.etcd.endpoints, start=True)
        js = JobStore(connect(args, eps, spec.name), spec.name)
        try:
            js.submit(spec, secrets.token_bytes(32))
        except Conflict as e:
            raise CliError(f"{e}; cancel it first (`hotspare cancel {spec.name}`) or pick another name") from e
        return js, eps
    old = load_record(state_dir(args), spec.name)
    if old and old.get("backend") == spec.backend and not backend.ended(old["info"]):
        # its files (script, secret, endpoints) would be overwritten under the running job
        raise CliError(f"job {spec.name} is still running ({backend.describe(old['info'])}); "
                       f"cancel it first (`hotspare cancel {spec.name}`) or pick another name")
    return None, []


def submit(args: argparse.Namespace) -> tuple[JobStore | None, JobSpec, list[str], dict]:
    """Register the job (see _register) and launch it: (JobStore or None, spec, endpoints,
    launch info). Agents and workers inherit the state dir and the etcd settings."""
    spec = _this_run(args, load(args))
    export_for_children(args, HOTSPARE_STATE_DIR=str(state_dir(args)))
    _check_entrypoint(args, spec)
    backend = launcher(spec.backend)
    js, eps = _register(args, spec, backend)
    Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
    try:
        info = backend.launch(spec, eps)
    except LaunchError as e:
        if js is not None:  # nothing ran: forget the job, so it can be submitted again at once
            js.delete()
        raise CliError(f"{spec.backend}: {e}") from e
    save_record(state_dir(args), spec.name, {"backend": spec.backend, "endpoints": eps, "info": info,
                                              "output_dir": spec.output_dir, "time": time.time()})
    if js is not None:
        js.event(EventKind.SUBMITTED, "cli", f"job {spec.name}: {spec.ranks} ranks + {spec.spares} spare "
                 f"node(s), {spec.steps} steps on {spec.backend}")
    return js, spec, eps, info


def _this_run(args: argparse.Namespace, spec: JobSpec) -> JobSpec:
    """This submission's run id and, with --resume, the run it starts from: the newest earlier
    run of the name with a complete persisted checkpoint of this many ranks."""
    resume_from = ""
    if getattr(args, "resume", False):
        try:
            found = persist.resumable(spec.persist_base, spec.ranks)
        except persist.CheckpointError as e:
            raise CliError(f"--resume: {e}") from e
        if found is None:
            raise CliError(f"--resume: nothing to resume: no earlier run of {spec.name} left a complete "
                           f"checkpoint of {spec.ranks} ranks in {spec.persist_base} (a run leaves one "
                           "with persist_every set); run without --resume to start from step 0")
        resume_from, step = found
        print(f"resuming {spec.name} from step {step} of run {resume_from} "
              f"({persist.checkpoint_path(persist.join(spec.persist_base, resume_from), step)})",
              file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)
    return dataclasses.replace(spec, run_id=new_run_id(), resume_from=resume_from)


def _wait_for_etcd(args: argparse.Namespace, spec: JobSpec, out: TextIO,
                   timeout: float | None) -> tuple[JobStore, list[str]]:
    """A backend that brings its own etcd: wait (with progress) until the job is registered."""
    rec = load_record(state_dir(args), spec.name)
    backend = launcher(spec.backend)
    start, last = time.monotonic(), ""
    while True:
        eps = record_endpoints(rec)
        if eps:
            try:
                js = JobStore(connect(args, eps, spec.name), spec.name)
                if js.exists():
                    return js, eps
            except (CliError, StoreError):
                pass
        what = backend.describe(rec["info"]) or "starting"
        if what != last:
            print(f"waiting for the job's etcd: {what}", file=out, flush=True)
            last = what
        if backend.ended(rec["info"]):
            raise CliError(f"the {spec.backend} job ended before its etcd came up ({what}); "
                           f"see {spec.output_dir}/logs")
        if timeout and time.monotonic() - start > timeout:
            raise CliError(f"job {spec.name}'s etcd did not come up within --timeout {timeout:.0f}s ({what})")
        time.sleep(1.0)


def _check_entrypoint(args: argparse.Namespace, spec: JobSpec) -> None:
    """Before anything starts: the entrypoint imports and takes (session, **args), checked in a
    worker-like subprocess (entry_check.require: refused on backend local, only warned about on
    others when it may be this machine's environment)."""
    if getattr(args, "no_check", False):
        return
    try:
        entry_check.require(spec.entrypoint, spec.args, spec.env, spec.backend,
                            warn=lambda m: print(m, file=sys.stderr, flush=True))
    except entry_check.EntryError as e:
        raise CliError(str(e)) from e


def _dry_run(args: argparse.Namespace) -> int:
    spec = load(args)
    _check_entrypoint(args, spec)
    eps = list(spec.etcd.endpoints) if _explicit_endpoints(args, spec) else []
    if etcd_given(args):
        eps = endpoints(args)
    # as comments: the output stays a valid manifest stream (`... --dry-run | kubectl apply -f -`)
    resolved = json.dumps(spec.to_dict(), indent=2).splitlines()
    print("# resolved spec\n" + "\n".join(f"# {ln}" for ln in resolved) + "\n")
    try:
        rendered = launcher(spec.backend).render(spec, eps)
    except (LaunchError, ValueError) as e:
        raise CliError(f"{spec.backend}: {e}") from e
    print(f"# what `hotspare submit` would do ({spec.backend} backend)")
    print(rendered)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    if args.dry_run:
        return _dry_run(args)
    _, spec, eps, info = submit(args)
    where = f"etcd {','.join(eps)}" if eps else f"{spec.backend} (etcd starts inside the job)"
    print(f"submitted {spec.name} to {where}; {info.get('summary') or str(len(info.get('agents', {}))) + ' agents'}; "
          f"logs in {info.get('log_dir')}")
    print(f"watch it: hotspare status {spec.name}   hotspare events {spec.name}   hotspare logs {spec.name}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    js, spec, eps, info = submit(args)
    out = sys.stderr if args.json else sys.stdout
    if args.detach:
        print(f"submitted {spec.name} on {spec.backend}: {spec.ranks} ranks + {spec.spares} spare node(s), "
              f"{spec.steps} steps; logs in {info.get('log_dir')}\n{_follow_hint(spec.name)}", file=out)
        return 0
    print(f"running {spec.name} on {spec.backend}: {spec.ranks} ranks + {spec.spares} spare node(s), "
          f"{spec.steps} steps; logs in {info.get('log_dir')} (Ctrl-C cancels the job)", file=out)
    embedded_dir = None
    if spec.backend == "local" and not (etcd_given(args) or spec.etcd.endpoints):
        embedded_dir = state_dir(args)
    try:
        if js is None:
            if not info.get("endpoints_file") and not info.get("endpoints"):
                raise CliError(f"submitted {spec.name}, but `hotspare run` cannot watch it from here: "
                               f"{info.get('note') or 'its etcd is not reachable from this machine'}")
            js, eps = _wait_for_etcd(args, spec, out, args.timeout)
        exited = getattr(launcher(spec.backend), "exited", None)  # a backend whose agents we started
        state = _watch(js, spec, out, timeout=args.timeout, embedded_dir=embedded_dir,
                       exited=(lambda: exited(info)) if exited else None)
    except KeyboardInterrupt:
        return _interrupted(js, spec, info, out, embedded_dir, args.json)
    _summary(js, spec, state, out, embedded_dir is not None, args.json)
    return 0 if state == "succeeded" else 1


def _follow_hint(job: str) -> str:
    return (f"follow it: hotspare wait {job}   hotspare status {job}   hotspare events {job}   "
            f"hotspare logs {job} --follow")


def _interrupted(js: JobStore | None, spec: JobSpec, info: dict, out: TextIO, embedded_dir: Path | None,
                 as_json: bool) -> int:
    """Ctrl-C on `hotspare run`: cancel the job and wait until it stopped (a second Ctrl-C
    leaves it stopping on its own). Exit code 130, as for any interrupted command."""
    name = spec.name
    print(f"\nCtrl-C: cancelling job {name} and waiting for it to stop "
          "(Ctrl-C again to stop waiting; the job still stops)", file=out, flush=True)
    try:
        if js is not None:
            js.request_cancel()
        said = launcher(spec.backend).cancel(info)  # a scheduler's job: its allocation too
        if said:
            print(said, file=out, flush=True)
        if js is None:
            return 130
        state = _wait_stopped(js, spec, info, out, embedded_dir)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {name} is being cancelled. {_follow_hint(name)}", file=out, flush=True)
        return 130
    except StoreError as e:
        raise CliError(f"could not cancel {name}: etcd: {e}; try `hotspare cancel {name}`") from e
    _summary(js, spec, state, out, embedded_dir is not None, as_json)
    return 130


def _wait_stopped(js: JobStore, spec: JobSpec, info: dict, out: TextIO, embedded_dir: Path | None) -> str:
    """Until the controller ended the job and (local backend) its agents, which stop their
    workers first, have exited: the job's final state."""
    backend, state, said = launcher(spec.backend), None, False
    while True:
        try:
            if state is None:
                st, _ = js.state()
                state = st.value if st.terminal else None
        except StoreError as e:
            print(f"(etcd: {e}; retrying)", file=out, flush=True)
        if state is not None:
            if spec.backend != "local" or backend.ended(info):
                print(f"job {spec.name} {state}; " + ("no process of it is left" if spec.backend == "local"
                      else f"{spec.backend}: {backend.describe(info) or 'ended'}"), file=out, flush=True)
                return state
            if not said:
                print(f"job {spec.name} {state}; waiting for its agents to stop their workers and exit",
                      file=out, flush=True)
                said = True
        if embedded_dir is not None:
            embedded.ensure_controller(embedded_dir, log=lambda m: print(m, file=out))
        time.sleep(0.2)


def _summary(js: JobStore, spec: JobSpec, state: str, out: TextIO, embedded_up: bool, as_json: bool) -> None:
    """What `hotspare run` says once the job ended: steps, recoveries, final losses."""
    recs = timeline.recoveries(js.events())
    snap = js.snapshot()
    # progress is published every few seconds: a job that failed sooner has none, but its
    # failure history says which step a rank was computing (every step before it was done)
    steps_done = spec.steps if state == "succeeded" else max(
        [p.step + 1 for p in snap.progress.values()] + [f.step for f in snap.failures], default=0)
    print(f"\njob {spec.name} {state}: {steps_done}/{spec.steps} steps, epoch {snap.epoch}"
          + (f" ({snap.state_message})" if snap.state_message and state != "succeeded" else ""), file=out)
    if snap.state_error:  # the failing rank's traceback, its last line last
        print(status.error_excerpt(snap.state_error, 15), file=out)
    if recs:
        print(timeline.format_section(recs), file=out)
    metrics = _final_metrics(snap)
    if metrics:
        print(f"final metrics (mean of the ranks): {status.format_metrics(metrics)}", file=out)
    losses = {r: p.metrics.get("loss") for r, p in sorted(snap.progress.items()) if "loss" in p.metrics}
    if len(losses) > 1:
        print("final loss per rank: " + ", ".join(f"{r}: {v:.4f}" for r, v in losses.items()), file=out)
    print(f"output: {spec.output_dir} (logs: {spec.log_dir}"
          + (", final state: load_final(output_dir)" if state == "succeeded" else "") + ")", file=out)
    if embedded_up:
        print(f"(the embedded etcd and controller keep running for `hotspare status|events|logs {spec.name}`; "
              "`hotspare down` stops them)", file=out)
    if as_json:
        print(json.dumps({"job": spec.name, "state": state, "message": snap.state_message,
                          "error": snap.state_error, "steps_done": steps_done,
                          "recoveries": timeline.summary(recs), "metrics": metrics,
                          "output_dir": spec.output_dir}))


def _final_metrics(snap: JobSnapshot) -> dict[str, float]:
    """Each metric's mean over the ranks' last published progress (the last step's: a rank
    publishes it before its done mark)."""
    return status.mean_metrics(status.rank_rows(snap, time.time())) if snap.world else {}


def _progress_line(snap: JobSnapshot, steps: int, shown: int = 0) -> tuple[str, int]:
    """The line `hotspare run` keeps up to date, and its step count: never below ``shown``
    (after a recovery the world resumes a step or two back, and a replaced rank has not
    published a step yet; the count the user saw was true when shown)."""
    rows = status.rank_rows(snap, time.time())
    done = max(shown, status.job_step(rows))
    up = sum(1 for r in rows if r.state in ("running", "straggler", "done"))
    line = f"epoch {snap.epoch} | steps {done}/{steps} | {up}/{len(rows)} ranks running, {len(snap.nodes)} nodes up"
    metrics = status.format_metrics(status.mean_metrics(rows), most=3)
    return line + (f" | {metrics}" if metrics else ""), done


#: seconds between redraws of `hotspare run`'s progress line (a terminal; a log gets a line
#: every LOG_EVERY); events and the end of the job are shown as they happen (watches)
REDRAW_EVERY = 1.0
LOG_EVERY = 5.0
#: seconds between reads of etcd's alarms while following a job that makes progress (a full etcd
#: raises NOSPACE); once no rank's step advanced for STALLED_AFTER (more than one of the
#: ranks' 10 s progress records) they are read every round
ALARM_EVERY = 30.0
STALLED_AFTER = 15.0
#: seconds between full reads of the job when no watch said anything changed (a watch
#: event lost while etcd was away costs this much staleness, not correctness)
SAFETY_READ = 30.0


def _report_exited_agents(js: JobStore, snap: JobSnapshot, exited: Callable[[], dict[str, str]] | None) -> None:
    """Before the first world: report each agent this command started that exited without a
    node record or a report of its own (it died before it reached etcd), so that the
    controller fails the job with its last words instead of waiting for the node forever."""
    if exited is None or snap.world is not None:
        return
    for node, last in sorted(exited().items()):
        if node in snap.nodes or any(r.node == node and r.rank < 0 for r in snap.reports):
            continue
        js.report(Report(node=node, rank=-1, epoch=0, kind=AGENT_FAILED, time=time.time(),
                         message="its process exited before it registered"
                         + (f"; its log ends: {last}" if last else "")))


class _Feed:
    """The job as `hotspare run` follows it: read in full when a watch on its keys or its
    events says something changed (or after SAFETY_READ), the ranks' progress records taken
    from their watch's puts in between, without a read."""

    def __init__(self, js: JobStore) -> None:
        self.js, self.wake = js, Waker()
        self.snap: JobSnapshot | None = None
        self._changed, self._since, self._read_at = True, 0, 0.0
        self._progressed: dict[str, KV] = {}  # progress puts the watch delivered since
        self._lock = threading.Lock()
        self._cancels = [js.store.watch_prefix(js.keys.prefix, self._poke),
                         js.store.watch_prefix(js.keys.events_prefix, self._poke),
                         js.store.watch_prefix(js.keys.progress_prefix, self._poke, on_kvs=self._on_progress)]

    def _poke(self) -> None:
        self._changed = True
        self.wake.set()

    def _on_progress(self, changes: list[tuple[KV, bool]]) -> None:
        with self._lock:
            self._progressed.update((kv.key, kv) for kv, deleted in changes if not deleted)

    def read(self) -> tuple[JobSnapshot, list]:
        """The job now, and its events since the last read."""
        with self._lock:
            kvs = list(self._progressed.values())
            self._progressed.clear()
        if self._changed or self.snap is None or time.monotonic() - self._read_at >= SAFETY_READ:
            self._changed = False  # cleared first: an event during the reads reads again
            self.snap, self._read_at = self.js.snapshot(), time.monotonic()
            new, self._since = self.js.events_since(self._since)
            return self.snap, new
        if kvs:
            self.snap = self.js.with_progress(self.snap, kvs)
        return self.snap, []

    def close(self) -> None:
        for cancel in self._cancels:
            cancel()
        self.wake.close()


def _watch(js: JobStore, spec: JobSpec, out: TextIO, timeout: float | None,
           embedded_dir: Path | None = None, exited: Callable[[], dict[str, str]] | None = None) -> str:
    """Print the job's new events and a progress line until it ends; its final state. Woken by
    watches on the job's keys and events. ``exited``: {node: last log line} of our dead agents."""
    start, last_line, tty, shown, last_epoch = time.monotonic(), "", out.isatty(), 0, 0
    alarm = ""  # etcd's alarm last said (a full etcd answers reads: the job would look stuck, silently)
    printed, alarm_read, advanced = start - LOG_EVERY, -ALARM_EVERY, start
    feed = _Feed(js)
    try:
        while True:
            try:
                snap, new = feed.read()
                for ev in new:
                    first_placement = ev.kind == EventKind.ASSIGNED and snap.epoch <= 1 and ev.data.get("epoch") == 1
                    if ev.kind in WATCHED and not first_placement:
                        ts = time.strftime("%H:%M:%S", time.localtime(ev.time))
                        print(("\r" if tty else "") + f"{ts} {ev.kind:<10} {ev.message}", file=out, flush=True)
                if snap.state.terminal:
                    return snap.state.value
                _report_exited_agents(js, snap, exited)
                line, done = _progress_line(snap, spec.steps, shown)
                if done > shown:
                    advanced = time.monotonic()
                stalled, shown = time.monotonic() - advanced >= STALLED_AFTER, done
                # a job making progress has no alarm worth a request each round; a stalled one may
                # (a full etcd answers reads: the job would look stuck, silently)
                if stalled or time.monotonic() - alarm_read >= ALARM_EVERY:
                    said, alarm, alarm_read = alarm, etcd_alarm(js.store), time.monotonic()
                else:
                    said = alarm
                if alarm and alarm != said:
                    print(("\n" if tty else "") + alarm, file=out, flush=True)
                if tty:
                    print("\r" + line.ljust(70), end="", file=out, flush=True)
                elif line != last_line and (time.monotonic() - printed >= LOG_EVERY or snap.epoch != last_epoch):
                    print(line, file=out, flush=True)  # a log: every 5 s, and as a new world starts
                    last_line, last_epoch, printed = line, snap.epoch, time.monotonic()
            except StoreError as e:
                print(f"(etcd: {e}; retrying)", file=out)
            if embedded_dir is not None:
                embedded.ensure_controller(embedded_dir, log=lambda m: print(m, file=out))
            if timeout and time.monotonic() - start > timeout:
                js.request_cancel()
                raise CliError(f"job {spec.name} did not finish within --timeout {timeout:.0f}s; cancelled it")
            feed.wake.wait(REDRAW_EVERY if tty else LOG_EVERY)
    finally:
        feed.close()


def _allocation_over(args: argparse.Namespace, rec: dict) -> int | None:
    """A job with its own etcd: once the scheduler says its allocation is over (and its etcd
    with it), the answer is what it left behind (None: not over)."""
    backend = launcher(rec["backend"])
    if not backend.ended(rec["info"]):
        return None
    final = final_status(rec)
    if final is None:  # e.g. cancelled, or killed at its time limit, before it could write one
        print(f"job {args.job} did not succeed: {backend.describe(rec['info'])}, and it left no "
              f"{rec['output_dir']}/final-status.json; see the logs in {rec['output_dir']}/logs", flush=True)
        return 1
    print(f"job {args.job} {final['state']}" + (f": {final['message']}" if final.get("message") else "")
          + " (its allocation has ended)", flush=True)
    return 0 if final["state"] == "succeeded" else 1


def cmd_wait(args: argparse.Namespace) -> int:
    rec = launched(args, args.job)
    js = None if rec else JobStore(connect(args, endpoints(args)), args.job)
    start, said, checked = time.monotonic(), False, 0.0
    while True:
        try:
            if js is None:
                eps = job_endpoints(args, args.job)  # CliError while its etcd is not up yet
                js = JobStore(connect(args, eps), args.job)
            if js.exists():
                snap = js.snapshot(progress=False)
                state, msg = snap.state, snap.state_message
                if state.terminal:
                    print(f"job {args.job} {state.value}" + (f": {msg}" if msg else ""), flush=True)
                    if snap.state_error:
                        print(status.error_excerpt(snap.state_error), flush=True)
                    return 0 if state.value == "succeeded" else 1
            elif not said:
                print(f"waiting for job {args.job} to be registered", flush=True)
                said = True
        except (StoreError, CliError) as e:
            if rec is not None and time.monotonic() - checked >= 5:  # ask the scheduler now and then
                checked = time.monotonic()
                rc = _allocation_over(args, rec)
                if rc is not None:
                    return rc
            if rec is None and isinstance(e, CliError):
                raise
            print(f"(etcd: {e}; retrying)", flush=True)
        if args.timeout and time.monotonic() - start > args.timeout:
            raise CliError(f"job {args.job} not finished after --timeout {args.timeout:.0f}s")
        time.sleep(1.0)


def cmd_cancel(args: argparse.Namespace) -> int:
    rec = launched(args, args.job)
    try:
        js = jobstore(args)
        js.request_cancel()
        print(f"cancellation of {args.job} requested; agents stop their workers within a second")
    except CliError as e:
        if rec is None:
            raise
        print(f"could not reach the job's etcd ({e}); cancelling through {rec['backend']} only")
    if rec is not None:
        said = launcher(rec["backend"]).cancel(rec["info"])
        if said:
            print(said)
    return 0


# -- flags ------------------------------------------------------------------------------------
def _spec_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("spec", help="job spec YAML (see configs/)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a spec field, e.g. --set ranks=8 --set args.lr=0.1")
    sp.add_argument("--no-check", action="store_true",
                    help="do not check the entrypoint before starting (by default a subprocess imports "
                    "it and binds (session, **args), as a worker would); for a module importable only "
                    "on the cluster")


def _resume_argument(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--resume", action="store_true",
                    help="start from the newest complete persisted checkpoint of the previous run of this "
                    "job name (every rank at its step) instead of step 0; says so when there is none")


def _submit_arguments(sp: argparse.ArgumentParser) -> None:
    _spec_arguments(sp)
    _resume_argument(sp)
    sp.add_argument("--dry-run", action="store_true",
                    help="validate, print the resolved spec (as # comments) and what would be launched, "
                    "submit nothing; for kubernetes only the objects are not comments: pipe into "
                    "`kubectl apply -f -`")


def _run_arguments(sp: argparse.ArgumentParser) -> None:
    _spec_arguments(sp)
    _resume_argument(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
    sp.add_argument("--timeout", type=float, help="cancel the job if not done after this many seconds")
    sp.add_argument("--detach", action="store_true",
                    help="submit, say how to follow the job, and return at once (exit 0): for scripts")


def _wait_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job")
    sp.add_argument("--timeout", type=float, help="give up (exit 2) after this many seconds")


def _job_argument(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job")


_SUBMIT = "submit a job and return"
_RUN = "submit a job, watch it live, print a summary; exit 1 if it failed"
_RUN_MORE = (". Ctrl-C cancels the job and waits until it stopped (a second Ctrl-C stops waiting; "
             "`hotspare wait JOB` follows it again); --detach returns after submitting")
_STARTS_EMBEDDED = ". Brings the embedded cluster up if the spec uses it and none is running."

COMMANDS = [
    Command("submit", cmd_submit, _SUBMIT, _SUBMIT + _STARTS_EMBEDDED, _submit_arguments),
    Command("run", cmd_run, _RUN, _RUN + _RUN_MORE + _STARTS_EMBEDDED, _run_arguments),
    Command("wait", cmd_wait, "block until a job finishes; exit 0 if it succeeded, 1 if not",
            "Block until JOB is succeeded, failed or cancelled (waiting for it to be registered "
            "first). For batch scripts: exit 0 if it succeeded, 1 otherwise.", _wait_arguments),
    Command("cancel", cmd_cancel, "cancel a job: its agents stop the workers and exit",
            arguments=_job_argument),
]
