"""How hotspare connects to etcd: the endpoint, TLS and auth options (from flags, the spec
or the environment every agent and worker inherits), checked before any connection attempt,
and a failed connection explained in one line with its likely fix."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

#: How a process learns the etcd connection's TLS and auth settings: the CLI sets these from its
#: flags or the job spec, and every agent and worker it starts inherits them (never through etcd).
ENV_OPTIONS: dict[str, str] = {
    "ca_cert": "HOTSPARE_ETCD_CA",
    "cert": "HOTSPARE_ETCD_CERT",
    "key": "HOTSPARE_ETCD_KEY",
    "user": "HOTSPARE_ETCD_USER",
    "password": "HOTSPARE_ETCD_PASSWORD",
}
#: A file holding the password (first line), read when $HOTSPARE_ETCD_PASSWORD is not set.
PASSWORD_FILE_ENV = "HOTSPARE_ETCD_PASSWORD_FILE"


def parse_endpoint(url: str) -> tuple[str, int, bool]:
    """``http://host:port`` or ``host:port`` -> (host, port, tls)."""
    u = urlparse(url if "://" in url else f"http://{url}")
    if not u.hostname or not u.port:
        raise ValueError(f"etcd endpoint {url!r} must look like http://HOST:PORT")
    return u.hostname, u.port, u.scheme == "https"


def store_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """TLS and auth keyword arguments for :class:`Store` from :data:`ENV_OPTIONS` (and the
    password file)."""
    e = os.environ if env is None else env
    opts = {name: e.get(var) or None for name, var in ENV_OPTIONS.items()}
    if opts["password"] is None and e.get(PASSWORD_FILE_ENV):
        path = e[PASSWORD_FILE_ENV]
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the etcd password file {path} (${PASSWORD_FILE_ENV}): "
                             f"{exc.strerror}") from exc
        opts["password"] = lines[0] if lines and lines[0] else None
    return opts


def _check_options(endpoint: str, tls: bool, ca_cert: str | None, cert: str | None, key: str | None,
                   user: str | None, password: str | None) -> None:
    """Configuration mistakes as one clear ValueError before any connection attempt."""
    files = {"ca_cert": ca_cert, "cert": cert, "key": key}
    given = [name for name, path in files.items() if path]
    if not tls and given:
        raise ValueError(f"{endpoint} is plain http but TLS files are given ({', '.join(given)}): "
                         f"use an https:// endpoint for an etcd that serves TLS")
    if tls and not ca_cert:
        raise ValueError("https needs the CA certificate that signed etcd's (etcd.ca_cert in the "
                         f"spec, --etcd-ca or ${ENV_OPTIONS['ca_cert']})")
    if (cert is None) != (key is None):
        raise ValueError(f"{'cert' if cert else 'key'} is given without {'key' if cert else 'cert'} "
                         "(a client certificate needs both)")
    if (user is None) != (password is None):
        raise ValueError(f"etcd user {user} has no password (set ${ENV_OPTIONS['password']}, "
                         f"${PASSWORD_FILE_ENV} or --etcd-password-file)" if user else
                         "an etcd password is given but no user (etcd.user, --etcd-user)")
    for name in given:
        try:
            with open(files[name], "rb"):
                pass
        except OSError as e:
            raise ValueError(f"etcd {name} {files[name]}: {e.strerror}") from e


def connect_hint(error: BaseException, *, tls: bool, client_cert: bool) -> str:
    """The likely fix for a failed connection, read from what gRPC or etcd said ("" if none)."""
    msg = str(error)
    low = msg.lower()
    if "authentication failed" in low:
        return ("wrong etcd user or password (etcd.user in the spec or --etcd-user; the password "
                f"from etcd.password, ${ENV_OPTIONS['password']} or ${PASSWORD_FILE_ENV})")
    if "user name is empty" in low:
        return ("this etcd has authentication enabled: give a user (etcd.user or --etcd-user) and "
                f"its password (etcd.password, ${ENV_OPTIONS['password']} or ${PASSWORD_FILE_ENV})")
    if "authentication is not enabled" in low:
        return "this etcd has authentication disabled: remove the etcd user and password"
    if "permission denied" in low:
        return ("the etcd user's role lacks access to hotspare's keys: grant it readwrite on the "
                "range /hotspare to /hotspare0 (see docs/security.md)")
    if "certificate_verify_failed" in low or "certificate verify failed" in low:
        return ("the server's certificate is not signed by the CA in ca_cert (--etcd-ca, "
                f"${ENV_OPTIONS['ca_cert']}), or it does not name this host in its subjectAltName")
    if any(w in low for w in ("tsi_data_corrupted", "bad_certificate", "certificate_required",
                              "unknown_ca", "alert")):
        if not client_cert:
            return ("the server requires a client certificate: give cert and key (etcd.cert/etcd.key, "
                    "--etcd-cert/--etcd-key) signed by a CA it trusts")
        return "the server rejected the client certificate: is it signed by a CA the server trusts?"
    if "connection refused" in low:
        return "nothing listens there: is etcd running, and are the host and port right?"
    if tls and ("socket closed" in low or "wrong_version_number" in low or "handshake" in low):
        return "the server did not complete a TLS handshake: if it serves plain http, use http://"
    if not tls and ("socket closed" in low or "connection reset" in low):
        return ("the server closed the connection: if it serves TLS, use an https:// endpoint and "
                "give its CA (etcd.ca_cert, --etcd-ca)")
    if "deadline" in low or "timeout" in low:
        return "no answer in time: is the host reachable (firewall, wrong address)?"
    return ""


def connect_error(endpoint: str, error: BaseException, options: Mapping[str, str | None]) -> str:
    """One line for a user: which endpoint, what went wrong, and the likely fix. ``options``
    are the Store's TLS and auth keyword arguments."""
    hint = connect_hint(error, tls=parse_endpoint(endpoint)[2], client_cert=bool(options.get("cert")))
    return f"cannot use etcd at {endpoint}: {error}" + (f"; {hint}" if hint else "")
