"""A torchrun rendezvous backend on the etcd v3 API: ``--rdzv-backend hotspare-etcd``.

torch's own ``etcd``/``etcd-v2`` backends speak etcd's v2 API, which etcd 3.4 serves only
with ``--enable-v2`` and 3.6 removed. This backend keeps torch's dynamic rendezvous (the
same join / last-call / keep-alive / re-rendezvous logic as ``c10d``) and stores its state
in etcd through hotspare's own client, so an etcd that already runs a hotspare cluster
(or any etcd 3.4+) can also rendezvous plain torchrun jobs::

    pip install hotspare          # registers the backend (entry point torchrun.handlers)
    torchrun --rdzv-backend hotspare-etcd --rdzv-endpoint etcd1:2379 --rdzv-id JOB \\
             --nnodes 2 --nproc-per-node 8 train.py

``--rdzv-endpoint``: ``HOST[:PORT]`` or ``http(s)://HOST[:PORT]`` (port 2379 by default),
or a comma-separated list; the first one that answers at start-up is used for the whole
run (no fail-over later: hotspare's ``Store`` holds one connection).

``--rdzv-conf`` keys (seconds may be fractional):

* ``key_prefix`` (``/hotspare-torchrun``): keys live under ``<key_prefix>/<rdzv-id>/``;
  ``state`` is the rendezvous state, ``store/…`` the agents' c10d store. Never under
  ``/hotspare/``, which belongs to hotspare jobs.
* ``join_timeout`` (torchrun's ``timeout`` / ``--rdzv-timeout``, itself 900 by default),
  ``last_call_timeout`` (30), ``close_timeout`` (30), ``heartbeat_timeout`` (5),
  ``keep_alive_interval`` (5), ``keep_alive_max_attempt`` (3): torch's dynamic rendezvous.
* ``read_timeout`` (60): how long a blocking read of the c10d store waits for its key.
* ``cacert``, ``cert``, ``key``: TLS, as etcdctl names them. ``cacert`` alone gives a TLS
  channel; a client certificate needs all three. An ``https://`` endpoint needs ``cacert``.

An etcd with authentication: ``$HOTSPARE_ETCD_USER`` and ``$HOTSPARE_ETCD_PASSWORD_FILE`` (or
``$HOTSPARE_ETCD_PASSWORD``), as for hotspare's own processes. The embedded etcd (``hotspare
up``) needs nothing: its password file is found through the state dir.

State is compared-and-set on the key's ``mod_revision``; keys are not deleted when the
run ends (torch's ``c10d`` store keeps them too): reuse of an ``--rdzv-id`` finds the old,
closed rendezvous, so give each run a fresh id or ``etcdctl del --prefix`` its keys.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

log = logging.getLogger(__name__)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's creator for ``--rdzv-backend hotspare-etcd``."""
    cfg = parse_config(params)
    keys = RdzvKeys.of(cfg.key_prefix, params.run_id)
    store = connect(cfg)
    # torch 2.13 keeps the rank-0 agent's "shared" TCPStore across rounds, and restarted
    # workers read the dead workers' gloo addresses from it (pytorch#135712, #167288).
    # Its documented opt-out makes worker rank 0 host a fresh store per round, its address
    # published through our (etcd, per-round) store. An explicit user setting wins.
    os.environ.setdefault(_NO_SHARED_STORE, "1")
    log.info("%s: rendezvous %s under %s", BACKEND_NAME, params.run_id, keys.base)
    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        EtcdC10dStore(store, keys.store, timeout=cfg.read_timeout),
        EtcdV3RendezvousBackend(store, keys.state),
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        cfg.timeout,
        keep_alive_interval=cfg.keep_alive_interval.total_seconds(),  # type: ignore[arg-type]
        keep_alive_max_attempt=cfg.keep_alive_max_attempt,
    )


def handler_entry() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point ``torchrun.handlers: hotspare-etcd``: torch calls this with no
    arguments and registers what it returns as the backend's creator."""
    return create_handler


# Importing torch's rendezvous package registers every ``torchrun.handlers`` entry point,
# this module's included: when this module is imported first, ``handler_entry`` must
# already exist at that moment, so the torch imports come after it.
from torch.distributed.elastic.rendezvous import RendezvousConnectionError  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)

from .store.c10d import EtcdC10dStore  # noqa: E402
from .store.client import ROOT, Compare, Store, parse_endpoint, store_options_from_env  # noqa: E402
from .store.errors import StoreError  # noqa: E402

BACKEND_NAME = "hotspare-etcd"
DEFAULT_KEY_PREFIX = "/hotspare-torchrun"
DEFAULT_PORT = 2379
#: deadline of one etcd request (the rendezvous's own timeouts are --rdzv-conf keys)
REQUEST_TIMEOUT_S = 5.0
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

_SECONDS = {
    "join_timeout": None,  # default: torchrun's ``timeout``
    "last_call_timeout": 30.0,
    "close_timeout": 30.0,
    "heartbeat_timeout": 5.0,
    "keep_alive_interval": 5.0,
    "read_timeout": 60.0,
}
_KNOWN = {*_SECONDS, "timeout", "keep_alive_max_attempt", "key_prefix", "cacert", "cert", "key"}


@dataclass(frozen=True)
class RdzvConfig:
    """Everything ``--rdzv-endpoint`` and ``--rdzv-conf`` say, validated."""

    endpoints: tuple[str, ...]  # normalised ``scheme://host:port``
    key_prefix: str
    timeout: RendezvousTimeout
    keep_alive_interval: timedelta
    keep_alive_max_attempt: int
    read_timeout: timedelta
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class RdzvKeys:
    """Where one run's rendezvous lives in etcd."""

    base: str  # ``<key_prefix>/<run_id>/``

    @classmethod
    def of(cls, key_prefix: str, run_id: str) -> RdzvKeys:
        if not run_id or "/" in run_id:
            raise ValueError(f"--rdzv-id {run_id!r}: must be non-empty and contain no '/'")
        return cls(f"{key_prefix}/{run_id}/")

    @property
    def state(self) -> str:
        return self.base + "state"

    @property
    def store(self) -> str:
        return self.base + "store/"


# -- parsing --------------------------------------------------------------------------
def parse_endpoints(value: str | None, tls: bool = False) -> tuple[str, ...]:
    """``--rdzv-endpoint`` -> ``("http://host:port", ...)``; ``tls`` makes https the default."""
    if not value or not value.strip():
        raise ValueError(
            f"{BACKEND_NAME} needs --rdzv-endpoint HOST:PORT (an etcd client URL); none given"
        )
    items = [item.strip() for item in value.split(",")]
    if "" in items:
        raise ValueError(f"--rdzv-endpoint {value!r}: empty entry in the comma-separated list")
    return tuple(_parse_endpoint(item, tls) for item in items)


def _parse_endpoint(item: str, tls: bool) -> str:
    bad = f"etcd endpoint {item!r}"
    if "://" not in item:
        item_url = f"{'https' if tls else 'http'}://{item}"
    else:
        item_url = item
    u = urlsplit(item_url)
    scheme = u.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"{bad}: scheme {u.scheme!r} is not http or https")
    if u.path not in ("", "/") or u.query or u.fragment or u.username:
        raise ValueError(f"{bad}: expected HOST:PORT or http(s)://HOST:PORT, nothing more")
    if not u.hostname:
        raise ValueError(f"{bad}: no host")
    if ":" in u.hostname:
        raise ValueError(f"{bad}: IPv6 literals are not supported, use a host name")
    try:
        port = u.port
    except ValueError:
        port = -1
    if port is None:
        port = DEFAULT_PORT
    if not 0 < port < 65536:
        raise ValueError(f"{bad}: port must be an integer in 1-65535")
    return f"{scheme}://{u.hostname}:{port}"


def _seconds(params: RendezvousParameters, key: str, default: float | None) -> float | None:
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"--rdzv-conf {key}={raw!r}: expected a positive number of seconds")
    return value


def _key_prefix(raw: str | None) -> str:
    if raw is None:
        return DEFAULT_KEY_PREFIX
    prefix = str(raw).rstrip("/")
    if not prefix.startswith("/") or any(c.isspace() for c in prefix):
        raise ValueError(
            f"--rdzv-conf key_prefix={raw!r}: must start with '/', not be '/', and contain no spaces"
        )
    if prefix + "/" == ROOT or prefix.startswith(ROOT):
        raise ValueError(
            f"--rdzv-conf key_prefix={raw!r}: {ROOT} belongs to hotspare jobs; "
            f"use another prefix (default {DEFAULT_KEY_PREFIX})"
        )
    return prefix


def _tls_files(params: RendezvousParameters) -> tuple[str | None, str | None, str | None]:
    files = {name: params.get(name) for name in ("cacert", "cert", "key")}
    for name, path in files.items():
        if path is not None and not os.path.isfile(str(path)):
            raise ValueError(f"--rdzv-conf {name}={path!r}: no such file")
    cacert, cert, key = (None if v is None else str(v) for v in files.values())
    if (cert is None) != (key is None):
        raise ValueError("--rdzv-conf: a client certificate needs both cert=... and key=...")
    if cert is not None and cacert is None:
        raise ValueError("--rdzv-conf cert=/key= need cacert=... too (TLS to etcd)")
    return cacert, cert, key


def parse_config(params: RendezvousParameters) -> RdzvConfig:
    """Validate torchrun's rendezvous parameters; every error names the bad value."""
    unknown = sorted(set(params.config) - _KNOWN)
    if unknown:
        raise ValueError(
            f"--rdzv-conf: unknown key(s) {', '.join(unknown)} for {BACKEND_NAME} "
            f"(known: {', '.join(sorted(_KNOWN))})"
        )
    cacert, cert, key = _tls_files(params)
    endpoints = parse_endpoints(params.endpoint, tls=cacert is not None)
    for ep in endpoints:
        if ep.startswith("https://") and cacert is None:
            raise ValueError(f"etcd endpoint {ep!r} is https: give --rdzv-conf cacert=CA.pem")
        if ep.startswith("http://") and cacert is not None:
            raise ValueError(f"etcd endpoint {ep!r} is http:// but cacert= asks for TLS")
    s = {k: _seconds(params, k, d) for k, d in _SECONDS.items()}
    join = s["join_timeout"] or _seconds(params, "timeout", None)
    max_attempt = params.get("keep_alive_max_attempt", 3)
    if not str(max_attempt).isdigit() or int(max_attempt) < 1:
        raise ValueError(
            f"--rdzv-conf keep_alive_max_attempt={max_attempt!r}: expected a positive integer"
        )
    td = {k: None if v is None else timedelta(seconds=v) for k, v in s.items()}
    return RdzvConfig(
        endpoints=endpoints,
        key_prefix=_key_prefix(params.get("key_prefix")),
        timeout=RendezvousTimeout(
            join=None if join is None else timedelta(seconds=join),
            last_call=td["last_call_timeout"],
            close=td["close_timeout"],
            heartbeat=td["heartbeat_timeout"],
        ),
        keep_alive_interval=td["keep_alive_interval"],
        keep_alive_max_attempt=int(max_attempt),
        read_timeout=td["read_timeout"],
        cacert=cacert,
        cert=cert,
        key=key,
    )


# -- the backend ----------------------------------------------------------------------
class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key; the fencing token is the key's ``mod_revision``."""

    def __init__(self, store: Store, key: str) -> None:
        self._store = store
        self._key = key

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self._store.get(self._key)
        except StoreError as e:
            raise RendezvousConnectionError(f"etcd read of {self._key} failed: {e}") from e
        return None if kv is None else (kv.value, kv.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is None:
            guard = Compare(self._key, "create", "==", 0)
        elif isinstance(token, int) and not isinstance(token, bool):
            guard = Compare(self._key, "mod", "==", token)
        else:  # not one of ours: it cannot match
            current = self.get_state()
            return None if current is None else (*current, False)
        try:
            written = self._store.txn([guard], puts={self._key: state})
            # read back for the new mod_revision; if someone wrote after us, theirs is the
            # newer state (built on ours, since their txn was fenced on our revision)
            kv = self._store.get(self._key)
        except StoreError as e:
            raise RendezvousConnectionError(f"etcd write of {self._key} failed: {e}") from e
        return None if kv is None else (kv.value, kv.mod_revision, written)


def credentials(endpoint: str) -> dict[str, str | None]:
    """The etcd user and password for ``endpoint``: ``$HOTSPARE_ETCD_USER`` with
    ``$HOTSPARE_ETCD_PASSWORD(_FILE)``, as for every hotspare process; without a user, the
    embedded etcd's own when ``endpoint`` is the one ``hotspare up`` recorded in
    ``$HOTSPARE_STATE_DIR`` (``~/.hotspare``). ValueError: a password file cannot be read."""
    opts = store_options_from_env()
    if not opts["user"]:
        from . import embedded

        c = embedded.load(embedded.default_state_dir())
        if c is None or parse_endpoint(c.endpoint) != parse_endpoint(endpoint):
            return {}
        opts = c.store_options()
    return {"user": opts.get("user"), "password": opts.get("password")}


def connect(cfg: RdzvConfig) -> Store:
    """A Store on the first endpoint that answers."""
    failures = []
    for ep in cfg.endpoints:
        store = None
        try:
            store = Store(
                [ep], timeout=REQUEST_TIMEOUT_S, ca_cert=cfg.cacert, cert=cfg.cert, key=cfg.key,
                **credentials(ep),
            )
            store.ping()
            return store
        except StoreError as e:
            failures.append(f"{ep}: {e}")
            if store is not None:
                store.close()
    raise RendezvousConnectionError(f"no etcd endpoint answered ({'; '.join(failures)})")
