"""The agent's worker processes: their life cycle, how one is started, and what its exit means.

A worker goes WARM (started; importing, then waiting on stdin) -> ASSIGNED (holds a seat)
-> HANG_KILLED (its watchdog killed it; the exit is reported as a hang) or out of the
agent's table once it exits. :func:`classify_exit` turns an exit into the report's kind and
sentence without touching anything, so every branch has a unit test.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.store.records import Report, World, last_line

from .worker_link import (
    EXIT_ERROR,
    EXIT_FENCED,
    EXIT_INFRA_ERROR,
    EXIT_STARTUP_ERROR,
    EXIT_UNRECOVERABLE,
    RUNNING,
    WORKER_MODULE,
    Assignment,
    Heartbeat,
    Raised,
    WorkerEnv,
    fatal_path,
    worker_command,
)
from .zygote import ForkedProc, Zygote, ZygoteRefused

log = logging.getLogger("hotspare.agent")


class WorkerState(str, Enum):
    WARM = "warm"  # started, no seat yet (possibly still importing: see its heartbeat)
    ASSIGNED = "assigned"  # holds a seat; watched by the heartbeat watchdog
    HANG_KILLED = "hang-killed"  # holds its seat until its exit is reported as a hang

    def __str__(self) -> str:
        return self.value


@dataclass
class WorkerProc:
    """One worker process of the agent and the seat it holds (if any)."""

    slot: int
    proc: subprocess.Popen | ForkedProc
    hb: Heartbeat
    state: WorkerState = WorkerState.WARM
    rank: int = -1  # meaningful once ASSIGNED; a shrink may change it
    sid: int = -1  # the seat's state id: stays when a shrink renumbers the rank
    epoch: int = 0
    assigned_at: float = 0.0  # time.monotonic() of the assignment: the watchdog's clock
    # watchdog bookkeeping: the last heartbeat record seen and when it last changed (monotonic)
    last_hb: tuple = ()
    last_change: float = 0.0

    @property
    def holds_seat(self) -> bool:
        return self.state is not WorkerState.WARM

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def assign(self, rank: int, sid: int, epoch: int) -> None:
        self.state = WorkerState.ASSIGNED
        self.rank, self.sid, self.epoch, self.assigned_at = rank, sid, epoch, time.monotonic()

    def send(self, assignment: Assignment) -> bool:
        """Write the assignment line to the worker's stdin; False if it has just died."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(assignment.to_line())
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def fatal_text(self) -> str | None:
        """The reason the worker left for an unrecoverable exit, if it could write one."""
        try:
            return fatal_path(self.hb.path).read_text().strip()
        except OSError:
            return None

    def raised(self) -> Raised | None:
        """What the worker's code raised (traceback's end, step), if it left it."""
        return Raised.read(self.hb.path)

    def step(self) -> int:
        """The step the worker was computing by its heartbeat: one past the last it committed
        while it ran a seat, -1 if it never ran one."""
        state, committed = self.hb.read()[:2]
        return committed + 1 if state >= RUNNING else -1

    def hung(self, now: float, hang_timeout: float) -> float:
        """The watchdog's check: seconds the assigned worker has been silent past
        ``hang_timeout`` (0 if it is alive). ``now`` is ``time.monotonic()``, the clock of
        ``assigned_at`` and ``last_change``: liveness is the heartbeat record *changing*,
        timed on our own clock -- immune to clock skew, to wall-clock steps and to reading a
        record mid-write (the time the worker writes into it is never compared with ours)."""
        seen = self.hb.read()
        if seen != self.last_hb:
            self.last_hb, self.last_change = seen, now
        silent = now - max(self.last_change, self.assigned_at)
        return silent if seen[0] == RUNNING and silent > hang_timeout else 0.0

    def exit_report(self, node: str, code: int, now: float, oom: bool) -> Report:
        """The report of this worker's exit for the controller. A worker whose job code could
        not start is reported for rank -1 (no seat is lost: the job cannot run anywhere)."""
        fatal = self.fatal_text() if code == EXIT_UNRECOVERABLE else None
        raised = self.raised()
        kind, message = classify_exit(code, self.state is WorkerState.HANG_KILLED, fatal, self.proc.pid,
                                      raised=raised, oom=oom)
        sig = -code if code < 0 else None
        rank = -1 if code == EXIT_STARTUP_ERROR else self.rank
        step = raised.step if raised is not None else self.step()
        return Report(node=node, rank=rank, epoch=self.epoch, kind=kind, exit_code=None if sig else code,
                      signal=sig, time=now, message=message, step=-1 if rank < 0 else step,
                      traceback=raised.traceback if raised is not None else "")

    def watchdog(self, now: float, hang_timeout: float) -> None:
        """Kill this assigned worker if its heartbeat stopped changing (:meth:`hung`; ``now``
        is ``time.monotonic()``): its exit is then reported as a hang."""
        silent = self.hung(now, hang_timeout)
        if silent:
            log.warning("rank %d: no heartbeat for %.1fs (last %s): killing", self.rank, silent, self.last_hb)
            self.state = WorkerState.HANG_KILLED
            self.kill(wait=False)

    def kill(self, wait: bool = True) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        if wait:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def follow_held(world: World, mine: dict[int, int], held: dict[int, WorkerProc], node: str) -> None:
    """Stop the workers whose seats left ``node`` in ``world``; renumber the ones a shrink
    moved (``mine``: sid -> rank of this node's seats; ``held``: sid -> worker holding it)."""
    for sid, w in held.items():
        if sid not in mine:
            if w.alive:
                log.warning("rank %d no longer belongs to %s at epoch %d: stopping its worker",
                            w.rank, node, world.epoch)
                w.kill()
        elif mine[sid] != w.rank:
            log.info("rank %d on %s is rank %d from epoch %d on", w.rank, node, mine[sid], world.epoch)
            w.rank, w.epoch = mine[sid], world.epoch  # reports must name the new seat


def stop_workers(workers: Iterable[WorkerProc]) -> None:
    """Stop a node's workers: ranks past the final barrier get 3 s to write their last
    records, warm ones leave on EOF, the rest get SIGTERM and, 5 s later, SIGKILL."""
    workers = list(workers)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(w.holds_seat and w.alive for w in workers):
        time.sleep(0.05)
    for w in workers:
        if not w.holds_seat and w.proc.stdin is not None:
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
    for w in workers:
        try:
            w.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()


def worker_base_env(spec: JobSpec, extra: Mapping[str, str]) -> dict[str, str]:
    """Every worker's environment but its own ``HOTSPARE_*`` contract: the agent's, the
    spec's ``env``, then what the agent's launcher added."""
    env = dict(os.environ)
    env.update({k: str(v) for k, v in spec.env.items()})
    env.update(extra)
    if spec.backend == "local":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def classify_exit(returncode: int, hang_killed: bool, fatal_text: str | None, pid: int, *,
                  raised: Raised | None = None, oom: bool = False) -> tuple[str, str]:
    """(kind, message) of a worker's non-zero exit, as the agent reports it.

    ``kind`` is what the controller acts on: ``fatal`` (its state is gone everywhere: the job
    fails with the worker's reason, ``fatal_text``), ``hang`` (the watchdog killed it),
    ``error`` (the job's code raised: the training function, or the module while warming up;
    ``raised`` is what the worker left), ``fenced`` (its seat had moved on: informational),
    ``oom`` (SIGKILLed while the kernel's OOM kill counter rose), ``signal`` (killed by another
    signal) or ``exit`` (any other exit: a crash, or an exception not caused by the code)."""
    if returncode == EXIT_UNRECOVERABLE:
        why = "its state cannot be restored (see its rank log)" if fatal_text is None else fatal_text
        return "fatal", f"worker pid {pid} cannot go on: {why}"
    if hang_killed:
        return "hang", f"worker pid {pid} hung (no heartbeat) and was killed"
    what = last_line(raised.traceback) if raised is not None else ""
    if returncode == EXIT_STARTUP_ERROR:
        return "error", f"worker pid {pid} could not start the job: {what or 'its module raised (see its log)'}"
    if returncode == EXIT_ERROR and raised is not None:
        return "error", f"worker pid {pid} raised {what}" if what else f"worker pid {pid} raised (see its rank log)"
    if returncode == EXIT_INFRA_ERROR:
        return "exit", (f"worker pid {pid} stopped: its process group or hotspare's I/O failed under the "
                        f"training function ({what or 'see its rank log'})")
    if returncode == EXIT_FENCED:
        return "fenced", f"worker pid {pid} left: its seat had moved on (fenced)"
    if returncode < 0:
        name = _signal_name(-returncode)
        if oom and -returncode == signal.SIGKILL:
            return "oom", f"worker pid {pid} was killed by the kernel's OOM killer (out of memory)"
        return "signal", f"worker pid {pid} killed by signal {-returncode} ({name})"
    return "exit", f"worker pid {pid} exited with code {returncode}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return "unknown signal"


class OomCounter:
    """The kernel's OOM kill counter (``oom_kill``) of the agent's memory cgroup, which its
    workers share: a SIGKILL while it rose is an out-of-memory kill. Without a readable
    counter it never rises (an OOM kill then reads as ``signal``)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else _memory_events()
        self._seen = self.read()

    def read(self) -> int:
        try:
            for line in self.path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def rose(self) -> bool:
        """Whether the counter rose since the last call (or the counter's creation)."""
        now = self.read()
        rose, self._seen = now > self._seen, max(now, self._seen)
        return rose


def _memory_events() -> Path:
    """This process's OOM kill counter file: cgroup v2 ``memory.events`` (``/proc/self/cgroup``
    line ``0::/path``), else cgroup v1 ``memory.oom_control`` (line ``N:memory:/path``; both
    hold an ``oom_kill`` line), else the root's (a container sees its own cgroup as root)."""
    cands = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrl, path = line.split(":", 2)
            if ctrl == "":
                cands.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events")
            elif "memory" in ctrl.split(","):
                cands.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control")
    except (OSError, ValueError):
        pass
    cands += [Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control")]
    return next((c for c in cands if c.is_file()), cands[0])


def heartbeat_path(run_dir: Path, slot: int) -> Path:
    """A fresh heartbeat file for a worker in ``slot`` (a respawned slot gets a new one)."""
    return run_dir / f"slot{slot}-{time.time_ns()}.hb"


def spawn_worker(slot: int, link: WorkerEnv, env: Mapping[str, str], zygote: Zygote | None = None) -> WorkerProc:
    """Start a warm worker with its heartbeat file and log: forked by ``zygote`` when there
    is one and it agrees (:mod:`hotspare.agents.zygote`), else started
    (:func:`~hotspare.agents.worker_link.worker_command`). A zygote that cannot fork for a
    reason of its own is left in :attr:`Zygote.lost` for the agent to drop.

    ``env`` is the environment around the contract (the agent's own, the job's ``env``);
    ``link`` is the contract itself, and wins over ``env``."""
    hb = Heartbeat(link.hb)
    full = {**env, **link.to_env(), "PYTHONUNBUFFERED": "1"}
    logf = open(Path(link.log_dir) / f"worker-{link.node}-slot{slot}.log", "ab")
    try:
        proc: subprocess.Popen | ForkedProc | None = _fork(zygote, full, logf.fileno()) if zygote else None
        if proc is None:
            proc = subprocess.Popen(
                worker_command(),
                stdin=subprocess.PIPE,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=full,
            )
    finally:
        logf.close()
    return WorkerProc(slot=slot, proc=proc, hb=hb)


def _fork(zygote: Zygote, env: dict[str, str], log_fd: int) -> ForkedProc | None:
    try:
        return zygote.spawn(f"{WORKER_MODULE}:main", env, os.getcwd(), log_fd)
    except ZygoteRefused as e:
        log.warning("starting a worker the plain way: the zygote refused it (%s)", e)
    except OSError as e:
        zygote.lost = zygote.lost or str(e)
        log.warning("starting workers the plain way from now on: %s", e)
    return None
