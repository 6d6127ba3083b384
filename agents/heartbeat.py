"""Worker -> agent liveness through a 32-byte memory-mapped file: no syscall per beat.

The worker writes (state, step, time) at every step and while it waits inside a
collective or a rendezvous; the agent reads it a few times a second. A SIGSTOPped or
deadlocked worker stops beating and the agent's watchdog kills it after
``hang_timeout``.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

_FMT = "<qqdq"  # state, step, beat time (unix), pid
SIZE = struct.calcsize(_FMT)

STARTING, WARM, RUNNING, FINISHED = 0, 1, 2, 3
STATE_NAMES = {STARTING: "starting", WARM: "warm", RUNNING: "running", FINISHED: "finished"}


class Heartbeat:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists() or self.path.stat().st_size < SIZE:
            with open(self.path, "wb") as f:
                f.write(struct.pack(_FMT, STARTING, -1, 0.0, 0))
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._state = STARTING

    def beat(self, step: int, state: int | None = None) -> None:
        if state is not None:
            self._state = state
        struct.pack_into(_FMT, self._mm, 0, self._state, step, time.time(), os.getpid())

    def read(self) -> tuple[int, int, float, int]:
        return struct.unpack_from(_FMT, self._mm, 0)

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
