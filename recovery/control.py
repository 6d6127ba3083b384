"""The worker's only link to the control plane: a background thread, never the step path.

It watches the job's epoch key (watch plus a slow poll as a fallback, so an etcd outage
costs latency, not correctness), tells the process group the moment a newer epoch exists,
publishes progress every ``progress_interval`` seconds (and at once after the first step
trained in each world), and writes queued events. The
training loop only reads plain attributes set here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from hotspare.orchestrator.store import Event, EventKind, JobStore, Progress, StoreError, World

log = logging.getLogger(__name__)


class Member(Protocol):
    """What the link reads of the training session (plain attributes the training thread
    sets; read here without a lock, a torn read costs one stale progress record at most)."""

    rank: int  # in the current epoch (events and progress are published under it)
    epoch: int  # joined; 0 before the first join
    committed: int  # last step completed with every collective in it
    step_time: float  # seconds of the last step
    compute_time: float  # EWMA of seconds per step outside collectives
    metrics: dict[str, float]


class ControlLink:
    def __init__(
        self,
        jobstore: JobStore,
        member: Member,
        node: str,
        on_epoch: Callable[[int], object],
        progress_interval: float = 10.0,
        poll_interval: float = 30.0,
    ) -> None:
        self.js = jobstore
        self._session = member
        self.node = node
        self._on_epoch = on_epoch
        self.progress_interval = progress_interval
        self.poll_interval = poll_interval
        self.latest_epoch = 0
        self._events: queue.Queue[Event] = queue.Queue()
        self._wake = threading.Event()
        self._epoch_changed = False  # set by the watch on the epoch key
        self._progress_now = False  # set by progress_now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hotspare-control", daemon=True)
        self._cancel_watch = lambda: None

    def start(self) -> None:
        self._cancel_watch = self.js.store.watch_prefix(self.js.keys.epoch, self._new_epoch)
        self._thread.start()

    def _new_epoch(self) -> None:
        self._epoch_changed = True
        self._wake.set()

    def stop(self, flush_timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(flush_timeout)
        self._cancel_watch()
        self._flush_events()

    def event(self, kind: EventKind | str, message: str = "", /, **data: object) -> None:
        """Queue an event under this rank's name (time taken now)."""
        self.put(Event(time=time.time(), kind=str(kind), source=f"rank{self._session.rank}", message=message,
                       data=dict(data)))

    def progress_now(self) -> None:
        """Publish a progress record at the next wake-up, not at the next interval (the first
        step trained in a new world: `hotspare status` shows it at once)."""
        self._progress_now = True
        self._wake.set()

    def put(self, ev: Event) -> None:
        """Queue a built event (:mod:`hotspare.orchestrator.store.events`); the control thread writes
        it, so the training thread never waits for etcd."""
        self._events.put(ev)
        self._wake.set()

    def world(self, epoch: int, timeout: float = 30.0) -> World:
        deadline = time.monotonic() + timeout
        while True:
            try:
                w = self.js.world(epoch)
                if w is not None:
                    return w
            except StoreError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of epoch {epoch} not readable after {timeout:.0f}s")
            time.sleep(0.05)

    def check_epoch(self) -> int:
        try:
            e = self.js.epoch()
        except StoreError:
            return self.latest_epoch
        if e > self.latest_epoch:
            self.latest_epoch = e
            self._on_epoch(e)
        return self.latest_epoch

    def _flush_events(self) -> None:
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                return
            try:
                self.js.put_event(ev)
            except StoreError:
                self._events.put(ev)  # keep it for later; etcd is away
                return

    def publish_progress(self) -> int:
        """Put this rank's progress (step, timings, metrics) now; returns the step put."""
        s = self._session
        self.js.put_progress(
            Progress(
                rank=s.rank,
                step=s.committed,
                epoch=s.epoch,
                node=self.node,
                time=time.time(),
                step_time=s.step_time,
                compute_time=s.compute_time,
                metrics=dict(s.metrics),
            )
        )
        return s.committed

    def _run(self) -> None:
        last_poll = last_progress = 0.0
        published = None
        while not self._stop.is_set():
            # sleeps until the watch (a new epoch), an event to write, or the next progress
            # record or safety read is due: nothing runs at a fixed short interval
            now = time.monotonic()
            due = min(last_poll + self.poll_interval, last_progress + self.progress_interval)
            self._wake.wait(max(due - now, 0.0))
            self._wake.clear()
            now = time.monotonic()
            if self._epoch_changed or now - last_poll >= self.poll_interval:
                self._epoch_changed = False
                self.check_epoch()  # one cheap get; the watch makes it prompt
                last_poll = now
            s = self._session
            if self._progress_now or now - last_progress >= self.progress_interval:
                self._progress_now, last_progress = False, now
                if s.epoch > 0 and s.committed != published:  # joined, and something new
                    try:
                        published = self.publish_progress()
                    except StoreError:
                        pass
            self._flush_events()
