"""The controller: leader election and a reconcile loop around :func:`decide`.

Like Patroni's HA loop: read the job at one revision, call the pure ``decide``, log the
decision's sentence (when it changes) and apply it through :class:`JobStore`'s verbs in one
transaction fenced on (a) the epoch key's revision we read and (b) our leadership. A stale controller, or one that lost its
lease, can never write a world. A standby controller takes a job over once the leader's
key expires (one lease TTL).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

from . import chaos
from .decide import Action, Decision, Loss, decide
from .failure_guards import new_failures
from .store import (
    CONTROLLER,
    Event,
    EventKind,
    Failure,
    JobKeys,
    JobSnapshot,
    JobState,
    JobStore,
    Lease,
    LeaseLost,
    Store,
    StoreError,
    StoreUnavailable,
    events,
    last_line,
    list_runs,
)
from .store.records import BadRecord

log = logging.getLogger("hotspare.controller")

CONTROLLER_NODE = CONTROLLER  # deprecated alias: chaos commands for the leader controller


#: Seconds between reconcile rounds when no watch event came. Every decision input under a
#: job's prefix (node keys expiring, reports, done marks, chaos, cancel, the leader key) wakes
#: the controller through its watch; what this bounds is the latency of a lost watch event
#: and of straggler scoring, which reads progress records outside the prefix.
SAFETY_INTERVAL = 10.0


class Controller:
    def __init__(
        self,
        store: Store,
        *,
        ttl: float = 3.0,
        job: str | None = None,
        ident: str | None = None,
        interval: float = SAFETY_INTERVAL,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.only_job = job
        self.ident = ident or f"{socket.gethostname()}:{os.getpid()}"
        self.interval = interval
        self._lease: Lease | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._said: dict[str, str] = {}  # job -> last decision sentence logged (log on change)
        self._waiting: dict[str, str] = {}  # job -> last wait reason written as an event
        # (job, run id) of every run seen ending: never read again. Keyed on the run, not the
        # name: a finished job's name may be submitted again, and the new run is served
        self._finished: set[tuple[str, str]] = set()
        self._runs: dict[str, str] = {}  # job -> run id last reconciled (per-run memory above)
        self._trouble: dict[str, str] = {}  # job -> the error its last cycle failed with (logged once)
        self._bad_said: dict[str, set[tuple[str, str]]] = {}  # job -> (key, error) of skipped records reported

    # -- leadership -----------------------------------------------------------------------
    def _ensure_lease(self) -> Lease:
        if self._lease is None or self._lease.lost.is_set():
            self._lease = self.store.lease(self.ttl)
        return self._lease

    def lead(self, js: JobStore, seen: JobSnapshot | None = None) -> bool:
        """True if we hold (or just took) the job's leader key (``seen``: as a snapshot just
        read says, without reading the key again)."""
        leading, took = js.try_lead(self.ident, self._ensure_lease(), seen)
        if took:
            log.info("leading job %s as %s", js.job, self.ident)
            js.put_event(events.leader(self.ident))
        return leading

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # -- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        # one job: watch its keys only (an etcd role limited to them is enough, security F4)
        cancel = self.store.watch_prefix(JobKeys(self.only_job).prefix if self.only_job else "/hotspare/", self._wake.set)
        try:
            while not self._stop.is_set():
                try:
                    for job in self._jobs():
                        self._reconcile_guarded(job)
                except StoreUnavailable as e:
                    log.warning("etcd unavailable (%s); retrying", e)
                    time.sleep(0.5)
                except LeaseLost:
                    self._lease = None
                except StoreError as e:
                    log.warning("store error: %s", e)
                except Exception:  # noqa: BLE001 - a bug in one cycle must not kill the controller
                    log.exception("reconcile cycle failed; retrying")
                    time.sleep(0.5)
                self._wake.wait(self.interval)
                self._wake.clear()
        finally:
            cancel()
            if self._lease is not None:
                self._lease.revoke()

    def _reconcile_guarded(self, job: str) -> None:
        """One cycle for one job, in a try of its own: whatever one job's records make it
        raise (a record that does not parse, a decision that fails), the jobs after it are
        still reconciled. etcd being unavailable or our lease lost concern every job: they
        end the round."""
        try:
            self.reconcile_once(job)
            self._trouble.pop(job, None)
        except (StoreUnavailable, LeaseLost):
            raise
        except StoreError as e:
            log.warning("[%s] store error: %s", job, e)
        except Exception as e:  # noqa: BLE001 - one job's bad records must not stop the others
            self._job_failed(job, e)

    def _job_failed(self, job: str, e: Exception) -> None:
        """Log a job's failed cycle and put it on the job's timeline, once while it lasts
        (the cycle runs twice a second); only a controller that leads the job writes it."""
        what = f"{type(e).__name__}: {e}"
        if self._trouble.get(job) == what:
            return
        self._trouble[job] = what
        log.error("[%s] cannot reconcile this job (%s); the other jobs go on", job, what,
                  exc_info=not isinstance(e, BadRecord))
        try:
            js = JobStore(self.store, job)
            if self.lead(js):
                js.event(EventKind.RECONCILE_FAILED, events.CONTROLLER_SOURCE,
                         f"the controller cannot reconcile job {job}: {what}",
                         error=what, **({"key": e.key} if isinstance(e, BadRecord) else {}))
        except StoreError as err:
            log.warning("[%s] could not record it on the job's timeline: %s", job, err)

    def _report_bad_records(self, js: JobStore, snap: JobSnapshot) -> None:
        """Put each record the snapshot skipped (it does not parse) on the job's timeline,
        once per record and error."""
        said = self._bad_said.setdefault(js.job, set())
        for key, error in snap.bad.items():
            if (key, error) in said:
                continue
            try:  # the decision must not wait on this line: a failed write is retried next cycle
                js.event(EventKind.BAD_RECORD, events.CONTROLLER_SOURCE,
                         f"skipped record {key}: it does not parse ({error})", key=key, error=error)
            except StoreError as e:
                log.warning("[%s] could not record the skipped record %s: %s", js.job, key, e)
                return
            said.add((key, error))

    def _jobs(self) -> list[str]:
        if self.only_job:
            return [self.only_job]
        return [j for j, run in list_runs(self.store).items() if (j, run) not in self._finished]

    def reconcile_once(self, job: str) -> Decision | None:
        """One cycle for one job. Returns the decision, or None if we are not the leader."""
        js = JobStore(self.store, job)
        snap = js.snapshot()
        snap.now = time.time()  # the failure-rate guard's clock (decide itself reads none)
        if snap.spec is None:
            return None
        if self._runs.get(job) != snap.run_id:  # a new submission of the name: start afresh
            self._runs[job] = snap.run_id
            self._said.pop(job, None)
            self._waiting.pop(job, None)
            self._bad_said.pop(job, None)
        if snap.state.terminal:
            self._finished.add((job, snap.run_id))
            return None
        if not self.lead(js, snap):
            return None
        if snap.bad:
            self._report_bad_records(js, snap)
        if snap.chaos.get(CONTROLLER):
            self._chaos(js)
        decision = decide(snap)
        if self._said.get(job) != decision.reason:
            self._said[job] = decision.reason
            log.info("[%s] %s", job, decision)
        self.apply(js, snap, decision)
        return decision

    def _chaos(self, js: JobStore) -> None:
        """Carry out the chaos commands sent to the leader controller (kill-controller: die
        at once, like a crashed machine, so that a standby takes over)."""
        for cmd in js.take_chaos(CONTROLLER):
            action = chaos.ACTIONS.get(cmd.get("action", ""))
            if action is None or action.executor is not chaos.Executor.CONTROLLER:
                continue
            js.put_event(events.chaos(self.ident, f"{action.name}: leader {self.ident} dies",
                                      action.name, controller=self.ident))
            log.warning("chaos: %s; dying now", action.name)
            os.kill(os.getpid(), signal.SIGKILL)

    # -- applying -------------------------------------------------------------------------
    def apply(self, js: JobStore, snap: JobSnapshot, d: Decision) -> bool:
        """Carry out ``d`` in etcd, fenced on ``snap`` and our leadership. False when the
        store refused it (the state moved on, or we no longer lead): the next cycle re-reads."""
        if d.action in (Action.NONE, Action.WAIT):
            self._clear(js, snap, d)
            if d.action is Action.WAIT and self._waiting.get(js.job) != d.reason:
                self._waiting[js.job] = d.reason
                js.put_event(events.waiting(d.reason))
            return True
        if d.world is not None:
            return self._commit_world(js, snap, d)
        state = d.final_state
        if state is not None:
            ok = js.set_state(state, d.reason, leader=self.ident, clear_reports=d.clear_reports,
                              error=d.error, failures=self._history(snap, d))
            if ok:
                for lo in d.losses:  # what failed the job, with its step and what it raised
                    js.put_event(_failure_event(lo, snap.epoch, None, time.time(), ended_job=True))
                js.put_event(events.final(state.value, d.reason))
                self._finished.add((js.job, snap.run_id))
            return ok
        return False

    @staticmethod
    def _history(snap: JobSnapshot, d: Decision) -> tuple[Failure, ...] | None:
        """The failure history with the losses ``d`` handles added (what the guards count),
        or None when it handles none (the history is left as it is)."""
        if not d.losses or snap.world is None:
            return None
        return snap.failures + new_failures(snap, snap.world, d.losses)

    def _clear(self, js: JobStore, snap: JobSnapshot, d: Decision) -> None:
        """Stale reports go without a new world; a failed delete is retried next cycle."""
        try:
            js.clear_reports(snap, d.clear_reports, leader=self.ident)
        except StoreError:
            pass

    def _commit_world(self, js: JobStore, snap: JobSnapshot, d: Decision) -> bool:
        assert d.world is not None
        now = time.time()
        ok = js.commit_decision(
            snap, d.world, leader=self.ident, clear_reports=d.clear_reports,
            state=JobState.RUNNING if d.action is Action.PLACE else None,
            failures=self._history(snap, d),
        )
        if not ok:
            log.info("[%s] decision lost a race (state changed); will re-read", js.job)
            return False
        for ev in self._events_for(d, now):
            js.put_event(ev)
        return True

    @staticmethod
    def _events_for(d: Decision, now: float) -> Iterator[Event]:
        """What the timeline needs about a new world: the failures it handles (each with
        when it was seen), then the decision made at ``now``. A generator: each event is
        stamped as it is written."""
        assert d.world is not None
        if d.action is Action.PLACE:
            yield events.placed(d.reason, d.world.epoch, [s.node for s in d.world.seats])
            return
        for i, lo in enumerate(d.losses):
            yield _failure_event(lo, d.world.epoch, d.spares[i] if i < len(d.spares) else None, now)
        yield events.decided(d.action, d.reason, d.world.epoch, list(d.world.lost),
                             list(d.spares), now)


def _failure_event(lo: Loss, epoch: int, spare: str | None, now: float, ended_job: bool = False) -> Event:
    """The timeline's line about one handled loss: when it was seen, the step it was at, and
    the last line of what the code raised, if it did."""
    return events.failure(lo.rank, lo.node, lo.kind, lo.detail, epoch, spare, lo.detected or now,
                          step=lo.step, error=last_line(lo.traceback), ended_job=ended_job)
