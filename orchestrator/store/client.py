"""The only etcd client in hotspare: a thin, typed wrapper over python3-etcd3.

Everything here translates transport errors into :mod:`.errors` at the boundary, so the
controller and agents never see gRPC. Decisions are compare-and-set transactions; status
writes are plain puts that may fail without harm.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlparse

from .errors import Conflict, LeaseLost, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

ROOT = "/hotspare/"


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int


@dataclass(frozen=True)
class Compare:
    """A txn guard. ``op`` is one of ``==``, ``!=``, ``<``, ``>``; ``target`` one of
    ``value``, ``mod`` (mod_revision), ``version``, ``create``."""

    key: str
    target: str
    op: str
    value: bytes | int


@contextmanager
def _translate(what: str) -> Iterator[None]:
    import grpc
    from etcd3 import exceptions as ex

    try:
        yield
    except ValueError as e:  # python3-etcd3: "Trying to use a failed node"
        if "failed node" in str(e):
            raise StoreUnavailable(f"etcd unavailable during {what}: {e}") from e
        raise
    except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.NoServerAvailableError) as e:
        raise StoreUnavailable(f"etcd unavailable during {what}: {type(e).__name__}") from e
    except ex.PreconditionFailedError as e:
        raise Conflict(f"{what}: precondition failed") from e
    except ex.Etcd3Exception as e:
        raise StoreError(f"{what}: {type(e).__name__}: {e}") from e
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        name = getattr(code, "name", str(code))
        if name in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
            raise StoreUnavailable(f"etcd unavailable during {what}: {name}") from e
        if name == "NOT_FOUND" and "lease" in (e.details() or ""):
            raise LeaseLost(f"{what}: {e.details()}") from e
        raise StoreError(f"{what}: {name}: {e.details() if hasattr(e, 'details') else e}") from e


def _patch_etcd3() -> None:
    """python3-etcd3 0.13 uses ``six`` in its watch thread's error path without importing
    it, so every broken watch stream crashed that thread with a NameError."""
    import etcd3.watch

    if not hasattr(etcd3.watch, "six"):
        import six

        etcd3.watch.six = six


def parse_endpoint(url: str) -> tuple[str, int, bool]:
    """``http://host:port`` or ``host:port`` -> (host, port, tls)."""
    u = urlparse(url if "://" in url else f"http://{url}")
    if not u.hostname or not u.port:
        raise ValueError(f"etcd endpoint {url!r} must look like http://HOST:PORT")
    return u.hostname, u.port, u.scheme == "https"


class Lease:
    """An etcd lease kept alive by a daemon thread well inside its TTL.

    ``lost`` is set when etcd says the lease is gone (expired or revoked): whoever holds
    it must consider itself fenced out. A temporary outage only delays keepalives; if
    etcd comes back before the TTL runs out nothing is lost.
    """

    def __init__(self, store: Store, ttl: int) -> None:
        self._store = store
        self.ttl = int(ttl)
        with _translate("lease grant"):
            self._lease = store._client.lease(self.ttl)
        self.id: int = self._lease.id
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.id:x}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(self.ttl / 4.0, 0.1)
        while not self._stop.wait(interval):
            if self._paused.is_set():
                continue
            try:
                with _translate("lease keepalive"):
                    responses = list(self._store._client.refresh_lease(self.id))
                if responses and responses[0].TTL <= 0:
                    log.warning("lease %x expired", self.id)
                    self.lost.set()
                    return
            except StoreError as e:
                log.debug("keepalive failed (will retry): %s", e)

    def pause(self) -> None:
        """Stop sending keepalives (chaos: partition) without revoking."""
        self._paused.set()

    def resume(self) -> None:
        """Send keepalives again; if the lease expired meanwhile, ``lost`` is set."""
        self._paused.clear()

    def revoke(self) -> None:
        self._stop.set()
        try:
            with _translate("lease revoke"):
                self._store._client.revoke_lease(self.id)
        except StoreError:
            pass

    def close(self) -> None:
        self._stop.set()


class Store:
    """Connection to etcd with the handful of operations hotspare needs."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        import etcd3

        _patch_etcd3()
        if not endpoints:
            raise ValueError("Store needs at least one etcd endpoint")
        self.endpoints = list(endpoints)
        host, port, tls = parse_endpoint(self.endpoints[0])
        if tls and not ca_cert:
            raise ValueError(f"{self.endpoints[0]} is https: give the etcd CA certificate (ca_cert)")
        with _translate("connect"):
            self._client = etcd3.client(
                host=host,
                port=port,
                timeout=timeout,
                ca_cert=ca_cert,
                cert_key=key,
                cert_cert=cert,
                user=user,
                password=password,
                # reconnect within a second after an outage (gRPC's default backoff grows
                # to two minutes, which would keep us away long after etcd is back)
                grpc_options=[
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
        # python3-etcd3 marks an endpoint "failed" for 300 s after one error: with a single
        # endpoint the client would be useless for 5 minutes after a blip. Retry at once.
        for ep in getattr(self._client, "endpoints", {}).values():
            ep.time_retry = 0.0

    # -- reads ------------------------------------------------------------------------
    def get(self, key: str) -> KV | None:
        with _translate(f"get {key}"):
            value, meta = self._client.get(key)
        if value is None:
            return None
        return KV(key, value, meta.mod_revision, meta.create_revision)

    def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        """All keys under ``prefix`` at one revision, and that revision."""
        with _translate(f"get_prefix {prefix}"):
            resp = self._client.get_prefix_response(prefix, sort_order="ascend", sort_target="key")
        kvs = [
            KV(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision) for kv in resp.kvs
        ]
        return kvs, resp.header.revision

    def ping(self) -> None:
        with _translate("status"):
            self._client.status()

    # -- writes -----------------------------------------------------------------------
    def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> None:
        with _translate(f"put {key}"):
            self._client.put(key, value, lease=lease.id if lease else None)

    def delete(self, key: str) -> None:
        with _translate(f"delete {key}"):
            self._client.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        with _translate(f"delete_prefix {prefix}"):
            self._client.delete_prefix(prefix)

    def create(self, key: str, value: bytes | str, lease: Lease | None = None) -> bool:
        """Put ``key`` only if it does not exist. True if we created it."""
        return self.txn([Compare(key, "create", "==", 0)], puts={key: value}, lease=lease)

    def txn(
        self,
        compares: Sequence[Compare],
        puts: dict[str, bytes | str] | None = None,
        deletes: Sequence[str] = (),
        lease: Lease | None = None,
    ) -> bool:
        """Apply ``puts`` and ``deletes`` atomically iff every compare holds."""
        c = self._client
        tx = c.transactions
        guards = []
        for cmp in compares:
            target = {
                "value": tx.value,
                "mod": tx.mod,
                "version": tx.version,
                "create": tx.create,
            }[cmp.target](cmp.key)
            guards.append(
                {
                    "==": target.__eq__,
                    "!=": target.__ne__,
                    "<": target.__lt__,
                    ">": target.__gt__,
                }[cmp.op](cmp.value)
            )
        ops = [tx.put(k, v, lease=lease.id if lease else None) for k, v in (puts or {}).items()]
        ops += [tx.delete(k) for k in deletes]
        with _translate("txn"):
            ok, _ = c.transaction(compare=guards, success=ops, failure=[])
        return bool(ok)

    def lease(self, ttl: float) -> Lease:
        return Lease(self, max(1, int(round(ttl))))

    # -- watches ----------------------------------------------------------------------
    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (no arguments) on any change under ``prefix``.

        Watches are a latency optimisation only: every user also polls, so a watch lost
        during an etcd outage costs speed, not correctness. A broken watch stream is
        re-established in the background. Returns a cancel function.
        """
        state = {"id": None, "cancelled": False}
        lock = threading.Lock()

        def on_event(resp: object) -> None:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a watcher must never kill the watch thread
                log.exception("watch callback failed")
            if isinstance(resp, Exception):
                threading.Thread(target=establish, args=(1.0,), daemon=True).start()

        def establish(delay: float = 0.0) -> None:
            while True:
                if delay:
                    time.sleep(delay)
                with lock:
                    if state["cancelled"]:
                        return
                    try:
                        with _translate(f"watch {prefix}"):
                            state["id"] = self._client.add_watch_prefix_callback(prefix, on_event)
                        return
                    except (StoreError, ValueError) as e:
                        log.debug("watch on %s not established: %s", prefix, e)
                delay = 1.0

        try:
            with _translate(f"watch {prefix}"):
                state["id"] = self._client.add_watch_prefix_callback(prefix, on_event)
        except StoreError:
            threading.Thread(target=establish, args=(1.0,), daemon=True).start()

        def cancel() -> None:
            with lock:
                state["cancelled"] = True
                wid = state["id"]
            if wid is not None:
                try:
                    self._client.cancel_watch(wid)
                except Exception:  # noqa: BLE001
                    pass

        return cancel

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass


def wait_until(
    predicate: Callable[[], bool], timeout: float, interval: float = 0.05
) -> bool:
    """Poll ``predicate`` until true or ``timeout``; store outages count as 'not yet'."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return True
        except StoreUnavailable:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
