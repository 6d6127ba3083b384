"""Doorbells between a worker and its agent: a named pipe per direction, no polling.

A :class:`Bell` is the receiving end: it creates the FIFO (mode 0600, in the run directory,
itself 0700) and blocks in ``select`` until someone rings or the timeout passes. A
:class:`Ringer` is a sending end: it writes one byte, never blocks and never fails --
nobody listening, a full pipe (a ring is pending already) or a FIFO not made yet all just
mean "nothing to do". The bytes carry no meaning: whoever wakes reads the shared state it
cares about (control blocks, heartbeats) and acts on that, so a lost, spurious or doubled
ring costs at most one look. That is also why the receivers keep a slow safety timeout.

Why FIFOs: they live in the 0700 run directory, so only the job's user can ring; opening a
path has no 108-byte limit (a Unix socket's has, and run directory names are long); and a
reader opened ``O_RDWR`` never sees end-of-file when writers come and go.

Standard library only: the agent and every worker import this.
"""

from __future__ import annotations

import os
import select
import stat
from pathlib import Path

#: The agent's bell in its run directory: workers ring it when a snapshot point starts or
#: completes and when they become warm.
AGENT_BELL = "agent.bell"


def confirm_bell(sid: int) -> str:
    """The bell of seat ``sid``'s worker in the run directory: the agent rings it after it
    confirmed one of the worker's points replicated."""
    return f"confirm-{sid}.bell"


class Bell:
    """The receiving end of a doorbell at ``path`` (created if missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            os.mkfifo(self.path, 0o600)
        except FileExistsError:
            if not stat.S_ISFIFO(os.lstat(self.path).st_mode):
                raise RuntimeError(f"{self.path} exists and is not a FIFO") from None
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)

    def fileno(self) -> int:
        return self._fd

    def wait(self, timeout: float | None) -> bool:
        """Block until a ring or ``timeout`` seconds (None: forever); True if rung. Every
        pending ring is consumed: rings while nobody waited wake one wait, not many."""
        if self._fd < 0:
            return False
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if ready:
            self.drain()
        return bool(ready)

    def drain(self) -> None:
        try:
            while os.read(self._fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self, unlink: bool = False) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            self.path.unlink(missing_ok=True)


class Ringer:
    """A sending end of the doorbell at ``path``; the pipe is opened on first use and again
    after it went away (the receiver restarted)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = -1

    def ring(self) -> bool:
        """One byte down the pipe. False when nobody is listening (no FIFO, no reader)."""
        for _ in range(2):
            if self._fd < 0:
                try:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:  # ENOENT / ENXIO (no reader) / ELOOP: nobody to wake
                    return False
            try:
                os.write(self._fd, b"\0")
                return True
            except BlockingIOError:
                return True  # the pipe is full: the receiver has rings waiting already
            except OSError:  # EPIPE: the reader went away; try a fresh open once
                self.close()
        return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
