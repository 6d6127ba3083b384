"""The embedded default: a private etcd and a controller on this machine.

``hotspare up`` starts both as daemons and records them in ``<state-dir>/cluster.json``;
``hotspare down`` stops them and keeps the state directory (etcd data, logs, outputs).
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

from .etcd_server import EtcdServer, free_port, stop_pid
from .util import atomic_write, pid_alive

#: The embedded controller's leader lease TTL (``hotspare controller --leader-ttl``): how
#: long a standby waits before it takes over. Not the spec's ``lease_ttl`` (node agents).
LEADER_TTL = 3.0


def default_state_dir() -> Path:
    return Path(os.environ.get("HOTSPARE_STATE_DIR", "~/.hotspare")).expanduser()


@dataclass
class Cluster:
    endpoint: str
    etcd_pid: int
    controller_pid: int
    state_dir: str
    peer_port: int = 0

    @property
    def healthy(self) -> bool:
        return pid_alive(self.etcd_pid) and pid_alive(self.controller_pid)


def _file(state_dir: Path) -> Path:
    return state_dir / "cluster.json"


def _save(state_dir: Path, c: Cluster) -> None:
    # whole or absent: a half-written record would read as "no cluster up" and start a second
    atomic_write(_file(state_dir), json.dumps(asdict(c)), fsync=False, mode=0o666)


def load(state_dir: Path) -> Cluster | None:
    """The running embedded cluster, or None if none is up (stale records are ignored)."""
    f = _file(state_dir)
    if not f.exists():
        return None
    try:
        c = Cluster(**json.loads(f.read_text()))
    except (ValueError, TypeError):
        return None
    return c if pid_alive(c.etcd_pid) else None


def start_controller(endpoint: str, state_dir: Path, leader_ttl: float = LEADER_TTL) -> int:
    """A controller daemon for every job in the embedded etcd; returns its pid."""
    cmd = [sys.executable, "-m", "hotspare.orchestrator.cli", "controller", "--etcd", endpoint,
           "--leader-ttl", str(leader_ttl)]
    with open(state_dir / "controller.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc.pid


def ensure_controller(state_dir: Path, log: Callable[[str], object] = print) -> None:
    """Restart the embedded controller if it died (the supervisor a real cluster would
    have). Leaves a down etcd alone: it may be down on purpose (chaos restart-etcd)."""
    c = load(state_dir)
    if c is not None and not pid_alive(c.controller_pid):
        c.controller_pid = start_controller(c.endpoint, state_dir)
        _save(state_dir, c)
        log(f"embedded controller was down; restarted it (pid {c.controller_pid})")


def up(state_dir: Path, log: Callable[[str], object] = print) -> Cluster:
    """The embedded cluster of ``state_dir``, started (or its controller restarted) if needed."""
    state_dir.mkdir(parents=True, exist_ok=True)
    c = load(state_dir)
    if c is not None:
        if not pid_alive(c.controller_pid):
            c.controller_pid = start_controller(c.endpoint, state_dir)
            _save(state_dir, c)
            log(f"restarted controller (pid {c.controller_pid})")
        return c
    t0 = time.monotonic()
    srv = EtcdServer(state_dir / "etcd", free_port(), free_port())
    srv.start(log_path=state_dir / "etcd.log", detach=True)
    srv.wait_ready()
    ctl = start_controller(srv.endpoint, state_dir)
    c = Cluster(srv.endpoint, srv.pid, ctl, str(state_dir), srv.peer_port)
    _save(state_dir, c)
    log(f"embedded cluster up in {time.monotonic() - t0:.1f}s: etcd {srv.endpoint} (pid {srv.pid}), "
        f"controller pid {ctl}; state in {state_dir}")
    return c


def down(state_dir: Path) -> list[str]:
    """Stop every process of the embedded cluster of ``state_dir``: the jobs' agents and
    their workers (each job still running is cancelled first, so it is recorded as cancelled
    and its agents leave by themselves; what is left is signalled), then the controller and
    etcd. Returns what it stopped, one line each (empty: nothing was running)."""
    from .launchers.local import stop_agents  # the launcher imports this module

    c = load(state_dir)
    cancelled = _cancel_jobs(c.endpoint) if c is not None else []
    said = [f"cancelled running job(s) {', '.join(cancelled)}"] if cancelled else []
    said += stop_agents(state_dir, grace=10.0 if cancelled else 0.0)
    if c is not None:
        stop_pid(c.controller_pid)
        stop_pid(c.etcd_pid)
        said += [f"stopped controller pid {c.controller_pid}", f"stopped etcd pid {c.etcd_pid} ({c.endpoint})"]
    _file(state_dir).unlink(missing_ok=True)
    return said


def _cancel_jobs(endpoint: str) -> list[str]:
    """Ask every unfinished job of the embedded etcd to cancel (best effort): its names."""
    from .store import JobStore, Store, StoreError, list_jobs

    try:
        st = Store([endpoint], timeout=3.0)
    except StoreError:
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
    srv = EtcdServer(state_dir / "etcd", port, c.peer_port or free_port())
    srv.start(log_path=state_dir / "etcd.log", detach=True)
    srv.wait_ready()
    c.etcd_pid = srv.pid
    c.peer_port = srv.peer_port
    _save(state_dir, c)
    return c
