"""Worker <-> agent through a 64-byte memory-mapped file: no syscall per beat.

Worker -> agent: (state, step, time) at every step and while it waits inside a collective
or a rendezvous; the agent reads it a few times a second. A SIGSTOPped or deadlocked
worker stops beating and the agent's watchdog kills it after ``hang_timeout``.

Agent -> worker: ``delay``, seconds the worker sleeps after each step (chaos
``slow-rank`` delivered without touching the step path's etcd-free rule), and the
compute-time score the worker reports (seconds per step outside collectives).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

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
