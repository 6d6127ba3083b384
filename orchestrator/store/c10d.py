"""A ``torch.distributed.Store`` backed by etcd, for process-group rendezvous.

Every epoch's group is built on a fresh key prefix, so no state of a dead group leaks
into the next one, and nothing depends on a TCPStore server living in some rank that may
be the one that died. Blocking reads can be interrupted (``should_abort``) when the
control plane has already moved to a newer epoch.

What a rendezvous costs etcd (issue 15; ``benchmarks/rendezvous_ops.py``). Gloo's full mesh
has every rank ``set`` its address, then ``wait`` for and ``get`` every rank's (its own
included, torch 2.13): one request per key would be 3N² + N per epoch. Here a rank reads the
whole *directory* of a key it lacks (the prefix up to the key's last ``/``: gloo's ``0/``,
holding every rank's address) in one range request and keeps the values; a key still missing
is waited for with a watch on that directory, started just after the read, whose events carry
the values (no read per event); the watch outlives the wait by :data:`WATCH_LINGER_S`, so
gloo's next ``wait`` is answered by it. A rank costs a ``put``, a read, a watch created and
cancelled: O(N) per epoch, whatever the order in which ranks arrive.

Only values that are **written once** are served from the cache, because torch never
rewrites them within a prefix (gloo's and NCCL's addresses and unique ids; torchrun's agents
use a fresh prefix per round): a value is kept only if etcd says it was written once
(``mod_revision == create_revision``), it is not a decimal integer (what ``add`` writes:
counters are always read from etcd), and this process never ``add``-ed, ``compare_set``,
deleted nor rewrote the key. A key seen rewritten or deleted is never cached again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch.distributed as dist

from .client import KV, Compare, Store
from .errors import StoreError, StoreUnavailable

log = logging.getLogger(__name__)

#: seconds a directory's watch outlives the last ``wait`` (gloo waits for one key after another)
WATCH_LINGER_S = 2.0
#: a waiting rendezvous checks ``should_abort`` and calls ``on_wait`` at least this often (s)
WAIT_SLICE_S = 0.05
#: a waiter whose directory is watched still reads it this often (s): a watch etcd ends
#: silently (python-etcd3 drops a "canceled" response) must cost time, not the rendezvous
SAFETY_READ_S = 2.0
#: what ``add`` writes; such a value may be a counter and is never served from the cache
_COUNTER = re.compile(rb"-?[0-9]+\Z")


class RendezvousAborted(RuntimeError):
    """The epoch this rendezvous belongs to was superseded while we waited."""


class _Watch:
    """A watch on one directory of the prefix: the keys present there (as of the read it
    started after, then its events) while ``live``."""

    __slots__ = ("dir", "id", "live", "seen")

    def __init__(self, directory: str, seen: set[str]) -> None:
        self.dir = directory
        self.id: object = None
        self.seen = seen
        self.live = True


def _dir(key: str) -> str:
    """The directory a key is read and watched with: up to its last ``/`` ("" for none)."""
    return key[: key.rfind("/") + 1]


class EtcdC10dStore(dist.Store):
    def __init__(
        self,
        store: Store,
        prefix: str,
        timeout: timedelta = timedelta(seconds=60),
        should_abort: Callable[[], bool] = lambda: False,
        on_wait: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix.rstrip("/") + "/"
        self._timeout = timeout
        self._should_abort = should_abort
        self._on_wait = on_wait
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a watch event arrived, or a watch broke
        self._cache: dict[str, bytes] = {}  # write-once values, by key (without the prefix)
        self._mutable: set[str] = set()  # keys never served from the cache
        self._watches: dict[str, _Watch] = {}  # live ones, by directory
        self._reads: dict[str, tuple[int, set[str]]] = {}  # last read of a directory: revision, keys
        self._waiting = 0
        self._last_wait = 0.0
        self._janitor: threading.Thread | None = None

    def _k(self, key: str) -> str:
        return self._prefix + key

    # -- the c10d Store interface ------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._store.put(self._k(key), value if isinstance(value, bytes) else value.encode())
        with self._lock:
            if key in self._cache:  # rewritten (by us): etcd's value from now on
                self._forget(key)

    def get(self, key: str) -> bytes:
        while True:
            with self._lock:
                value = self._cache.get(key)
            if value is not None:
                return value
            self.wait([key])
            with self._lock:
                value = self._cache.get(key)
            if value is not None:
                return value
            kv = self._store.get(self._k(key))  # a counter, or a key written more than once
            if kv is not None:
                return kv.value

    def add(self, key: str, amount: int) -> int:
        k = self._k(key)
        with self._lock:
            self._forget(key)
        while True:
            kv = self._store.get(k)
            cur = int(kv.value) if kv else 0
            new = cur + amount
            guard = Compare(k, "mod", "==", kv.mod_revision) if kv else Compare(k, "create", "==", 0)
            if self._store.txn([guard], puts={k: str(new)}):
                return new

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        k = self._k(key)
        with self._lock:
            self._forget(key)
        exp = expected if isinstance(expected, bytes) else expected.encode()
        des = desired if isinstance(desired, bytes) else desired.encode()
        kv = self._store.get(k)
        if kv is None and exp == b"":
            if self._store.create(k, des):
                return des
        elif kv is not None and kv.value == exp:
            if self._store.txn([Compare(k, "mod", "==", kv.mod_revision)], puts={k: des}):
                return des
        kv = self._store.get(k)
        return kv.value if kv else exp

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            missing = [k for k in keys if k not in self._cache]
        for key in missing:
            kv = self._store.get(self._k(key))
            if kv is None:
                return False
            with self._lock:
                self._absorb(key, kv.value, kv.mod_revision, kv.create_revision)
        return True

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        found: set[str] = set()  # keys read present during this call (the cache keeps only some)
        delay = 0.002
        last_read = time.monotonic()  # a live watch needs no read at first: it is up to date
        with self._lock:
            self._waiting += 1
        try:
            while True:
                now = time.monotonic()
                with self._lock:
                    pending = self._pending(keys, found)
                    if not pending:
                        return
                    dirs = sorted({_dir(k) for k in pending})
                    unwatched = [d for d in dirs if d not in self._watches]
                to_read = dirs if now - last_read >= SAFETY_READ_S else unwatched
                if to_read:
                    last_read = now
                    can_watch = deadline - now > WAIT_SLICE_S
                    for d in to_read:
                        if can_watch and d in unwatched and self._resume(d):
                            continue
                        try:
                            found |= self._read(d, pending, watch=can_watch)
                        except StoreUnavailable:
                            pass
                    with self._lock:
                        pending = self._pending(keys, found)
                    if not pending:
                        return
                if self._should_abort():
                    raise RendezvousAborted(f"rendezvous under {self._prefix} superseded")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rendezvous timed out after {limit:.0f}s waiting for {pending} under "
                        f"{self._prefix}"
                    )
                self._on_wait()
                with self._lock:
                    if all(_dir(k) in self._watches for k in pending):
                        if self._pending(keys, found):  # checked under the lock events take: none is lost
                            self._changed.wait(min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic())))
                        continue
                time.sleep(delay)  # no watch (etcd unreachable, or refusing one): poll
                delay = min(delay * 1.5, 0.05)
        finally:
            with self._lock:
                self._waiting -= 1
                self._last_wait = time.monotonic()

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._forget(key)
        existed = self._store.get(self._k(key)) is not None
        self._store.delete(self._k(key))
        return existed

    def num_keys(self) -> int:
        kvs, _ = self._store.get_prefix(self._prefix)
        return len(kvs)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def close(self) -> None:
        """Cancel the watches now (they also end by themselves, :data:`WATCH_LINGER_S` after
        the last ``wait``). The store stays usable."""
        with self._lock:
            gone = self._take_watches()
        self._cancel(gone)

    # -- reads, the cache and the watches ----------------------------------------------------
    def _pending(self, keys: Iterable[str], found: set[str]) -> list[str]:
        """(lock held) The keys not known to be present."""
        out = []
        for k in keys:
            if k in self._cache or k in found:
                continue
            w = self._watches.get(_dir(k))
            if w is None or k not in w.seen:
                out.append(k)
        return out

    def _forget(self, key: str) -> None:
        """(lock held) ``key`` is (or may be) written more than once: never serve it from the cache."""
        self._mutable.add(key)
        self._cache.pop(key, None)

    def _absorb(self, key: str, value: bytes, mod_revision: int, create_revision: int) -> None:
        """(lock held) Keep ``value`` if it is a write-once value (see the module's doc)."""
        if mod_revision != create_revision:
            self._forget(key)
        elif key not in self._mutable and not _COUNTER.match(value):
            self._cache[key] = value

    def _read(self, d: str, pending: list[str], watch: bool) -> set[str]:
        """Read directory ``d`` (one request) and keep its write-once values; with ``watch``
        and keys of ``pending`` still missing there, watch it from just after that read.
        Returns the keys present."""
        kvs, revision = self._store.get_prefix(self._prefix + d)
        n = len(self._prefix)
        present = {kv.key[n:] for kv in kvs}
        with self._lock:
            for kv in kvs:
                self._absorb(kv.key[n:], kv.value, kv.mod_revision, kv.create_revision)
            self._reads[d] = (revision, present)
            w = self._watches.get(d)
            if w is not None:  # a safety read: add what it found (events may already be newer)
                w.seen |= present
            missing = any(_dir(k) == d and k not in present and k not in self._cache for k in pending)
        if watch and w is None and missing:
            self._watch(d, present, revision)
        return present

    def _resume(self, d: str) -> bool:
        """Watch directory ``d`` from just after its last read, instead of reading it again (a
        rank that found every key it waited for so far, then misses one). True if it is watched."""
        with self._lock:
            last = self._reads.get(d)
        if last is None:
            return False
        revision, seen = last
        self._watch(d, seen, revision)  # etcd replays what changed since; compacted away: no watch
        with self._lock:
            return d in self._watches

    def _watch(self, d: str, seen: set[str], revision: int) -> None:
        """Watch directory ``d`` from ``revision + 1`` (what the read of ``seen`` at ``revision``
        did not see). On failure nothing is watched: the waiter polls."""
        w = _Watch(d, set(seen))
        n = len(self._prefix)

        def on_changes(changes: list[tuple[KV, bool]] | Exception) -> None:  # the watch thread: quick, no request
            with self._lock:
                if not w.live:
                    return
                if isinstance(changes, Exception):  # the stream broke or the revision was compacted: read again
                    w.live = False
                    if self._watches.get(d) is w:
                        del self._watches[d]
                else:
                    for kv, deleted in changes:
                        key = kv.key[n:]
                        if deleted:
                            w.seen.discard(key)
                            self._forget(key)
                        else:
                            w.seen.add(key)
                            self._absorb(key, kv.value, kv.mod_revision, kv.create_revision)
                self._changed.notify_all()

        try:
            w.id = self._store.watch_changes(self._prefix + d, on_changes, start_revision=revision + 1)
        except (StoreError, ValueError) as e:
            log.debug("no watch on %s%s: %s", self._prefix, d, e)
            return
        with self._lock:
            extra = not w.live or d in self._watches  # broke already, or another thread watches d
            if not extra:
                self._watches[d] = w
                if self._janitor is None:
                    self._janitor = threading.Thread(target=self._linger, name="hotspare-c10d-watch", daemon=True)
                    self._janitor.start()
        if extra:
            w.live = False
            self._cancel([w])

    def _linger(self) -> None:
        """Cancel the watches once no ``wait`` has needed them for :data:`WATCH_LINGER_S`."""
        while True:
            time.sleep(WATCH_LINGER_S / 4)
            with self._lock:
                if self._watches and (self._waiting or time.monotonic() - self._last_wait < WATCH_LINGER_S):
                    continue
                gone = self._take_watches()
                self._janitor = None
            self._cancel(gone)
            return

    def _take_watches(self) -> list[_Watch]:
        """(lock held) Every live watch, marked dead."""
        gone = list(self._watches.values())
        self._watches.clear()
        for w in gone:
            w.live = False
        return gone

    def _cancel(self, watches: list[_Watch]) -> None:
        for w in watches:
            if w.id is None:
                continue
            try:
                self._store.cancel_watch(w.id)
            except Exception as e:  # noqa: BLE001 - a watch the stream already lost
                log.debug("cancelling the watch on %s%s: %s", self._prefix, w.dir, e)
