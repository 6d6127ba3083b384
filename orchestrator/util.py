"""Small helpers every hotspare process uses: the lowest layer, standard library only.

* :func:`atomic_write` -- a file appears whole or not at all (tmp, fsync, rename);
  :func:`atomic_target` the same for writers that take a path.
* :class:`PeriodicWorker` -- one named daemon thread running ``once()`` every interval,
  with a stop that wakes it; a failing round is logged, never fatal.
* :func:`pid_alive` -- a process exists and is not a zombie.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("hotspare")


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, fsync: bool = True,
                 mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The temporary file sits beside the target (same filesystem, so the rename is atomic) and
    has a name of its own per writer (two writers never share a temp file). ``fsync`` makes
    the content durable before the rename; the directory entry is synced too."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    with atomic_target(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is None else mode)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    if fsync:
        fsync_dir(path.parent)
    return path


@contextlib.contextmanager
def atomic_target(path: str | os.PathLike[str]) -> Iterator[Path]:
    """For writers that take a path (``safetensors.save_file``): yields a temporary path beside
    ``path`` and renames it over ``path`` if the block succeeds, removes it if not. Nothing is
    held in memory, unlike :func:`atomic_write`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Waker:
    """A wake-up a loop blocks on, set from any thread *and from a signal handler*: a
    self-pipe (``os.write`` is async-signal-safe, unlike a ``threading.Event``, whose lock
    the interrupted thread may hold). ``wait`` consumes every pending ``set``."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is pending already; closed: nobody waits
            pass

    def wait(self, timeout: float | None) -> bool:
        """Block until :meth:`set` or ``timeout`` seconds; True if set (and now cleared)."""
        try:
            ready = select.select([self._r], [], [], timeout)[0]
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            ready = []
        if ready:
            self.clear()
        return bool(ready)

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class PeriodicWorker:
    """Run ``once()`` every ``interval`` seconds on a daemon thread until :meth:`stop`, and
    at once whenever :meth:`kick` is called (an event-driven service kicks it when there is
    work and keeps ``interval`` long, a safety net for a missed kick).

    Subclasses override :meth:`once` (or pass ``fn``). An exception in one round is logged
    with the thread's name and the loop goes on: a background service of a long job must
    not die of one bad round. ``interval`` may be a callable, re-read every round."""

    def __init__(self, name: str, interval: float | Callable[[], float],
                 fn: Callable[[], object] | None = None) -> None:
        self.name = name
        self._interval = interval
        self._fn = fn
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None

    def once(self) -> object:
        if self._fn is None:
            raise NotImplementedError
        return self._fn()

    def interval(self) -> float:
        return float(self._interval() if callable(self._interval) else self._interval)

    def start(self) -> PeriodicWorker:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def kick(self) -> None:
        """Run a round now (or right after the one in progress)."""
        self._kick.set()

    def stop(self, join: float = 2.0) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join)

    def _run(self) -> None:
        while True:
            self._kick.wait(self.interval())
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                self.once()
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                log.exception("%s: round failed", self.name)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie child is reaped and counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child still answers kill(0); reap it if it is ours
        wpid, _ = os.waitpid(pid, os.WNOHANG)
        if wpid == pid:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
