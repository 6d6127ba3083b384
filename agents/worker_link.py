"""The agent <-> worker contract, in one place (torch-free: both sides import it).

* :class:`WorkerEnv` -- the ``HOTSPARE_*`` environment an agent starts a worker with.
* :class:`Assignment` -- the one JSON line on the worker's stdin that gives it a rank.
* Exit codes (``EXIT_*``) the agent tells apart, :func:`fatal_path`, where a worker
  leaves the reason it cannot go on, and :func:`error_path` (:class:`Raised`), where it
  leaves the traceback of what its code raised.
* :class:`Heartbeat` -- a 64-byte memory-mapped file: no syscall per beat.

Worker -> agent: (state, step, time, pid) at every step and while it waits inside a
collective or a rendezvous; the agent reads it a few times a second. A SIGSTOPped or
deadlocked worker stops beating and the agent's watchdog kills it after ``hang_timeout``.

Agent -> worker: ``delay``, seconds the worker sleeps after each step (chaos ``slow-rank``
delivered without touching the step path's etcd-free rule).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The worker's module. It is started through :func:`worker_command`, never ``python -m``.
WORKER_MODULE = "hotspare.agents.worker"

#: ``python -m`` puts the current directory first on ``sys.path``: a user's ``hotspare.py``,
#: ``yaml.py`` or ``torch/`` in the directory the job was started from would shadow our
#: packages in the worker. This starts the module with that entry removed; the worker puts the
#: entrypoint's own directory (or, for a module entrypoint, the current one) on the path only
#: after hotspare and torch are loaded, as torchrun does for a script.
_BOOT = ("import sys, os\n"
         "if sys.path and sys.path[0] in ('', os.getcwd()):\n"
         "    del sys.path[0]\n"
         "import runpy\n"
         "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")


def worker_command(python: str | None = None, module: str = WORKER_MODULE) -> list[str]:
    """The command line that starts a warm worker (or ``module``, run the same way: the
    entrypoint check, :mod:`hotspare.orchestrator.entry_check`, loads the job's code as a
    worker would)."""
    return [python or sys.executable, "-c", _BOOT.format(module=module)]


#: Exit codes of a worker process.
EXIT_OK = 0  # finished every step
EXIT_ERROR = 1  # the training function raised: a code error (the traceback is in error_path)
EXIT_NO_SPEC = 2  # the job has no spec in etcd (deleted under it)
EXIT_FENCED = 3  # its rank moved on without it (the world no longer has its seat)
#: its rank's state cannot be restored from anywhere: reported as a "fatal" loss, and the
#: controller fails the job with the reason instead of trying spare after spare
EXIT_UNRECOVERABLE = 4
#: loading the entrypoint (or the module's ``warmup``) raised: the job's code cannot start
#: on this node. The traceback is left in :func:`error_path`, as for ``EXIT_ERROR``.
EXIT_STARTUP_ERROR = 5
#: the training function raised, but not because of its code: its process group broke under
#: it (a peer died, a newer epoch came) or hotspare's own I/O failed (etcd, snapshot files).
#: A crash, handled like a lost worker; what it raised is in :func:`error_path` all the same.
EXIT_INFRA_ERROR = 6


def fatal_path(hb_path: str | Path) -> Path:
    """Where a worker leaves the reason it cannot go on, for its agent to report."""
    hb_path = Path(hb_path)
    return hb_path.with_name(hb_path.name + ".fatal")


def error_path(hb_path: str | Path) -> Path:
    """Where a worker whose training function or module raised (``EXIT_ERROR``,
    ``EXIT_STARTUP_ERROR``, ``EXIT_INFRA_ERROR``) leaves what it raised (:class:`Raised`)
    for its agent to report."""
    hb_path = Path(hb_path)
    return hb_path.with_name(hb_path.name + ".error")


@dataclass(frozen=True)
class Raised:
    """What :func:`error_path` holds: the end of the traceback (bounded, see
    ``records.traceback_tail``) and the step being computed (-1: before the first step)."""

    traceback: str
    step: int = -1

    def write(self, hb_path: str | Path) -> bool:
        """Leave it next to the heartbeat; False if it could not be written."""
        try:
            error_path(hb_path).write_text(json.dumps(dataclasses.asdict(self)))
            return True
        except OSError:
            return False

    @classmethod
    def read(cls, hb_path: str | Path) -> Raised | None:
        """What the worker left, or None (it wrote nothing, or something unreadable)."""
        try:
            d = json.loads(error_path(hb_path).read_text())
            return cls(traceback=str(d["traceback"]), step=int(d.get("step", -1)))
        except (OSError, ValueError, KeyError, TypeError):
            return None


#: The first line a worker logs (``... [<job> <node> pid<P>] root: worker starting``). Until its
#: assignment a worker writes to its slot's log, ``worker-<node>-slot<k>.log``, which the
#: slot's successive workers share: ``hotspare logs --rank`` cuts it into their parts here.
WORKER_STARTED = "worker starting"


# -- the job's spec, as the agent validated it -------------------------------------------------
SPEC_FILE = "spec.json"


class SpecTampered(RuntimeError):
    """The job's spec in etcd is not the one that was submitted (or that the agent pinned)."""


def default_etcd_outage_limit(lease_ttl: float) -> float:
    """How long an agent keeps its workers training without etcd before it gives up and
    leaves (taking them along), and how long a finished worker retries its done mark: long
    enough to ride out an etcd restart, short enough that the processes of a job whose etcd
    is gone for good (``hotspare down``) do not linger."""
    return max(60.0, 10 * lease_ttl)


def check_digest(job: str, spec: Any, want: str | None) -> Any:
    """``spec`` if it is the one submitted (``want``: its digest from the launcher; None:
    nothing to check), else :class:`SpecTampered` with the reason."""
    if want and spec.digest() != want:
        raise SpecTampered(
            f"the spec of job {job} in etcd (sha256 {spec.digest()[:16]}...) is not the one submitted "
            f"(sha256 {want[:16]}...): someone with write access to etcd changed it; refusing to run it "
            "(resubmit the job, and restrict who can write etcd)")
    return spec


def wait_for_spec(js: Any, want_run: str | None, want_digest: str | None, timeout: float) -> Any:
    """The job's spec once it is in etcd (``js``: its JobStore), None after ``timeout`` s;
    with ``want_run``, the spec of that run (an earlier run of the name may still be there),
    checked against ``want_digest`` (:func:`check_digest`)."""
    from hotspare.orchestrator.store.errors import StoreError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            spec = js.spec()
            if spec is not None and want_run in (None, spec.run_id):
                return check_digest(js.job, spec, want_digest)
        except StoreError:
            pass
        time.sleep(0.2)
    return None


def pin_spec(run_dir: Path, spec: Any) -> Path:
    """Write the spec the agent validated into its private run directory (0700; the file
    0600). Its workers run this one: a worker never re-reads the spec from etcd, so whoever
    can write a job's etcd keys cannot make the next (re)started worker import other code."""
    from hotspare.orchestrator.util import atomic_write

    return atomic_write(Path(run_dir) / SPEC_FILE, spec.to_json(), fsync=False, mode=0o600)


def pinned_spec(run_dir: str | Path, job: str) -> Any:
    """The spec :func:`pin_spec` wrote, for a worker of ``job``."""
    from hotspare.orchestrator.spec import JobSpec

    path = Path(run_dir) / SPEC_FILE
    try:
        spec = JobSpec.from_json(path.read_bytes())
    except FileNotFoundError:
        raise SpecTampered(f"no {path}: this worker was not started by an agent of job {job}") from None
    if spec.name != job:
        raise SpecTampered(f"{path} holds the spec of job {spec.name!r}, not {job!r}")
    return spec


@dataclass(frozen=True)
class WorkerEnv:
    """What an agent tells a worker it starts, through ``HOTSPARE_*`` variables."""

    job: str
    node: str
    incarnation: str  # the agent's registration when the worker was started
    hb: str  # heartbeat file
    log_dir: str
    snap_dir: str  # the agent's shared-memory run directory (snapshot slots)
    agent_pid: int = 0
    threads: int = 1  # torch intra-op threads
    #: pay torch's lazy imports while warm (:func:`hotspare.agents.worker.prewarm_torch`).
    #: Off for a worker that takes a seat at once (the first ones on an active node): it
    #: would pay the same cost only earlier, and for nothing if the job builds no optimizer.
    prewarm: bool = True

    _NAMES = {"job": "HOTSPARE_JOB", "node": "HOTSPARE_NODE", "incarnation": "HOTSPARE_INCARNATION",
              "hb": "HOTSPARE_HB", "log_dir": "HOTSPARE_LOG_DIR", "snap_dir": "HOTSPARE_SNAP_DIR",
              "agent_pid": "HOTSPARE_AGENT_PID", "threads": "HOTSPARE_THREADS",
              "prewarm": "HOTSPARE_PREWARM"}

    def to_env(self) -> dict[str, str]:
        return {self._NAMES[f.name]: str(int(v) if isinstance(v := getattr(self, f.name), bool) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerEnv:
        missing = [v for k, v in cls._NAMES.items() if k in ("job", "node", "hb", "log_dir") and v not in env]
        if missing:
            raise RuntimeError(f"not started by a hotspare agent: {', '.join(missing)} not set")
        return cls(
            job=env["HOTSPARE_JOB"], node=env["HOTSPARE_NODE"],
            incarnation=env.get("HOTSPARE_INCARNATION", ""), hb=env["HOTSPARE_HB"],
            log_dir=env["HOTSPARE_LOG_DIR"], snap_dir=env.get("HOTSPARE_SNAP_DIR", ""),
            agent_pid=int(env.get("HOTSPARE_AGENT_PID", "0")),
            threads=int(env.get("HOTSPARE_THREADS", "1")),
            prewarm=env.get("HOTSPARE_PREWARM", "1") != "0",
        )


@dataclass(frozen=True)
class Assignment:
    """The line an agent writes to a warm worker's stdin: which seat it now holds.

    ``incarnation`` is the agent's registration at the time of the assignment (it may be
    newer than the worker's start), ``sid`` the seat's state id."""

    rank: int
    epoch: int
    sid: int
    incarnation: str = ""

    def to_line(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode() + b"\n"

    @classmethod
    def from_line(cls, line: str | bytes) -> Assignment:
        d = json.loads(line)
        return cls(rank=int(d["rank"]), epoch=int(d["epoch"]),
                   sid=int(d["rank"] if d.get("sid") is None else d["sid"]),
                   incarnation=d.get("incarnation") or "")

_BEAT = "<qqdq"  # state, step, beat time (unix), pid            [0, 32)
SIZE = 64

STARTING, WARM, RUNNING, FINISHED = 0, 1, 2, 3
STATE_NAMES = {STARTING: "starting", WARM: "warm", RUNNING: "running", FINISHED: "finished"}


class Heartbeat:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists() or self.path.stat().st_size < SIZE:
            with open(self.path, "wb") as f:
                f.write(struct.pack(_BEAT, STARTING, -1, 0.0, 0).ljust(SIZE, b"\0"))
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._state = STARTING

    def beat(self, step: int, state: int | None = None) -> None:
        if state is not None:
            self._state = state
        struct.pack_into(_BEAT, self._mm, 0, self._state, step, time.time(), os.getpid())

    def read(self) -> tuple[int, int, float, int]:
        return struct.unpack_from(_BEAT, self._mm, 0)

    # -- agent -> worker ------------------------------------------------------------------
    def set_delay(self, seconds: float) -> None:
        struct.pack_into("<d", self._mm, 32, float(seconds))

    def delay(self) -> float:
        return struct.unpack_from("<d", self._mm, 32)[0]

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
