"""The embedded etcd's credentials: ``hotspare up`` starts etcd with authentication enabled.

One etcd user, ``root``, whose password is generated at the first ``up``
(``secrets.token_urlsafe(32)``) and kept in ``<state-dir>/etcd-password`` (0600; the state dir
is 0700). It is never in an argv, in a key of etcd, in a log or in the cluster record (which
names the file); etcd 3.4 itself writes it into its write-ahead log when the user is added, in
its own 0700 data directory. Every process that talks to the embedded etcd gets
``$HOTSPARE_ETCD_USER=root`` and ``$HOTSPARE_ETCD_PASSWORD_FILE`` (the file's path, not the
password): the CLI, the embedded controller, the agents and their workers. Without the
file's content, etcd refuses every read and write.

Why root, not a user whose role covers only ``/hotspare``: whoever can read the file is the
Unix user who owns etcd's data directory anyway, so a narrower role would protect nothing
from them; and the repairs hotspare's own errors ask for (``etcdctl defrag``, ``etcdctl alarm
disarm``) need root.

The password is 256 random bits: bcrypt's stretching adds nothing to it, so etcd hashes it
at the lowest cost (``--bcrypt-cost 4``), which makes each process's login ~5 ms instead of
~70 ms (``benchmarks/etcd_auth.py``; docs/security.md).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from .store import (
    ENV_OPTIONS,
    PASSWORD_FILE_ENV,
    Store,
    StoreError,
    StoreUnavailable,
    connect_error,
    store_options_from_env,
)
from .util import atomic_write

USER = "root"
PASSWORD_FILE = "etcd-password"
#: etcd flags of the embedded etcd that concern its authentication
ETCD_ARGS = ["--bcrypt-cost", "4"]
_TIMEOUT = 10.0


class EmbeddedAuthError(RuntimeError):
    """The embedded etcd's credentials cannot be set up or do not open it (one sentence + fix)."""


def private_dir(state_dir: Path) -> None:
    """Create ``state_dir`` if needed and make it 0700: it holds the password file, the job
    records and (by default) the jobs' outputs."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = state_dir.stat()
    if st.st_uid != os.getuid():
        raise EmbeddedAuthError(f"the state dir {state_dir} belongs to uid {st.st_uid}, not to you (uid "
                                f"{os.getuid()}): the embedded etcd's password must live in a directory only you "
                                "can read; pick one with --state-dir or $HOTSPARE_STATE_DIR")
    if st.st_mode & 0o077:
        os.chmod(state_dir, 0o700)


def child_env(password_file: str | Path) -> dict[str, str]:
    """The environment variables that give a process the embedded etcd's credentials."""
    return {ENV_OPTIONS["user"]: USER, PASSWORD_FILE_ENV: str(password_file)}


def store_options(password_file: str | Path) -> dict[str, str | None]:
    """:class:`Store` keyword arguments for the embedded etcd; ValueError (the client's own
    sentence) when the file cannot be read."""
    return store_options_from_env(child_env(password_file))


def secure(endpoint: str, state_dir: Path) -> Path:
    """Make the etcd at ``endpoint`` (just started on ``state_dir``'s data) require the
    password, creating it if needed; returns the password file. Its data may already have
    authentication enabled (an earlier ``up``): then the file must open it."""
    f = state_dir / PASSWORD_FILE
    if _auth_enabled(endpoint):
        _check_login(endpoint, f, state_dir)
    else:
        _enable(endpoint, _password(f))
    return f


def _auth_enabled(endpoint: str, patience: float = 30.0) -> bool:
    """Whether etcd refuses a request without a user. Asked again while it does not answer
    (just healthy, on a machine too busy to answer in time), for up to ``patience`` seconds."""
    deadline = time.monotonic() + patience
    st = Store([endpoint], timeout=_TIMEOUT)
    try:
        while True:
            try:
                st.ping()
                return False
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # start-up only: gRPC's own reconnect back-off is 0.2-1 s
            except StoreError as e:
                if "user name is empty" in str(e):
                    return True
                raise
    finally:
        st.close()


def _check_login(endpoint: str, f: Path, state_dir: Path) -> None:
    fix = (f"the embedded etcd's data ({state_dir / 'etcd'}) has authentication enabled and only its "
           f"password file opens it: restore {f}, or run `hotspare down` and remove {state_dir / 'etcd'} "
           "to start afresh (the jobs' records in it are lost)")
    try:
        opts = store_options(f)
        os.chmod(f, 0o600)
        Store([endpoint], timeout=_TIMEOUT, **opts).close()
    except ValueError as e:
        raise EmbeddedAuthError(f"{e}; {fix}") from e
    except StoreError as e:
        raise EmbeddedAuthError(f"{connect_error(endpoint, e, opts)}; {fix}") from e


def _password(f: Path) -> str:
    """The password in ``f`` (kept 0600), or a new one written there first: the file exists
    before etcd knows the password, so a crash in between loses nothing."""
    try:
        pw = f.read_text().split("\n", 1)[0]
    except FileNotFoundError:
        pw = ""
    if pw:
        os.chmod(f, 0o600)
        return pw
    pw = secrets.token_urlsafe(32)
    atomic_write(f, pw + "\n", mode=0o600)
    return pw


def _enable(endpoint: str, password: str) -> None:
    """Add root with ``password`` (or set it, if an interrupted ``up`` added root already),
    give it the root role and enable authentication."""
    from etcd3 import etcdrpc

    st = Store([endpoint], timeout=_TIMEOUT)
    a = st._client.authstub  # python3-etcd3 has no auth admin API; its gRPC stubs do
    try:
        try:
            st._call("add etcd user root", lambda: a.UserAdd(
                etcdrpc.AuthUserAddRequest(name=USER, password=password), _TIMEOUT))
        except StoreError as e:
            if "already exists" not in str(e):
                raise
            st._call("set etcd user root's password", lambda: a.UserChangePassword(
                etcdrpc.AuthUserChangePasswordRequest(name=USER, password=password), _TIMEOUT))
        st._call("grant etcd user root the root role", lambda: a.UserGrantRole(
            etcdrpc.AuthUserGrantRoleRequest(user=USER, role="root"), _TIMEOUT))
        st._call("enable etcd authentication", lambda: a.AuthEnable(etcdrpc.AuthEnableRequest(), _TIMEOUT))
    finally:
        st.close()
