"""The controller: leader election and a reconcile loop around :func:`decide`.

Like Patroni's HA loop: read the job at one revision, call the pure ``decide``, apply the
decision in one transaction fenced on (a) the epoch key's revision we read and (b) our
leadership, then log the decision's sentence. A stale controller, or one that lost its
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

from .decide import Decision, decide
from .store import (
    CONTROLLER,
    Compare,
    EventKind,
    JobSnapshot,
    JobStore,
    LeaseLost,
    StateRecord,
    Store,
    StoreError,
    StoreUnavailable,
    list_jobs,
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
        self._lease = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._said: dict[str, str] = {}  # job -> last decision sentence (log on change)
        self._finished: set[str] = set()

    # -- leadership -----------------------------------------------------------------------
    def _ensure_lease(self):
        if self._lease is None or self._lease.lost.is_set():
            self._lease = self.store.lease(self.ttl)
        return self._lease

    def lead(self, js: JobStore) -> bool:
        """True if we hold (or just took) the job's leader key."""
        leading, took = js.try_lead(self.ident, self._ensure_lease())
        if took:
            log.info("leading job %s as %s", js.job, self.ident)
            js.event(EventKind.LEADER, self.ident, f"controller {self.ident} leads", controller=self.ident)
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
        return [j for j in list_jobs(self.store) if j not in self._finished]

    def reconcile_once(self, job: str) -> Decision | None:
        """One cycle for one job. Returns the decision, or None if we are not the leader."""
        js = JobStore(self.store, job)
        snap = js.snapshot()
        if snap.spec is None:
            return None
        if snap.state.terminal:
            self._finished.add(job)
            return None
        if not self.lead(js):
            return None
        if snap.chaos.get(CONTROLLER_NODE):
            for cmd in js.take_chaos(CONTROLLER_NODE):
                if cmd.get("action") == "kill-controller":
                    js.event("chaos", self.ident, f"kill-controller: leader {self.ident} dies",
                             action="kill-controller", controller=self.ident)
                    log.warning("chaos: kill-controller; dying now")
                    os.kill(os.getpid(), signal.SIGKILL)
        decision = decide(snap)
        if self._said.get(job) != decision.reason:
            self._said[job] = decision.reason
            log.info("[%s] %s", job, decision)
        self.apply(js, snap, decision)
        return decision

    # -- applying -------------------------------------------------------------------------
    def _fence(self, js: JobStore, snap: JobSnapshot) -> list[Compare]:
        epoch_guard = (
            Compare(js.keys.epoch, "mod", "==", snap.epoch_mod)
            if snap.epoch_mod
            else Compare(js.keys.epoch, "create", "==", 0)
        )
        return [epoch_guard, Compare(js.keys.leader, "value", "==", self.ident.encode())]

    def apply(self, js: JobStore, snap: JobSnapshot, d: Decision) -> bool:
        now = time.time()
        reports = [js.keys.report(n, r) for n, r in d.clear_reports]
        if d.action in ("none", "wait"):
            if reports:
                try:
                    self.store.txn(self._fence(js, snap), deletes=reports)
                except StoreError:
                    pass
            if d.action == "wait" and self._said.get(job_wait := f"wait:{js.job}") != d.reason:
                self._said[job_wait] = d.reason
                js.event("waiting", "controller", d.reason)
            return True
        if d.world is not None:
            puts = {
                js.keys.epoch: str(d.world.epoch),
                js.keys.world(d.world.epoch): d.world.to_json(),
            }
            if d.action == "place":
                puts[js.keys.state] = StateRecord("running", now).to_json()
            ok = self.store.txn(self._fence(js, snap), puts=puts, deletes=reports)
            if not ok:
                log.info("[%s] decision lost a race (state changed); will re-read", js.job)
                return False
            self._events_for(js, d, now)
            return True
        state = d.final_state
        if state is not None:
            ok = js.set_state(state, d.reason, leader=self.ident, clear_reports=reports)
            if ok:
                js.event(state.value, "controller", d.reason)
                self._finished.add(js.job)
            return ok
        return False

    def _events_for(self, js: JobStore, d: Decision, now: float) -> None:
        assert d.world is not None
        if d.action == "place":
            js.event("placed", "controller", d.reason, epoch=d.world.epoch,
                     seats=[s.node for s in d.world.seats])
            return
        for i, lo in enumerate(d.losses):
            js.event(
                "failure",
                "controller",
                f"rank {lo.rank} on {lo.node}: {lo.detail}",
                rank=lo.rank,
                node=lo.node,
                kind=lo.kind,
                epoch=d.world.epoch,
                spare=d.spares[i] if i < len(d.spares) else None,
                detected=lo.detected or now,
            )
        js.event(
            d.action,
            "controller",
            d.reason,
            epoch=d.world.epoch,
            lost=list(d.world.lost),
            spares=list(d.spares),
            decided=now,
        )
