"""One agent per node: lease, warm workers, assignment, supervision, watchdog, chaos.

The agent never decides anything about the job: it registers its node under a lease,
keeps ``slots`` warm workers, hands a worker the rank the controller's world gives this
node, reports a worker's death within a poll interval (0.1 s), kills a worker whose
heartbeat stalls past ``hang_timeout``, and executes chaos commands addressed to it.

Everything here runs on the agent's main thread. The background services (replica server,
replicator, persister: :mod:`hotspare.agents.node_services`) run on threads of their own and see the
agent's state only as the :class:`~hotspare.agents.node_view.NodeView` the loop publishes. The
workers' life cycle and exit classification are in :mod:`hotspare.agents.node_workers`, the chaos
side effects in :mod:`hotspare.agents.node_chaos`.

The agent installs no signal handler: its process entry point (``hotspare agent``) turns
SIGTERM into :meth:`Agent.stop`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import traceback
import uuid
from dataclasses import replace
from pathlib import Path

from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.store import (
    EventKind,
    JobSnapshot,
    JobStore,
    Lease,
    LeaseLost,
    Node,
    Store,
    StoreError,
    World,
)
from hotspare.orchestrator.store.records import AGENT_FAILED, BadRecord, Report, traceback_tail
from hotspare.orchestrator.util import Waker

from .job_follower import JobFollower
from .node_chaos import NodeChaos
from .node_services import (
    NodeServices,
    buddies_key,
    ring_buddies,
    ring_successors,
    sweep_stale_run_dirs,
)
from .node_view import Buddy
from .node_workers import (
    OomCounter,
    WorkerProc,
    WorkerState,
    follow_held,
    heartbeat_path,
    spawn_worker,
    stop_workers,
    worker_base_env,
)
from .worker_link import (
    EXIT_STARTUP_ERROR,
    STATE_NAMES,
    WARM,
    Assignment,
    SpecTampered,
    WorkerEnv,
    default_etcd_outage_limit,
    pin_spec,
    wait_for_spec,
)
from .zygote import Zygote, zygote_for_agent

#: the agent's exit code when the job's spec in etcd is not the one its launcher submitted
EXIT_SPEC_TAMPERED = 4

__all__ = ["POLL", "Agent", "WorkerProc", "ring_buddies", "sweep_stale_run_dirs"]

log = logging.getLogger("hotspare.agent")

#: The loop's shortest sleep: a retry (a report etcd refused) and stopping the workers.
#: Nothing on the steady path runs on it: the loop sleeps until something happens (a watch
#: event, a worker's exit or ring, a lost lease, a signal) or a deadline it knows is due.
POLL = 0.1
#: Read the job this often even with no watch event: a lost watch costs this much latency.
SAFETY_READ = 30.0


class Agent:
    """The node agent of one job on one node; :meth:`run` is its whole life."""

    def __init__(
        self,
        store: Store,
        job: str,
        node: str,
        *,
        role: str = "active",
        slots: int | None = None,
        host: str = "127.0.0.1",
        wait_for_job: float = 120.0,
        env_for_workers: dict[str, str] | None = None,
        run_id: str | None = None,
        etcd_outage_limit: float | None = None,
        zygote: str | None = None,
        spec_digest: str | None = None,
    ) -> None:
        self.store = store
        self.js = JobStore(store, job)
        self.job = job
        self.node = node
        self.role = role
        self.host = host
        self._slots = slots
        self.wait_for_job = wait_for_job
        self.worker_env = dict(env_for_workers or {})
        self.workers: dict[int, WorkerProc] = {}
        self._wake = Waker()  # set by watches, exits, rings, a lost lease, stop() (signal-safe)
        self.follow = JobFollower(self.js, node, self._wake.set)  # watches: what changed in the job
        self._retry = False  # something failed and must be tried again soon (a report)
        self._buddies_of: tuple[tuple | None, list[Buddy]] = (None, [])  # (buddies_key, buddies) last read
        self._stopping = False
        self.incarnation = ""
        self._lease: Lease | None = None
        self._published_warm = -1
        self._lost_here: dict[int, int] = {}  # sid -> epoch its worker died here in
        self._oom = OomCounter()  # the cgroup's OOM kill counter: tells an OOM kill from a SIGKILL
        #: the submission this agent serves: given (the launcher knows it), else the spec's
        self.run_id = run_id or ""
        self._want_run = run_id
        #: the spec's digest as submitted (JobSpec.digest), when the launcher gives it: a spec in
        #: etcd that differs was changed by someone with write access to etcd, and is refused
        self._want_digest = spec_digest or os.environ.get("HOTSPARE_SPEC_SHA256") or None
        self._outage_limit = etcd_outage_limit  # None: default_etcd_outage_limit(lease_ttl)
        self._etcd_seen = time.monotonic()  # when etcd last answered the loop
        self._trouble = ""  # what last kept the loop from following the job (logged once)
        self._unreported = ""  # the last exit report etcd refused, and why (logged once)
        #: where warm workers come from (:mod:`hotspare.agents.zygote`): None, a zygote of our
        #: own; a socket path, a shared one; "off", none (every worker imports torch itself)
        self._zygote_at = zygote
        self.zygote: Zygote | None = None
        # known once the job's spec is read (run -> _start)
        self.spec: JobSpec
        self.slots: int
        self.hang_timeout: float
        self.log_dir: Path
        self.services: NodeServices
        self.chaos: NodeChaos

    # -- life cycle -----------------------------------------------------------------------
    def run(self) -> int:
        try:
            spec = wait_for_spec(self.js, self._want_run, self._want_digest, self.wait_for_job)
        except SpecTampered as e:
            log.error("%s", e)
            return EXIT_SPEC_TAMPERED
        if spec is None:
            log.error("job %s not found in etcd after %.0fs; giving up", self.job, self.wait_for_job)
            return 2  # what launchers have always seen for a job that never appeared
        try:
            self._start(spec)
            self._register()
        except Exception as e:
            self._report_startup_failure(e)
            raise
        self._etcd_seen = time.monotonic()
        self.follow.start()
        for slot in range(self.slots):  # an active node's first workers take their seats at once
            self._spawn(slot, prewarm=self.role == "spare")
        try:
            return self._loop()
        finally:
            self.follow.stop()
            self._shutdown()

    def _report_startup_failure(self, e: Exception) -> None:
        """Tell the controller this node's agent could not start (a rank -1 report of kind
        ``agent``, with the traceback): before the first world the job fails with it instead
        of waiting for this node forever. Best effort: etcd may be what failed."""
        what = f"{type(e).__name__}: {e}"
        # the traceback in the log before the report: once the job fails on it, its log is read
        log.exception("the agent could not start: %s", what)
        e.hotspare_logged = True  # type: ignore[attr-defined] - the CLI does not print it again
        rep = Report(node=self.node, rank=-1, epoch=0, kind=AGENT_FAILED, time=time.time(), message=what,
                     traceback=traceback_tail(traceback.format_exc()))
        try:
            self.js.report(rep)
        except StoreError as err:
            log.error("could not report that to etcd either: %s", err)

    def stop(self) -> None:
        """Leave: :meth:`run` stops the workers, the services and the lease, then returns.
        Safe in a signal handler: a flag and one byte down the loop's wake-up pipe (no lock
        the interrupted loop could hold)."""
        self._stopping = True
        self._wake.set()

    @property
    def run_dir(self) -> Path:
        return self.services.run_dir

    def _start(self, spec: JobSpec) -> None:
        """Everything the job's spec decides, built in one place before any worker starts."""
        self.spec = spec
        self.run_id = spec.run_id
        if self._outage_limit is None:
            self._outage_limit = default_etcd_outage_limit(spec.lease_ttl)
        self.slots = self._slots or spec.ranks_per_node
        self.hang_timeout = spec.hang_timeout
        self.log_dir = spec.log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services = NodeServices(spec, job=self.job, node=self.node, secret=self.js.secret(),
                                     host=self.host, event=self._event).start()
        pin_spec(self.run_dir, spec)  # what every worker of this agent runs, never re-read from etcd
        self.chaos = NodeChaos(self.js, self.node, self.services, spec.lease_ttl)
        self.zygote = zygote_for_agent(self._zygote_at, worker_base_env(self.spec, self.worker_env),
                                       self.log_dir / f"zygote-{self.node}.log")
        if self.zygote is not None:
            self.zygote.on_exit = self._wake.set  # a worker's exit wakes the loop at once
        self.services.on_ring = self._wake.set  # a worker turned warm (or wrote a point)

    def _register(self) -> None:
        self.incarnation = uuid.uuid4().hex[:12]
        self._lease = self.store.lease(self.spec.lease_ttl)
        self._lease.on_lost = self._wake.set
        self._publish(force=True)
        self.js.event(
            EventKind.NODE_JOINED,
            self.node,
            f"agent {self.node} ({self.role}, {self.slots} slot(s)) registered",
            node=self.node,
            role=self.role,
            incarnation=self.incarnation,
        )
        log.info("registered %s as %s (incarnation %s)", self.node, self.role, self.incarnation)

    def _publish(self, force: bool = False) -> None:
        """Our node record in etcd (warm worker count included), when it changed."""
        warm = sum(1 for w in self.workers.values() if not w.holds_seat and w.hb.read()[0] == WARM)
        if not force and warm == self._published_warm:
            return
        self._published_warm = warm
        node = Node(
            name=self.node,
            incarnation=self.incarnation,
            role=self.role,
            slots=self.slots,
            host=self.host,
            replica_port=self.services.port,
            pid=os.getpid(),
            warm=warm,
        )
        assert self._lease is not None
        self.js.register_node(node, self._lease)

    def _publish_view(self, snap: JobSnapshot | None = None) -> None:
        """Publish what the services may know, in one swap: the live local seats, and from
        a fresh job snapshot the world, the ring buddies and the requested checkpoint."""
        view = replace(self.services.view(),
                       seats={w.sid: w.rank for w in self.workers.values() if w.holds_seat and w.alive})
        if snap is not None:
            view = replace(view, checkpoint=snap.checkpoint)
            world = snap.world
            if world is not None:
                buddies = self._buddies(world)
                view = replace(view, epoch=world.epoch, world_size=world.size, buddies=tuple(buddies))
        self.services.publish(view)

    def _buddies(self, world: World) -> list[Buddy]:
        """The ring successors that hold this node's replicas, from their own records: the
        next few of the ring are read (a live one is almost always among them), every
        successor only when too few of those are alive. Cached while those successors keep
        their seats (same node, same incarnation): a swap elsewhere in the ring reads nothing."""
        k = self.spec.replicas
        key = buddies_key(world, self.node, k)
        if self._buddies_of[0] == key:
            return self._buddies_of[1]
        after = ring_successors(world, self.node)
        found = ring_buddies(world, self.js.nodes(after[: 2 * k + 2]), self.node, k) if k > 0 else []
        if len(found) < k and len(after) > 2 * k + 2:
            found = ring_buddies(world, self.js.nodes(after), self.node, k)
        self._buddies_of = (key if len(found) == k else None, found)
        return found

    # -- main loop ------------------------------------------------------------------------
    def _loop(self) -> int:
        while not self._stopping:
            self._wake.wait(self._sleep_for(self.follow.read_at))
            if self.chaos.partitioned and not self.chaos.heal_if_due(self._lease):
                self._etcd_seen = time.monotonic()  # cut off on purpose: not an outage
                continue  # cut off: no etcd, no reports, no watchdog
            try:
                self._supervise()
                self._publish_view()
                if self._lease is not None and self._lease.lost.is_set():
                    self._fenced("lease lost")
                now = time.monotonic()
                full = now - self.follow.read_at >= SAFETY_READ or self._retry
                if full or self.follow.pending:
                    if self._follow_job(full):
                        return 0
                    self._etcd_seen = now
                    self._trouble = ""
                self._publish()
            except LeaseLost:
                self._fenced("lease lost")
            except StoreError as e:
                if self._etcd_gone():
                    return 1
                log.warning("etcd: %s (training continues; retrying)", e)
                self.follow.changed()  # read again after the pause
                time.sleep(0.5)
            except BadRecord as e:  # etcd answered, with a record of the job we cannot read
                self._etcd_seen = time.monotonic()
                self._survive(e)
            except Exception as e:  # noqa: BLE001 - a record we cannot act on must not end the node
                self._survive(e)
        return 0

    def _sleep_for(self, last_read: float) -> float:
        """How long the loop may sleep: until the next safety read of the job, the next
        watchdog look at an assigned worker's heartbeat (a quarter of ``hang_timeout``: a hang
        is caught within 1.25 x of it), a partition's heal, or a retry."""
        if self._retry or self.follow.pending:  # a report to retry, a watch fired, a read refused
            return POLL
        now = time.monotonic()
        t = last_read + SAFETY_READ - now
        if any(w.state is WorkerState.ASSIGNED for w in self.workers.values()):
            t = min(t, max(self.hang_timeout / 4, POLL))
        if self.chaos.partitioned:
            t = min(t, self.chaos.partitioned_until - now)
        return max(t, 0.0)

    def _survive(self, e: Exception) -> None:
        """The loop raised (a job record it cannot read or act on): log it, once while it
        lasts, and go on -- the workers keep training, the seats already held stay held, and the
        next read of the job tries again. Leaving would take this node's workers down with us
        because of one bad record in etcd (docs/security.md)."""
        what = f"{type(e).__name__}: {e}"
        if what != self._trouble:
            self._trouble = what
            log.error("cannot follow job %s (%s); training continues, retrying", self.job, what,
                      exc_info=not isinstance(e, BadRecord))

    def _etcd_gone(self) -> bool:
        """True (time to leave) once etcd has not answered for the outage limit: its job's
        controller cannot reach us either, and a cluster taken down must not leave us behind."""
        silent = time.monotonic() - self._etcd_seen
        if self._outage_limit is None or silent <= self._outage_limit:
            return False
        log.error("etcd unreachable for %.0fs (limit %.0fs, `hotspare agent --etcd-outage-limit`): "
                  "leaving; my workers stop with me", silent, self._outage_limit)
        return True

    def _follow_job(self, full: bool = True) -> bool:
        """Follow the job once (read it if ``full`` or a watch said so, else apply the world's
        change: :class:`JobFollower`): take the seats its world gives us, run chaos sent to us.
        True once our run is over (the agent leaves): it ended, was cancelled, or the job's
        records are gone or belong to a newer submission of the name."""
        snap = self.follow.read(full)
        over = ("removed from etcd" if snap.spec is None
                else f"now run {snap.run_id or '?'}, a new submission" if snap.run_id != self.run_id
                else snap.state.value if snap.state.terminal
                else "cancelled" if snap.cancel else "")
        if over:
            log.info("job %s (run %s) is %s; agent exiting", self.job, self.run_id or "?", over)
            return True
        self._assign(snap)
        self._publish_view(snap)
        if snap.chaos.get(self.node):
            for cmd in self.js.take_chaos(self.node):
                self.chaos.execute(cmd, list(self.workers.values()), self._lease)
        return False

    def _fenced(self, why: str) -> None:
        """Our node key is gone: the controller has (or will have) replaced our ranks."""
        log.warning("%s: killing assigned workers and re-registering", why)
        for w in list(self.workers.values()):
            if w.holds_seat:
                w.kill()
        self._register()

    def _event(self, kind: EventKind | str, message: str, **data: object) -> None:
        try:
            self.js.event(kind, self.node, message, node=self.node, **data)
        except StoreError as e:
            log.warning("event %s not recorded: %s", kind, e)

    # -- seats ----------------------------------------------------------------------------
    def _assign(self, snap: JobSnapshot) -> None:
        world = snap.world
        if world is None:
            return
        # seats are matched by sid: a shrink renumbers ranks but keeps each survivor's sid
        mine = {world.sid(r): r for r in world.ranks_on(self.node, self.incarnation)}
        held = {w.sid: w for w in self.workers.values() if w.holds_seat}
        follow_held(world, mine, held, self.node)
        for sid in sorted(set(mine) - set(held)):
            rank = mine[sid]
            if self._lost_here.get(sid, -1) >= world.seats[rank].since:
                continue  # its worker died here in this seat: the controller decides, not us
            if not self._take_seat(rank, sid, snap.epoch):
                return

    def _take_seat(self, rank: int, sid: int, epoch: int) -> bool:
        """Hand seat (rank, sid) to a free worker, a warm one first. False if none is free."""
        free = [w for w in self.workers.values() if not w.holds_seat and w.alive]
        if not free:
            log.warning("rank %d assigned to %s but no free worker slot", rank, self.node)
            return False
        free.sort(key=lambda w: w.hb.read()[0] != WARM)
        w = free[0]
        w.assign(rank, sid, epoch)
        self.services.replicator.forget(sid)
        warm = STATE_NAMES.get(w.hb.read()[0], "?")
        # the incarnation travels with the assignment: a warm worker spawned before a
        # re-registration (lease lost, partition healed) must carry the new one
        if not w.send(Assignment(rank=rank, epoch=epoch, sid=sid, incarnation=self.incarnation)):
            return True  # it just died; supervision will notice
        self.js.event(
            EventKind.ASSIGNED,
            self.node,
            f"rank {rank} -> {self.node} ({warm} worker pid {w.proc.pid}) at epoch {epoch}",
            rank=rank,
            node=self.node,
            epoch=epoch,
            warm=warm == "warm",
            pid=w.proc.pid,
        )
        return True

    # -- supervision ----------------------------------------------------------------------
    def _supervise(self) -> None:
        # the watchdog times silence on the monotonic clock: a wall-clock step (NTP, a VM
        # resumed) must not make every busy worker look hung; reports carry wall time
        mono, now = time.monotonic(), time.time()
        self._retry = False
        for slot, w in list(self.workers.items()):
            code = w.proc.poll()
            if code is None:
                if w.state is WorkerState.ASSIGNED:
                    w.watchdog(mono, self.hang_timeout)
                continue
            startup = code == EXIT_STARTUP_ERROR  # the job's code cannot start: no respawn loop
            if (w.holds_seat and code != 0) or startup:
                if not self._report_exit(w, code, now):
                    self._retry = True
                    continue  # keep the record; retry next poll
            elif not w.holds_seat:
                log.warning("warm worker pid %d exited with %s before assignment", w.proc.pid, code)
            if w.holds_seat:
                self._lost_here[w.sid] = w.epoch
            w.hb.close()
            del self.workers[slot]
            if startup:
                log.error("slot %d: the job's code cannot start here; no new worker in this slot", slot)
            elif not (w.holds_seat and code == 0):
                self._spawn(slot)

    def _report_exit(self, w: WorkerProc, code: int, now: float) -> bool:
        """Report a worker's failure to the controller; False if etcd refused. A worker whose
        job code could not start is reported for rank -1 (no seat is lost: the job cannot
        run anywhere), with its traceback."""
        rep = w.exit_report(self.node, code, now, oom=code == -signal.SIGKILL and self._oom.rose())
        rank, kind = rep.rank, rep.kind
        try:
            self.js.report(rep)
            self.js.event(EventKind.WORKER_EXIT, self.node, rep.message, rank=rank, node=self.node, kind=kind,
                          detected=now, exit_code=code, step=rep.step)
        except StoreError as e:
            if f"{rank} {e}" != self._unreported:  # retried every poll: said once while it lasts
                self._unreported = f"{rank} {e}"
                log.warning("could not report rank %d exit yet (retrying): %s", rank, e)
            return False
        log.warning("rank %d: %s", rank, rep.message)
        return True

    # -- workers --------------------------------------------------------------------------
    def _spawn(self, slot: int, prewarm: bool = True) -> None:
        env = worker_base_env(self.spec, self.worker_env)
        link = WorkerEnv(job=self.job, node=self.node, incarnation=self.incarnation,
                         hb=str(heartbeat_path(self.run_dir, slot)), log_dir=str(self.log_dir),
                         snap_dir=str(self.run_dir), agent_pid=os.getpid(),
                         threads=int(env.get("HOTSPARE_THREADS", "1")),  # the job's env may set it
                         prewarm=prewarm)
        w = self.workers[slot] = spawn_worker(slot, link, env, self.zygote)
        if isinstance(w.proc, subprocess.Popen):  # a forked worker's exit comes from the zygote
            threading.Thread(target=self._wake_on_exit, args=(w.proc,), name=f"exit-{w.proc.pid}",
                             daemon=True).start()
        if self.zygote is not None and self.zygote.lost:
            log.warning("zygote %s lost (%s): workers start as their own processes from now on",
                        self.zygote.path, self.zygote.lost)
            self.zygote.close()
            self.zygote = None

    def _wake_on_exit(self, proc: subprocess.Popen) -> None:
        """Block until ``proc`` exits, then wake the loop (no supervision poll)."""
        try:
            proc.wait()
        finally:
            self._wake.set()

    def _shutdown(self) -> None:
        stop_workers(self.workers.values())
        if self.zygote is not None:
            self.zygote.close()
        self.services.stop()
        if self._lease is not None:
            try:
                self.js.deregister_node(self.node)
            except StoreError:
                pass
            self._lease.revoke()
        self.services.remove_run_dir()
