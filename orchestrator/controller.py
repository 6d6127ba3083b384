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
    Failure,
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

log = logging.getLogger("hotspare.controller")

CONTROLLER_NODE = CONTROLLER  # deprecated alias: chaos commands for the leader controller


class Controller:
    def __init__(
        self,
        store: Store,
        *,
        ttl: float = 3.0,
        job: str | None = None,
        ident: str | None = None,
        interval: float = 0.5,
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

    # -- leadership -----------------------------------------------------------------------
    def _ensure_lease(self) -> Lease:
        if self._lease is None or self._lease.lost.is_set():
            self._lease = self.store.lease(self.ttl)
        return self._lease

    def lead(self, js: JobStore) -> bool:
        """True if we hold (or just took) the job's leader key."""
        leading, took = js.try_lead(self.ident, self._ensure_lease())
        if took:
            log.info("leading job %s as %s", js.job, self.ident)
            js.put_event(events.leader(self.ident))
        return leading

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # -- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        cancel = self.store.watch_prefix("/hotspare/", self._wake.set)
        try:
            while not self._stop.is_set():
                try:
                    for job in self._jobs():
                        self.reconcile_once(job)
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
        if snap.state.terminal:
            self._finished.add((job, snap.run_id))
            return None
        if not self.lead(js):
            return None
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
