"""An etcd lease kept alive on one long-lived keepalive stream (the :class:`~.client.Store`'s
``lease()`` makes them)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .errors import StoreError

if TYPE_CHECKING:
    from .client import Store

log = logging.getLogger(__name__)


class Lease:
    """An etcd lease kept alive by a daemon thread well inside its TTL (every TTL/3, on one
    long-lived keepalive stream).

    ``lost`` is set when etcd says the lease is gone (expired or revoked): whoever holds
    it must consider itself fenced out. A temporary outage only delays keepalives; if
    etcd comes back before the TTL runs out nothing is lost.
    """

    def __init__(self, store: Store, ttl: int) -> None:
        self._store = store
        self.ttl = int(ttl)
        self._lease = store._call("lease grant", lambda: store._client.lease(self.ttl))
        self.id: int = self._lease.id
        self.lost = threading.Event()
        self.on_lost: Callable[[], object] = lambda: None  # called once ``lost`` is set (a loop's wake-up)
        self._paused = threading.Event()
        self._closed = threading.Event()
        self._period = max(self.ttl / 3.0, 0.1)  # what etcd's own client does
        self._thread = threading.Thread(target=self._keepalive, name=f"lease-{self.id:x}", daemon=True)
        self._thread.start()

    def _requests(self) -> Iterator[Any]:
        """The keepalive stream's requests: one per period while not paused, until closed."""
        from etcd3 import etcdrpc

        req = etcdrpc.LeaseKeepAliveRequest(ID=self.id)
        while not self._closed.is_set():
            if not self._paused.is_set():
                yield req
            self._closed.wait(self._period)

    def _keepalive(self) -> None:
        """One LeaseKeepAlive stream for the lease's life (a new stream per keepalive cost
        etcd a stream set-up each time, its largest steady-state load), opened again after
        an error; the lease is lost when etcd answers a keepalive with TTL <= 0. The first
        break after a keepalive got through is a warning, and an expiry says when a keepalive
        was last answered: a lease that expires says why."""
        quiet = False  # a break was said already and no keepalive got through since
        answered = time.monotonic()
        while not self._closed.is_set():
            client = self._store._client
            try:
                for resp in client.leasestub.LeaseKeepAlive(self._requests(), credentials=client.call_credentials,
                                                              metadata=client.metadata):
                    quiet = False
                    if resp.TTL <= 0:
                        log.warning("lease %x expired (TTL %ds; a keepalive was last answered %.1fs ago)",
                                    self.id, self.ttl, time.monotonic() - answered)
                        self._closed.set()
                        self.lost.set()
                        self.on_lost()
                        return
                    answered = time.monotonic()
            except Exception as e:  # noqa: BLE001 - etcd away or restarted: open a new stream
                log.log(logging.DEBUG if quiet else logging.WARNING,
                        "lease %x keepalive stream broke (retrying every %.1fs): %s", self.id,
                        min(self._period, 1.0), _details(e))
                quiet = True
            self._closed.wait(min(self._period, 1.0))

    def pause(self) -> None:
        """Stop sending keepalives (chaos: partition) without revoking."""
        self._paused.set()

    def resume(self) -> None:
        """Send keepalives again; if the lease expired meanwhile, ``lost`` is set."""
        self._paused.clear()

    def revoke(self) -> None:
        self._closed.set()
        try:
            self._store._call("lease revoke", lambda: self._store._client.revoke_lease(self.id))
        except StoreError:
            pass

    def close(self) -> None:
        """Stop the keepalives; the lease runs out after its TTL."""
        self._closed.set()


def _details(e: BaseException) -> str:
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        return f"{getattr(code(), 'name', code())}: {details()}"
    return f"{type(e).__name__}: {e}"
