"""``hotspare logs``: a job's log files, a rank's (with what its worker wrote while still warm),
a node agent's or all of them; ``--follow`` keeps printing until the job ends.

Where the files are: a worker writes to its slot's log, ``worker-<node>-slot<k>.log``, from its
start until it is assigned a rank, then to ``rank<r>.log`` (``agents/worker.py``). A slot's
successive workers share its log; the ``assigned`` events name the pid of every worker that
took a rank, and each worker's part of the slot log begins at its ``WORKER_STARTED`` line.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hotspare.agents.worker_link import WORKER_STARTED

from ..launchers import left_behind
from ..store import Event, EventKind, JobStore, StoreError
from .common import CliError, job_spec, jobstore, launched, launcher

_PID = re.compile(r"\bpid(\d+)\]")
POLL = 0.5  # seconds between reads of a followed file
GRACE = 2.0  # seconds a follow keeps reading after the job ended: the agents' last lines


def worker_parts(lines: list[str]) -> Iterator[tuple[int | None, list[str]]]:
    """A slot log cut into its workers' parts: (pid or None before any marked line, lines).

    A part begins at a worker's ``WORKER_STARTED`` line, or (a log older than that line) at a
    log line of another pid; unmarked lines (prints, tracebacks) belong to the part they follow."""
    pid: int | None = None
    part: list[str] = []
    for line in lines:
        m = _PID.search(line)
        new = m is not None and (WORKER_STARTED in line or int(m.group(1)) != pid)
        if new:
            if part:
                yield pid, part
            pid, part = int(m.group(1)), []  # type: ignore[union-attr]
        part.append(line)
    if part:
        yield pid, part


def assigned_workers(events: list[Event], rank: int) -> list[tuple[str, int]]:
    """(node, pid) of every worker that was handed ``rank``, in the order they were."""
    return [(str(e.data.get("node") or e.source), int(e.data["pid"])) for e in events
            if e.kind == EventKind.ASSIGNED and e.data.get("rank") == rank and e.data.get("pid")]


def pre_assignment(log_dir: Path, node: str, pid: int) -> tuple[Path, list[str]] | None:
    """What worker ``pid`` of ``node`` wrote before its assignment: (slot log, lines)."""
    for f in sorted(log_dir.glob(f"worker-{node}-slot*.log")):
        for p, lines in worker_parts(f.read_text(errors="replace").splitlines()):
            if p == pid:
                return f, lines
    return None


@dataclass
class Follower:
    """``tail -f`` of a few files (``files()`` is asked again every poll: rank logs appear as
    ranks are assigned). Complete lines only; a ``==> file <==`` header whenever the file
    changes; ``tail``: of what a file holds when first seen, only its last lines."""

    files: Callable[[], list[Path]]
    tail: int = 0
    out: Callable[[str], object] = print
    offsets: dict[Path, int] = field(default_factory=dict)
    last: Path | None = None

    def poll(self) -> None:
        for f in self.files():
            try:
                with open(f, "rb") as fh:
                    fh.seek(self.offsets.get(f, 0))
                    data = fh.read()
            except FileNotFoundError:
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            first = f not in self.offsets
            self.offsets[f] = self.offsets.get(f, 0) + len(complete)
            lines = complete.decode(errors="replace").splitlines()
            if first and self.tail:
                lines = lines[-self.tail:]
            if not lines:
                continue
            if self.last != f:
                self.out(f"==> {f} <==")
                self.last = f
            self.out("\n".join(lines))


def _job_over(js: JobStore | None, rec: dict | None) -> bool:
    """The job ended (its state; a scheduler job whose etcd is gone: its allocation)."""
    try:
        if js is not None:
            return js.state()[0].terminal
    except StoreError:
        pass
    return rec is not None and launcher(rec["backend"]).ended(rec["info"])


def _events(js: JobStore | None, rec: dict | None) -> list[Event]:
    if js is not None:
        try:
            return js.events()
        except StoreError:
            pass
    final = left_behind(rec, "final-events.json") or {}
    return [Event.from_json(json.dumps(e)) for e in final.get("events", [])]


def _where(args: argparse.Namespace) -> tuple[Path, JobStore | None, dict | None]:
    """The job's log directory, its JobStore (None: its etcd is gone) and launch record."""
    rec = launched(args, args.job)
    if rec is not None:  # scheduler jobs write logs to output_dir (a shared filesystem)
        try:
            js = jobstore(args)
        except CliError:
            js = None
        return Path(rec["output_dir"]) / "logs", js, rec
    js = jobstore(args)
    return job_spec(js).log_dir, js, None


def _print_file(f: Path, lines: list[str], tail: int, title: str = "") -> None:
    print(f"==> {f}{title} <==")
    print("\n".join(lines[-tail:] if tail else lines))


def cmd_logs(args: argparse.Namespace) -> int:
    log_dir, js, rec = _where(args)
    shown = False
    if args.rank is not None:
        for node, pid in assigned_workers(_events(js, rec), args.rank):
            found = pre_assignment(log_dir, node, pid)
            if found is not None:
                _print_file(found[0], found[1], args.tail, f" (worker pid {pid} before it took rank {args.rank})")
                shown = True
        files = [log_dir / f"rank{args.rank}.log"]
    elif args.node:
        files = [log_dir / f"agent-{args.node}.log"]
    else:
        files = sorted(log_dir.glob("*.log"))
    if args.follow:
        return _follow(args, log_dir, files, js, rec)
    for f in files:
        if f.exists():
            _print_file(f, f.read_text(errors="replace").splitlines(), args.tail)
        elif not shown:
            raise CliError(f"no log {f} (logs live on the node that ran it; local backend: {log_dir})")
    return 0


def _follow(args: argparse.Namespace, log_dir: Path, files: list[Path], js: JobStore | None,
            rec: dict | None) -> int:
    """Print what the files hold (the last --tail lines), then what is added, until the job
    ended (and GRACE seconds more: the agents' last lines) or Ctrl-C."""
    every = args.rank is None and not args.node  # all logs: files that appear later too
    follower = Follower(lambda: sorted(log_dir.glob("*.log")) if every else files, tail=args.tail,
                        out=lambda s: print(s, flush=True))
    ended_at = None
    try:
        while ended_at is None or time.monotonic() - ended_at < GRACE:
            follower.poll()
            if ended_at is None and _job_over(js, rec):
                ended_at = time.monotonic()
            time.sleep(POLL)
        follower.poll()
    except KeyboardInterrupt:  # like tail -f: Ctrl-C is how a follow of a running job ends
        pass
    return 0


def logs_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job")
    sp.add_argument("--rank", type=int, help="rank R's log, with what its worker(s) logged before taking rank R")
    sp.add_argument("--node", help="a node agent's log")
    sp.add_argument("--tail", type=int, default=0, help="only the last N lines (of each file)")
    sp.add_argument("-f", "--follow", action="store_true",
                    help="keep printing what is added, like tail -f, until the job ends (or Ctrl-C)")
