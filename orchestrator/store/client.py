"""The only etcd client in hotspare: a thin, typed wrapper over python3-etcd3.

Everything here translates transport errors into :mod:`.errors` at the boundary, so the
controller and agents never see gRPC. Decisions are compare-and-set transactions; status
writes are plain puts that may fail without harm.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import QUOTA_FIX, Conflict, LeaseLost, StoreError, StoreFull, StoreUnavailable
from .lease import Lease
from .options import (  # noqa: F401 - re-exported: these lived here
    ENV_OPTIONS,
    PASSWORD_FILE_ENV,
    _check_options,
    connect_error,
    connect_hint,
    parse_endpoint,
    store_options_from_env,
)

log = logging.getLogger(__name__)

ROOT = "/hotspare/"
#: the largest answer a client accepts from etcd (gRPC's own default is 4 MB)
MAX_ANSWER = 256 * 1024 * 1024

T = TypeVar("T")

class TokenExpired(StoreUnavailable):
    """etcd no longer knows our auth token (it restarted: simple tokens live in its memory)."""


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


def _guard(tx: Any, cmp: Compare) -> Any:
    """python3-etcd3's form of ``cmp`` (KeyError for an unknown target or op)."""
    target = {"value": tx.value, "mod": tx.mod, "version": tx.version,
              "create": tx.create}[cmp.target](cmp.key)
    return {"==": target.__eq__, "!=": target.__ne__, "<": target.__lt__,
            ">": target.__gt__}[cmp.op](cmp.value)


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
        details = _grpc_details(e)
        raise StoreUnavailable(f"etcd unavailable during {what}: {type(e).__name__}"
                               + (f" ({details})" if details else "")) from e
    except ex.PreconditionFailedError as e:
        raise Conflict(f"{what}: precondition failed") from e
    except ex.Etcd3Exception as e:
        raise StoreError(f"{what}: {type(e).__name__}: {e}") from e
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        name = getattr(code, "name", str(code))
        details = (e.details() if hasattr(e, "details") else str(e)) or ""
        if name in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
            raise StoreUnavailable(f"etcd unavailable during {what}: {name}: {details}") from e
        if name == "NOT_FOUND" and "lease" in details:
            raise LeaseLost(f"{what}: {details}") from e
        if name == "UNAUTHENTICATED" and "invalid auth token" in details:
            raise TokenExpired(f"{what}: {details}") from e
        if name == "RESOURCE_EXHAUSTED" and "space exceeded" in details:
            raise StoreFull(f"etcd refused {what}: its space quota is exhausted ({details}, the NOSPACE alarm); "
                            f"nothing can be recorded until then: {QUOTA_FIX}") from e
        raise StoreError(f"{what}: {name}: {details}") from e


def _grpc_details(e: BaseException) -> str:
    """What gRPC said under an etcd3 exception (python3-etcd3 raises its own, detail-free
    exceptions from inside the handler of the gRPC error, so that error is the context)."""
    inner = e.__context__
    details = getattr(inner, "details", None)
    return (details() or "") if callable(details) else ""


#: seconds gRPC's Python layer blocks per slice while it waits on a call or a stream
GRPC_WAIT_SLICE = 1.0


def _patch_etcd3() -> None:
    """python3-etcd3 0.13 uses ``six`` in its watch thread's error path without importing
    it, so every broken watch stream crashed that thread with a NameError."""
    import etcd3.watch

    if not hasattr(etcd3.watch, "six"):
        import six

        etcd3.watch.six = six
    # gRPC's Python side waits on a stream in 0.1 s slices (so that a signal handler on the
    # thread runs within 0.1 s): each watch thread woke 10 times a second for nothing, the
    # largest steady-state CPU cost of an idle agent. A response still wakes a wait at once
    # (the condition is notified); only an interrupted main thread waits up to this long.
    import grpc._common

    if getattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT", 1.0) < GRPC_WAIT_SLICE:
        grpc._common.MAXIMUM_WAIT_TIMEOUT = GRPC_WAIT_SLICE


def _safely(fn: Callable[..., object], *args: object) -> None:
    """A watch callback: whatever it raises is logged, never kills the watch thread."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a watcher must never kill the watch thread
        log.exception("watch callback failed")


class Store:
    """Connection to etcd with the handful of operations hotspare needs.

    An ``https://`` endpoint means TLS: ``ca_cert`` verifies the server, ``cert``/``key`` are
    the client certificate when etcd asks for one (``--client-cert-auth``). ``user`` and
    ``password`` authenticate to an etcd with auth enabled; the password is kept in this
    object only, to renew the token when etcd forgets it.
    """

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
        self.endpoint = self.endpoints[0]
        host, port, tls = parse_endpoint(self.endpoint)
        _check_options(self.endpoint, tls, ca_cert, cert, key, user, password)
        self._timeout = timeout
        self._credentials = (user, password) if user is not None else None
        self._token_lock = threading.Lock()
        with _translate("connect"):  # with a user, this authenticates (the first RPC)
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
                    # gRPC refuses answers over 4 MB by default: a job's node records alone
                    # are ~2 MB at 10,000 nodes (benchmarks/scale.py). etcd bounds requests itself
                    ("grpc.max_receive_message_length", MAX_ANSWER),
                ],
            )
        # python3-etcd3 sends the auth token twice, as metadata and as gRPC call credentials;
        # gRPC refuses call credentials on a plaintext channel. etcd reads the metadata.
        self._client.call_credentials = None
        # python3-etcd3 marks an endpoint "failed" for 300 s after one error: with a single
        # endpoint the client would be useless for 5 minutes after a blip. Retry at once.
        for ep in getattr(self._client, "endpoints", {}).values():
            ep.time_retry = 0.0

    @classmethod
    def from_env(
        cls, endpoints: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
        timeout: float = 5.0,
    ) -> Store:
        """The connection a hotspare process inherits: endpoints from ``$HOTSPARE_ETCD``
        (unless given), TLS and auth from :data:`ENV_OPTIONS`."""
        e = os.environ if env is None else env
        if endpoints is None:
            endpoints = [x for x in e.get("HOTSPARE_ETCD", "").split(",") if x]
            if not endpoints:
                raise ValueError("HOTSPARE_ETCD is not set (comma-separated etcd endpoints)")
        return cls(endpoints, timeout=timeout, **store_options_from_env(e))

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one etcd request with errors translated. An auth token etcd no longer knows
        is renewed (once per expiry, whichever thread sees it first) and the request retried."""
        token = self._client.metadata
        try:
            with _translate(what):
                return fn()
        except TokenExpired:
            if self._credentials is None:
                raise
            self._renew_token(token)
        with _translate(what):
            return fn()

    def _renew_token(self, stale: object) -> None:
        from etcd3 import etcdrpc

        user, password = self._credentials
        with self._token_lock:
            if self._client.metadata is not stale:
                return  # another thread renewed it meanwhile
            with _translate("authenticate"):
                resp = self._client.authstub.Authenticate(
                    etcdrpc.AuthenticateRequest(name=user, password=password), self._timeout)
            self._client.metadata = (("token", resp.token),)
            watcher = self._client._stubs.get("watcher")
            if watcher is not None:  # it copied the old token for the streams it opens
                watcher._metadata = self._client.metadata
        log.info("etcd auth token renewed for user %s", user)

    # -- reads ------------------------------------------------------------------------
    def get(self, key: str) -> KV | None:
        value, meta = self._call(f"get {key}", lambda: self._client.get(key))
        if value is None:
            return None
        return KV(key, value, meta.mod_revision, meta.create_revision)

    def get_prefix(self, prefix: str, since: int = 0) -> tuple[list[KV], int]:
        """All keys under ``prefix`` at one revision (with ``since``, only those written
        after that revision: what is new to a follower), and that revision."""
        extra = {"min_mod_revision": since + 1} if since else {}
        resp = self._call(f"get_prefix {prefix}", lambda: self._client.get_prefix_response(
            prefix, sort_order="ascend", sort_target="key", **extra))
        kvs = [
            KV(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision) for kv in resp.kvs
        ]
        return kvs, resp.header.revision

    def get_many(self, keys: Sequence[str], prefixes: Sequence[str] = (),
                 ranges: Sequence[tuple[str, str]] = ()) -> list[KV]:
        """Several keys, prefixes and key ranges ``[start, end)`` in one round trip (one
        read-only transaction: one revision), for a reader that needs a handful of records,
        not a whole prefix."""
        from etcd3 import transactions, utils

        ops = [transactions.Get(k) for k in keys]
        ops += [transactions.Get(p, utils.prefix_range_end(p.encode())) for p in prefixes]
        ops += [transactions.Get(a, b) for a, b in ranges]
        _, responses = self._call("get_many", lambda: self._client.transaction(compare=[], success=ops, failure=[]))
        return [KV(meta.key.decode(), value, meta.mod_revision, meta.create_revision)
                for found in responses for value, meta in found]

    def ping(self, key: str = ROOT) -> None:
        """One read of ``key`` (hotspare's root key, or a key of the one job a command is
        about): proves the connection, the credentials and the permission to read (etcd
        answers a status request even without credentials). A role limited to one job's
        prefixes can read the job's keys, not the root's."""
        self._call(f"get {key}", lambda: self._client.get(key))

    def alarms(self) -> list[str]:
        """etcd's raised alarms by name (``NOSPACE``: its space quota is exhausted)."""
        from etcd3 import etcdrpc

        found = self._call("alarm list", lambda: list(self._client.list_alarms()))
        return sorted({etcdrpc.AlarmType.Name(a.alarm_type) for a in found})

    # -- writes -----------------------------------------------------------------------
    def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> None:
        self._call(f"put {key}", lambda: self._client.put(key, value, lease=lease.id if lease else None))

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self._client.delete(key))

    def delete_prefix(self, prefix: str) -> None:
        self._call(f"delete_prefix {prefix}", lambda: self._client.delete_prefix(prefix))

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
        guards = [_guard(tx, cmp) for cmp in compares]
        ops = [tx.put(k, v, lease=lease.id if lease else None) for k, v in (puts or {}).items()]
        ops += [tx.delete(k) for k in deletes]
        ok, _ = self._call("txn", lambda: c.transaction(compare=guards, success=ops, failure=[]))
        return bool(ok)

    def lease(self, ttl: float) -> Lease:
        return Lease(self, max(1, int(round(ttl))))

    # -- watches ----------------------------------------------------------------------
    def watch_changes(self, prefix: str, on_changes: Callable[[list[tuple[KV, bool]] | Exception], object],
                      start_revision: int = 0) -> object:
        """One plain watch of ``prefix`` (from ``start_revision`` when given): ``on_changes`` gets
        each response's changes as ``(kv, deleted)`` pairs, on etcd3's watch thread (be quick),
        or the exception that ended the stream (nothing more comes then). Returns the watch id
        for :meth:`cancel_watch`. Not re-established: :meth:`watch_prefix` is the one that is."""
        from etcd3.events import DeleteEvent

        def on_event(resp: Any) -> None:
            if isinstance(resp, Exception):
                on_changes(resp)
                return
            on_changes([(KV(ev.key.decode(), ev.value, ev.mod_revision, ev.create_revision),
                         isinstance(ev, DeleteEvent)) for ev in resp.events])

        extra = {"start_revision": start_revision} if start_revision else {}
        return self._call(f"watch {prefix}", lambda: self._client.add_watch_prefix_callback(prefix, on_event, **extra))

    def cancel_watch(self, watch_id: object) -> None:
        self._call("cancel_watch", lambda: self._client.cancel_watch(watch_id))

    def watch_prefix(self, prefix: str, callback: Callable[[], None],
                     on_kvs: Callable[[list[tuple[KV, bool]]], None] | None = None) -> Callable[[], None]:
        """Call ``callback()`` (no arguments) on any change under ``prefix`` -- or, given
        ``on_kvs``, that with the changes themselves (``(kv, deleted)`` pairs) instead.

        Watches are a latency optimisation only: every user also polls, so a watch lost
        during an etcd outage costs speed, not correctness. A broken watch stream is
        re-established in the background, and ``callback`` called once more then: what
        changed while it was down was never delivered. Returns a cancel function.
        """
        state: dict[str, Any] = {"id": None, "cancelled": False}
        lock = threading.Lock()

        def on_changes(changes: object) -> None:
            if on_kvs is not None and isinstance(changes, list):
                _safely(on_kvs, changes)
                return
            _safely(callback)
            if isinstance(changes, Exception):
                threading.Thread(target=establish, args=(1.0,), daemon=True).start()

        def establish(delay: float) -> None:
            while True:
                time.sleep(delay)
                with lock:
                    if state["cancelled"]:
                        return
                    try:
                        # a plain read first: after an etcd restart our auth token is unknown to it, and
                        # a watch created with it is cancelled at once, silently; the read renews it
                        self._call(f"read {prefix}", lambda: self._client.get(prefix))
                        state["id"] = self.watch_changes(prefix, on_changes)
                    except (StoreError, ValueError) as e:
                        log.debug("watch on %s not established: %s", prefix, e)
                        delay = 1.0
                        continue
                # what changed while the watch was down was never delivered: say "changed" once
                # (the callers read then; without this they waited for their safety read)
                _safely(callback)
                return

        try:
            state["id"] = self.watch_changes(prefix, on_changes)
        except StoreError:
            threading.Thread(target=establish, args=(1.0,), daemon=True).start()

        def cancel() -> None:
            with lock:
                state["cancelled"] = True
                wid = state["id"]
            if wid is not None:
                try:
                    self.cancel_watch(wid)
                except Exception:  # noqa: BLE001 - a watch the stream already lost
                    pass

        return cancel

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    interval: float = 0.05,
    abort: Callable[[], bool] | None = None,
) -> bool:
    """Poll ``predicate`` until true (True) or ``timeout`` (False); store outages count as
    'not yet'. ``abort``, asked after each false round, gives up early (False): a stop
    request, a newer epoch, or a process that died makes further waiting pointless."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return True
        except StoreUnavailable:
            pass
        if abort is not None and abort():
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
