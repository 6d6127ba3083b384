"""A ``torch.distributed.Store`` backed by etcd, for process-group rendezvous.

Every epoch's group is built on a fresh key prefix, so no state of a dead group leaks
into the next one, and nothing depends on a TCPStore server living in some rank that may
be the one that died. Blocking reads can be interrupted (``should_abort``) when the
control plane has already moved to a newer epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from .client import Compare, Store
from .errors import StoreUnavailable


class RendezvousAborted(RuntimeError):
    """The epoch this rendezvous belongs to was superseded while we waited."""


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

    def _k(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._store.put(self._k(key), value if isinstance(value, bytes) else value.encode())

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._store.get(self._k(key))
        assert kv is not None
        return kv.value

    def add(self, key: str, amount: int) -> int:
        k = self._k(key)
        while True:
            kv = self._store.get(k)
            cur = int(kv.value) if kv else 0
            new = cur + amount
            guard = Compare(k, "mod", "==", kv.mod_revision) if kv else Compare(k, "create", "==", 0)
            if self._store.txn([guard], puts={k: str(new)}):
                return new

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        k = self._k(key)
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
        return all(self._store.get(self._k(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        delay = 0.002
        pending = list(keys)
        while True:
            try:
                pending = [k for k in pending if self._store.get(self._k(k)) is None]
            except StoreUnavailable:
                pass
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
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    def delete_key(self, key: str) -> bool:
        existed = self._store.get(self._k(key)) is not None
        self._store.delete(self._k(key))
        return existed

    def num_keys(self) -> int:
        kvs, _ = self._store.get_prefix(self._prefix)
        return len(kvs)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
