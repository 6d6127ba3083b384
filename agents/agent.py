"""One agent per node: lease, warm workers, assignment, supervision, watchdog, chaos.

The agent never decides anything about the job: it registers its node under a lease,
keeps ``slots`` warm workers, hands a worker the rank the controller's world gives this
node, reports a worker's death within a poll interval (0.1 s), kills a worker whose
heartbeat stalls past ``hang_timeout``, and executes chaos commands addressed to it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from orchestrator.store import (
    JobStore,
    LeaseLost,
    Node,
    Report,
    Store,
    StoreError,
)

from .heartbeat import RUNNING, STATE_NAMES, WARM, Heartbeat
from .persist import Persister
from .replica import ReplicaServer, ReplicaStore, Replicator
from .worker import EXIT_UNRECOVERABLE, fatal_path

log = logging.getLogger("hotspare.agent")

POLL = 0.1  # worker supervision period: a worker death is reported within this


def store_from_env(env: dict[str, str] | None = None) -> Store:
    """The etcd connection a hotspare process inherits through its environment
    ($HOTSPARE_ETCD and the TLS/auth variables of :data:`orchestrator.store.ENV_OPTIONS`)."""
    return Store.from_env(env=env)


def sweep_stale_run_dirs(base: Path) -> None:
    """Remove snapshot directories of agents that died without cleaning up (SIGKILL, node
    loss): their shared memory would otherwise stay allocated until reboot."""
    import shutil

    for d in base.glob("hotspare-*"):
        pid = d.name.rsplit("-", 2)[-2] if d.name.count("-") >= 3 else ""
        if d.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def ring_buddies(world, nodes: dict, me: str, k: int) -> list[tuple[str, str, int]]:
    """The ``k`` nodes after ``me`` in ring order (nodes of the world, in seat order) that
    hold this node's replicas; never this node itself."""
    ring: list[str] = []
    for seat in world.seats:
        if seat.node not in ring:
            ring.append(seat.node)
    if me not in ring or k <= 0:
        return []
    i = ring.index(me)
    out = []
    for j in range(1, len(ring)):
        name = ring[(i + j) % len(ring)]
        n = nodes.get(name)
        if n is not None and n.replica_port:
            out.append((name, n.host, n.replica_port))
        if len(out) == k:
            break
    return out


@dataclass
class WorkerProc:
    slot: int
    proc: subprocess.Popen
    hb: Heartbeat
    rank: int | None = None
    sid: int = -1  # the seat's state id: stays when a shrink renumbers the rank
    epoch: int = 0
    hang_killed: bool = False
    assigned_at: float = 0.0
    last_hb: tuple = ()
    last_change: float = 0.0


class Agent:
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
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.incarnation = ""
        self._lease = None
        self._published_warm = -1
        self._partitioned_until = 0.0
        self._frozen: list[WorkerProc] = []
        self._lost_here: dict[int, int] = {}  # sid -> epoch its worker died here in

    # -- life cycle -----------------------------------------------------------------------
    def run(self) -> int:
        spec = self._wait_for_spec()
        if spec is None:
            log.error("job %s not found in etcd after %.0fs; giving up", self.job, self.wait_for_job)
            return 2
        self.spec = spec
        self.slots = self._slots or spec.ranks_per_node
        self.hang_timeout = spec.hang_timeout
        out = Path(spec.output_dir)
        self.log_dir = out / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        sweep_stale_run_dirs(base)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"hotspare-{self.job}-{self.node}-{os.getpid()}-", dir=base))
        secret = self.js.secret()
        replicas = ReplicaStore(self.run_dir)
        self._server = ReplicaServer(replicas, secret, host=self.host).start()
        self._buddies: list[tuple[str, str, int]] = []
        self._replicator = Replicator(
            replicas,
            secret,
            buddies=lambda: self._buddies,
            local_ranks=self._local_sids,
        )
        if self.spec.replication_enabled:
            self._replicator.start()
        self._world_info = (0, spec.ranks)
        self._checkpoint_step: int | None = None
        self._persister = Persister(
            self.run_dir, spec, job=self.job,
            local_ranks=self._local_seats,
            world=lambda: self._world_info,
            requested=lambda: self._checkpoint_step,
            event=lambda kind, msg, **data: self._event(kind, msg, **data),
        )
        if self.spec.replication_enabled:
            self._persister.start()
        self._register()
        cancel_watch = self.store.watch_prefix(self.js.keys.prefix, self._wake.set)
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        for slot in range(self.slots):
            self._spawn(slot)
        try:
            return self._loop()
        finally:
            cancel_watch()
            self._shutdown()

    def _wait_for_spec(self) -> dict | None:
        deadline = time.monotonic() + self.wait_for_job
        while time.monotonic() < deadline:
            try:
                spec = self.js.spec()
                if spec is not None:
                    return spec
            except StoreError:
                pass
            time.sleep(0.2)
        return None

    def _register(self) -> None:
        self.incarnation = uuid.uuid4().hex[:12]
        self._lease = self.store.lease(self.spec.lease_ttl)
        self._publish(force=True)
        self.js.event(
            "node-joined",
            self.node,
            f"agent {self.node} ({self.role}, {self.slots} slot(s)) registered",
            node=self.node,
            role=self.role,
            incarnation=self.incarnation,
        )
        log.info("registered %s as %s (incarnation %s)", self.node, self.role, self.incarnation)

    def _publish(self, force: bool = False) -> None:
        warm = sum(1 for w in self.workers.values() if w.rank is None and w.hb.read()[0] == WARM)
        if not force and warm == self._published_warm:
            return
        self._published_warm = warm
        node = Node(
            name=self.node,
            incarnation=self.incarnation,
            role=self.role,
            slots=self.slots,
            host=self.host,
            replica_port=self._server.port,
            pid=os.getpid(),
            warm=warm,
        )
        self.js.register_node(node, self._lease)

    # -- main loop ------------------------------------------------------------------------
    def _loop(self) -> int:
        last_read = 0.0
        while not self._stop.is_set():
            woke = self._wake.wait(POLL)
            self._wake.clear()
            if self._partitioned_until:
                if time.monotonic() < self._partitioned_until:
                    continue  # cut off: no etcd, no reports, no watchdog
                self._heal()
            try:
                self._supervise()
                if self._lease is not None and self._lease.lost.is_set():
                    self._fenced("lease lost")
                now = time.monotonic()
                if woke or now - last_read > 1.0:
                    last_read = now
                    snap = self.js.snapshot(progress=False)
                    if snap.state.terminal:
                        log.info("job %s is %s; agent exiting", self.job, snap.state.value)
                        return 0
                    self._assign(snap)
                    if snap.chaos.get(self.node):
                        for cmd in self.js.take_chaos(self.node):
                            self._chaos(cmd)
                self._publish()
            except LeaseLost:
                self._fenced("lease lost")
            except StoreError as e:
                log.warning("etcd: %s (training continues; retrying)", e)
                time.sleep(0.5)
        return 0

    def _fenced(self, why: str) -> None:
        """Our node key is gone: the controller has (or will have) replaced our ranks."""
        log.warning("%s: killing assigned workers and re-registering", why)
        for w in list(self.workers.values()):
            if w.rank is not None:
                self._kill(w)
        self._register()

    def _event(self, kind: str, message: str, **data) -> None:
        try:
            self.js.event(kind, self.node, message, node=self.node, **data)
        except StoreError as e:
            log.warning("event %s not recorded: %s", kind, e)

    def _local_seats(self) -> dict[int, int]:
        """sid -> current rank of the live local workers (a shrink renumbers ranks, not sids)."""
        return {w.sid: w.rank for w in list(self.workers.values()) if w.rank is not None and w.proc.poll() is None}

    def _local_sids(self) -> set[int]:
        """State ids of the live local workers: the names of their snapshot files."""
        return {w.sid for w in list(self.workers.values()) if w.rank is not None and w.proc.poll() is None}

    def _assign(self, snap) -> None:
        self._checkpoint_step = snap.checkpoint
        world = snap.world
        if world is None:
            return
        self._world_info = (world.epoch, world.size)
        self._buddies = ring_buddies(world, snap.nodes, self.node, self.spec.replicas)
        # seats are matched by sid: a shrink renumbers ranks but keeps each survivor's sid
        mine = {world.sid(r): r for r in world.ranks_on(self.node, self.incarnation)}
        held = {w.sid: w for w in self.workers.values() if w.rank is not None}
        for sid, w in held.items():
            if sid not in mine:
                if w.proc.poll() is None:
                    log.warning("rank %d no longer belongs to %s at epoch %d: stopping its worker",
                                w.rank, self.node, world.epoch)
                    self._kill(w)
            elif mine[sid] != w.rank:
                log.info("rank %d on %s is rank %d from epoch %d on", w.rank, self.node, mine[sid], world.epoch)
                w.rank, w.epoch = mine[sid], world.epoch  # reports must name the new seat
        for sid in sorted(set(mine) - set(held)):
            rank = mine[sid]
            if self._lost_here.get(sid, -1) >= world.seats[rank].since:
                continue  # its worker died here in this seat: the controller decides, not us
            free = [w for w in self.workers.values() if w.rank is None and w.proc.poll() is None]
            if not free:
                log.warning("rank %d assigned to %s but no free worker slot", rank, self.node)
                return
            free.sort(key=lambda w: w.hb.read()[0] != WARM)
            w = free[0]
            w.rank, w.sid, w.epoch, w.assigned_at = rank, sid, snap.epoch, time.time()
            self._replicator.forget(sid)
            warm = STATE_NAMES.get(w.hb.read()[0], "?")
            try:
                assert w.proc.stdin is not None
                # the incarnation travels with the assignment: a warm worker spawned before a
                # re-registration (lease lost, partition healed) must carry the new one
                w.proc.stdin.write(json.dumps({"rank": rank, "epoch": snap.epoch, "sid": sid,
                                               "incarnation": self.incarnation}).encode() + b"\n")
                w.proc.stdin.flush()
            except OSError:
                continue  # it just died; supervision will notice
            self.js.event(
                "assigned",
                self.node,
                f"rank {rank} -> {self.node} ({warm} worker pid {w.proc.pid}) at epoch {snap.epoch}",
                rank=rank,
                node=self.node,
                epoch=snap.epoch,
                warm=warm == "warm",
                pid=w.proc.pid,
            )

    def _supervise(self) -> None:
        now = time.time()
        for slot, w in list(self.workers.items()):
            code = w.proc.poll()
            if code is None:
                if w.rank is not None and not w.hang_killed:
                    # liveness = the heartbeat record *changing*, timed on our own clock:
                    # immune to clock skew and to reading a record mid-write
                    seen = w.hb.read()
                    if seen != w.last_hb:
                        w.last_hb, w.last_change = seen, now
                    if seen[0] == RUNNING and now - max(w.last_change, w.assigned_at) > self.hang_timeout:
                        log.warning("rank %d: no heartbeat for %.1fs (last %s): killing",
                                    w.rank, now - max(w.last_change, w.assigned_at), seen)
                        w.hang_killed = True
                        self._kill(w, wait=False)
                continue
            if w.rank is not None and code != 0:
                sig = -code if code < 0 else None
                kind = "hang" if w.hang_killed else "exit"
                why = ""
                if code == EXIT_UNRECOVERABLE:  # its state is gone everywhere: the job cannot go on
                    kind = "fatal"
                    try:
                        why = fatal_path(w.hb.path).read_text().strip()
                    except OSError:
                        why = "its state cannot be restored (see its rank log)"
                rep = Report(
                    node=self.node,
                    rank=w.rank,
                    epoch=w.epoch,
                    kind=kind,
                    exit_code=None if sig else code,
                    signal=sig,
                    time=now,
                    message=f"worker pid {w.proc.pid} " + (
                        f"cannot go on: {why}" if kind == "fatal"
                        else "hung (no heartbeat) and was killed" if kind == "hang"
                        else (f"killed by signal {sig}" if sig else f"exited with code {code}")
                    ),
                )
                try:
                    self.js.report(rep)
                    self.js.event("worker-exit", self.node, rep.message, rank=w.rank, node=self.node, kind=kind, detected=now, exit_code=code)
                except StoreError as e:
                    log.warning("could not report rank %d exit yet: %s", w.rank, e)
                    continue  # keep the record; retry next poll
                log.warning("rank %d: %s", w.rank, rep.message)
            elif w.rank is None:
                log.warning("warm worker pid %d exited with %s before assignment", w.proc.pid, code)
            if w.rank is not None:
                self._lost_here[w.sid] = w.epoch
            w.hb.close()
            del self.workers[slot]
            if not (w.rank is not None and code == 0):
                self._spawn(slot)

    # -- workers --------------------------------------------------------------------------
    def _spawn(self, slot: int) -> None:
        hb_path = self.run_dir / f"slot{slot}-{time.time_ns()}.hb"
        hb = Heartbeat(hb_path)
        env = dict(os.environ)
        env.update({k: str(v) for k, v in self.spec.env.items()})
        env.update(self.worker_env)
        env.update(
            {
                "HOTSPARE_JOB": self.job,
                "HOTSPARE_NODE": self.node,
                "HOTSPARE_INCARNATION": self.incarnation,
                "HOTSPARE_HB": str(hb_path),
                "HOTSPARE_LOG_DIR": str(self.log_dir),
                "HOTSPARE_SNAP_DIR": str(self.run_dir),
                "HOTSPARE_AGENT_PID": str(os.getpid()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.spec.backend == "local":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        logf = open(self.log_dir / f"worker-{self.node}-slot{slot}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "agents.worker"],
            stdin=subprocess.PIPE,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
        )
        logf.close()
        self.workers[slot] = WorkerProc(slot=slot, proc=proc, hb=hb)

    def _kill(self, w: WorkerProc, wait: bool = True) -> None:
        try:
            w.proc.kill()
        except ProcessLookupError:
            pass
        if wait:
            try:
                w.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def _shutdown(self) -> None:
        # ranks that passed the final barrier are writing their last records: let them
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(
            w.rank is not None and w.proc.poll() is None for w in self.workers.values()
        ):
            time.sleep(0.05)
        for w in self.workers.values():
            if w.rank is None and w.proc.stdin is not None:
                try:
                    w.proc.stdin.close()  # a warm worker leaves on EOF
                except OSError:
                    pass
            else:
                try:
                    w.proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for w in self.workers.values():
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
        self._replicator.stop()
        self._persister.stop()
        self._server.stop()
        if self._lease is not None:
            try:
                self.store.delete(self.js.keys.node(self.node))
            except StoreError:
                pass
            self._lease.revoke()
        try:
            for p in self.run_dir.iterdir():
                p.unlink()
            self.run_dir.rmdir()
        except OSError:
            pass

    # -- chaos ----------------------------------------------------------------------------
    def _chaos(self, cmd: dict) -> None:
        action = cmd.get("action")
        rank = cmd.get("rank")
        seconds = cmd.get("seconds")
        target = next((w for w in self.workers.values() if w.rank == rank), None)
        if action in ("kill-rank", "hang-rank", "slow-rank") and target is None:
            log.warning("chaos %s: rank %s is not on %s; ignored", action, rank, self.node)
            return
        if not cmd.get("evented"):  # scheduled entries were already written by the worker
            self.js.event(
                "chaos",
                self.node,
                f"{action} on {self.node}" + (f" rank {rank}" if rank is not None else ""),
                action=action,
                rank=rank,
                node=self.node,
                seconds=seconds,
            )
        log.warning("chaos: %s %s", action, cmd)
        if action == "kill-node":
            # the node dies at once: no report, no goodbye; workers follow via PDEATHSIG
            for w in self.workers.values():
                w.proc.kill()
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "kill-rank":
            target.proc.send_signal(signal.SIGKILL)
        elif action == "hang-rank":
            target.proc.send_signal(signal.SIGSTOP)
        elif action == "slow-rank":
            target.hb.set_delay(float(seconds if seconds is not None else 0.5))
        elif action == "partition-node":
            self._partition(float(seconds if seconds is not None else 2 * self.spec.lease_ttl))
        else:
            log.warning("chaos action %s is not executed by agents", action)

    def _partition(self, seconds: float) -> None:
        """Cut this node off for ``seconds``: no keepalives, no replica traffic, workers
        frozen. If that outlasts the lease the controller replaces our ranks; when the
        partition heals the workers find themselves fenced (their seats belong to other
        nodes now) and we re-register as a new incarnation."""
        assert self._lease is not None
        self._lease.pause()
        self._server.paused = True
        self._replicator.paused = True
        frozen = [w for w in self.workers.values() if w.proc.poll() is None]
        for w in frozen:
            w.proc.send_signal(signal.SIGSTOP)
        self._partitioned_until = time.monotonic() + seconds
        self._frozen = frozen

    def _heal(self) -> None:
        self._partitioned_until = 0.0
        for w in self._frozen:
            try:
                w.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        for w in self._frozen:
            w.assigned_at = time.time()  # the watchdog counts from the heal, not the freeze
        self._frozen = []
        self._server.paused = False
        self._replicator.paused = False
        assert self._lease is not None
        self._lease.resume()
        log.warning("partition healed")
