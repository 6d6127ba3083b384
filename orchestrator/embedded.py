"""The embedded default: a private etcd and a controller on this machine.

``hotspare up`` starts both as daemons and records them in ``<state-dir>/cluster.json``;
``hotspare down`` stops them and keeps the state directory (etcd data, logs, outputs). The
etcd requires a password (:mod:`.embedded_auth`): the state dir is 0700 and the password
file 0600, so only this Unix user's processes can use it.

After a total loss (a reboot: etcd, controller, agents and workers all gone), ``up`` starts
etcd again on its data, on its old port if that is free, and records every local job whose
processes are all gone as failed (``hotspare run --resume SPEC`` continues it from its
newest complete checkpoint) before it starts the controller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from . import embedded_auth
from .etcd_server import LONG_LIVED_HEARTBEAT_MS, free_port, start_etcd, stop_pid
from .store import ENV_OPTIONS, PASSWORD_FILE_ENV, JobStore, Store
from .util import atomic_write, pid_alive

#: The embedded controller's leader lease TTL (``hotspare controller --leader-ttl``): how
#: long a standby waits before it takes over. Not the spec's ``lease_ttl`` (node agents).
LEADER_TTL = 3.0

#: Said by ``up`` about a cluster started before the embedded etcd had a password.
NO_AUTH = ("the embedded etcd (pid {pid}) was started before it required a password: any local user can "
           "write its jobs' keys; run `hotspare down` then `hotspare up` to turn its authentication on")


def default_state_dir() -> Path:
    return Path(os.environ.get("HOTSPARE_STATE_DIR", "~/.hotspare")).expanduser()


@dataclass
class Cluster:
    endpoint: str
    etcd_pid: int
    controller_pid: int
    state_dir: str
    peer_port: int = 0
    #: the etcd password's file (never the password); "" in a record from before etcd had one
    password_file: str = ""

    @property
    def etcd_runs(self) -> bool:
        """This cluster's etcd is running (its pid, with this state dir's data in its command
        line: after a reboot the pid may be someone else's)."""
        return _runs(self.etcd_pid, str(Path(self.state_dir) / "etcd"))

    @property
    def controller_runs(self) -> bool:
        return _runs(self.controller_pid, "hotspare.orchestrator.cli", self.endpoint)

    @property
    def healthy(self) -> bool:
        return self.etcd_runs and self.controller_runs

    def child_env(self) -> dict[str, str]:
        """The variables that give a process this etcd's credentials (none: an old record)."""
        return embedded_auth.child_env(self.password_file) if self.password_file else {}

    def store_options(self) -> dict[str, str | None]:
        """:class:`Store` keyword arguments for this etcd; ValueError if the password file
        cannot be read."""
        return embedded_auth.store_options(self.password_file) if self.password_file else {}

    def store(self, timeout: float = 5.0) -> Store:
        return Store([self.endpoint], timeout=timeout, **self.store_options())


def _runs(pid: int, *words: str) -> bool:
    """``pid`` runs and its command line has ``words``. A process we have just started may
    still be inside its exec (an empty command line for a few milliseconds): asked again."""
    deadline = time.monotonic() + 2.0
    while pid > 0 and pid_alive(pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        if cmdline or time.monotonic() > deadline:  # empty for good: a kernel thread
            return all(w.encode() in cmdline for w in words)
        time.sleep(0.005)
    return False


def _file(state_dir: Path) -> Path:
    return state_dir / "cluster.json"


def _save(state_dir: Path, c: Cluster) -> None:
    # whole or absent: a half-written record would read as "no cluster up" and start a second
    atomic_write(_file(state_dir), json.dumps(asdict(c)), fsync=False, mode=0o600)


def _read(state_dir: Path) -> Cluster | None:
    """The recorded cluster, whether or not its processes still run."""
    try:
        return Cluster(**json.loads(_file(state_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def load(state_dir: Path) -> Cluster | None:
    """The running embedded cluster, or None if none is up (stale records are ignored)."""
    c = _read(state_dir)
    return c if c is not None and c.etcd_runs else None


def start_controller(c: Cluster, state_dir: Path, leader_ttl: float = LEADER_TTL) -> int:
    """A controller daemon for every job in the embedded etcd; returns its pid. It gets the
    etcd's credentials (and no other etcd settings) through its environment."""
    cmd = [sys.executable, "-m", "hotspare.orchestrator.cli", "controller", "--etcd", c.endpoint,
           "--leader-ttl", str(leader_ttl)]
    env = {k: v for k, v in os.environ.items() if k not in {*ENV_OPTIONS.values(), PASSWORD_FILE_ENV}}
    env.update(c.child_env())
    with open(state_dir / "controller.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    return proc.pid


def ensure_controller(state_dir: Path, log: Callable[[str], object] = print) -> None:
    """Restart the embedded controller if it died (the supervisor a real cluster would
    have). Leaves a down etcd alone: it may be down on purpose (chaos restart-etcd)."""
    c = load(state_dir)
    if c is not None and not c.controller_runs:
        c.controller_pid = start_controller(c, state_dir)
        _save(state_dir, c)
        log(f"embedded controller was down; restarted it (pid {c.controller_pid})")


def up(state_dir: Path, log: Callable[[str], object] = print) -> Cluster:
    """The embedded cluster of ``state_dir``, started (or its controller restarted) if needed."""
    embedded_auth.private_dir(state_dir)
    old = _read(state_dir)
    if old is None or not old.etcd_runs:
        return _start(state_dir, old, log)
    if not old.password_file:
        log(NO_AUTH.format(pid=old.etcd_pid))
    if not old.controller_runs:
        old.controller_pid = start_controller(old, state_dir)
        _save(state_dir, old)
        log(f"restarted controller (pid {old.controller_pid})")
    return old


def _start(state_dir: Path, old: Cluster | None, log: Callable[[str], object]) -> Cluster:
    """Start etcd (on ``old``'s ports first: agents that outlived it reconnect), require its
    password, end the runs a total loss left behind, then start a controller."""
    t0 = time.monotonic()
    ports = (int(old.endpoint.rsplit(":", 1)[1]), old.peer_port) if old and old.peer_port else None
    srv = start_etcd(state_dir / "etcd", state_dir / "etcd.log", detach=True, ports=ports,
                     extra_args=embedded_auth.ETCD_ARGS, say=log, heartbeat_ms=LONG_LIVED_HEARTBEAT_MS)
    try:
        password_file = embedded_auth.secure(srv.endpoint, state_dir)
    except BaseException:
        srv.stop()
        raise
    c = Cluster(srv.endpoint, srv.pid, 0, str(state_dir), srv.peer_port, str(password_file))
    ended = _end_lost_runs(c, state_dir, old) if old is not None else []
    if old is not None and old.controller_runs:  # it outlived its etcd: it may hold no credentials
        stop_pid(old.controller_pid)
    c.controller_pid = start_controller(c, state_dir)
    _save(state_dir, c)
    log(f"embedded cluster up in {time.monotonic() - t0:.1f}s: etcd {srv.endpoint} (pid {srv.pid}; user root, "
        f"password in {password_file}), controller pid {c.controller_pid}; state in {state_dir}")
    for line in ended:
        log(line)
    return c


def _end_lost_runs(c: Cluster, state_dir: Path, old: Cluster) -> list[str]:
    """Record as failed every unfinished local job of the etcd that had stopped (``old``)
    none of whose recorded agents runs any more: a reboot or a crash took every process of
    the run, nothing will ever finish it, and its name must be free to run (``--resume``)
    again. Jobs with a live agent (only etcd had died) are left to the controller."""
    from .launchers.local import group_members, recorded  # the launcher imports this module
    from .store import JobStore, list_jobs

    alive = {(r["job"], r.get("run_id")) for r in recorded(state_dir)
             if any(group_members(pgid) for pgid in r.get("agents", {}).values())}
    st = c.store(timeout=10.0)
    try:
        said = [_end_if_lost(JobStore(st, job), alive, old) for job in list_jobs(st)]
    finally:
        st.close()
    return [s for s in said if s]


def _end_if_lost(js: JobStore, alive: set[tuple[str, str | None]], old: Cluster) -> str:
    """Record ``js``'s run as failed unless it has ended, is not local or has a live agent;
    the sentence recorded ("": left alone)."""
    from .store import Compare, EventKind, StateRecord
    from .store.snapshot import PARSE_ERRORS

    try:
        spec, kv = js.spec(), js.store.get(js.keys.state)
        state = StateRecord.from_json(kv.value).job_state if kv else None
    except PARSE_ERRORS:  # a damaged record: the controller reports it on the job's timeline
        return ""
    if spec is None or spec.backend != "local" or (state and state.terminal) or (js.job, spec.run_id) in alive:
        return ""
    why = (f"run {spec.run_id} of job {js.job} lost every process while the embedded cluster was down (its "
           f"etcd, pid {old.etcd_pid}, had stopped: a reboot or a crash), so it is recorded as failed; "
           "`hotspare run --resume SPEC` continues it from its newest complete checkpoint")
    guard = Compare(js.keys.state, "mod", "==", kv.mod_revision) if kv else Compare(js.keys.state, "create", "==", 0)
    if not js.store.txn([guard], puts={js.keys.state: StateRecord("failed", time.time(), why).to_json()}):
        return ""  # it moved meanwhile (a controller that outlived etcd): its own decision stands
    js.event(EventKind.FAILED, "hotspare up", why)
    return why


def down(state_dir: Path) -> list[str]:
    """Stop every process of the embedded cluster of ``state_dir``: the jobs' agents and
    their workers (each job still running is cancelled first, so it is recorded as cancelled
    and its agents leave by themselves; what is left is signalled), then the controller and
    etcd. Returns what it stopped, one line each (empty: nothing was running)."""
    from .launchers.local import stop_agents  # the launcher imports this module

    c = _read(state_dir)
    etcd_runs = c is not None and c.etcd_runs
    cancelled = _cancel_jobs(c) if etcd_runs else []
    said = [f"cancelled running job(s) {', '.join(cancelled)}"] if cancelled else []
    said += stop_agents(state_dir, grace=10.0 if cancelled else 0.0)
    if c is not None and c.controller_runs:  # also one that outlived its etcd
        stop_pid(c.controller_pid)
        said.append(f"stopped controller pid {c.controller_pid}")
    if etcd_runs:
        stop_pid(c.etcd_pid)
        said.append(f"stopped etcd pid {c.etcd_pid} ({c.endpoint})")
    _file(state_dir).unlink(missing_ok=True)
    return said


def _cancel_jobs(c: Cluster) -> list[str]:
    """Ask every unfinished job of the embedded etcd to cancel (best effort): its names."""
    from .store import JobStore, StoreError, list_jobs

    try:
        st = c.store(timeout=3.0)
    except (StoreError, ValueError):
        return []
    try:
        out = []
        for job in list_jobs(st):
            js = JobStore(st, job)
            if not js.state()[0].terminal:
                js.request_cancel()
                out.append(job)
        return out
    except StoreError:
        return []
    finally:
        st.close()


def restart_etcd(state_dir: Path, downtime: float) -> Cluster:
    """Chaos: stop the embedded etcd, keep it down for ``downtime`` seconds, start it again
    on the same ports and data (what a crashed and restarted etcd host looks like)."""
    c = load(state_dir)
    if c is None:
        raise RuntimeError(f"no embedded etcd is up in {state_dir}")
    stop_pid(c.etcd_pid)
    time.sleep(downtime)
    port = int(c.endpoint.rsplit(":", 1)[1])
    srv = start_etcd(state_dir / "etcd", state_dir / "etcd.log", detach=True, attempts=1,
                     ports=(port, c.peer_port or free_port()), extra_args=embedded_auth.ETCD_ARGS,
                     heartbeat_ms=LONG_LIVED_HEARTBEAT_MS)
    c.etcd_pid = srv.pid
    c.peer_port = srv.peer_port
    _save(state_dir, c)
    return c
