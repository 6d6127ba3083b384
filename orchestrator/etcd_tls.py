"""A throw-away PKI for the etcd a job brings along (the Slurm backend's ``hotspare etcd``).

That etcd must be reachable from every node of the allocation, so it cannot hide on
loopback; without TLS and client certificates anyone on the cluster network could read the
job's secret and spec and rewrite them (security review F1). So ``hotspare etcd --tls-dir D``
makes, in ``D`` (mode 0700, keys 0600; on the job's shared output directory, so every node and
the login node see it):

* ``ca.crt``/``ca.key`` -- a CA for this job only, valid a few days;
* ``server.crt``/``server.key`` -- etcd's certificate, for the address it advertises (and
  127.0.0.1), usable as a client too (etcd's own health check);
* ``client.crt``/``client.key`` -- what the controller, agents, workers and the CLI present
  (``$HOTSPARE_ETCD_CA``/``_CERT``/``_KEY``; etcd runs with ``--client-cert-auth``).

The ``openssl`` command line tool makes them (present on every HPC system; no Python
dependency). Generation takes ~0.1 s (``benchmarks/RESULTS.md`` has the measured set-up cost).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

DAYS = 7  # an allocation's time limit is usually shorter; a longer job gets new ones on restart
FILES = ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key")


class PkiError(RuntimeError):
    """The certificates could not be made (no openssl, a directory we cannot own)."""


def client_options(d: str | Path) -> dict[str, str]:
    """The Store options (and $HOTSPARE_ETCD_* values) a client of the job's etcd uses."""
    d = Path(d)
    return {"ca_cert": str(d / "ca.crt"), "cert": str(d / "client.crt"), "key": str(d / "client.key")}


def make(d: str | Path, host: str) -> tuple[str, str, str]:
    """Make the job's CA, etcd's server certificate for ``host`` and a client certificate in
    ``d`` (new ones every time: a restarted etcd gets a fresh CA, and old clients are out).
    Returns (ca, server cert, server key) for :class:`hotspare.orchestrator.etcd_server.EtcdServer`."""
    if shutil.which("openssl") is None:
        raise PkiError("the job's etcd serves TLS and its certificates are made with the `openssl` command, "
                       "which is not on PATH here: install it (it is in every distribution), or give the "
                       "job an external etcd (spec: etcd.endpoints)")
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for f in FILES:
        (d / f).unlink(missing_ok=True)
    old = os.umask(0o077)  # keys are born 0600
    try:
        _ca(d)
        try:
            ipaddress.ip_address(host)
            san = f"IP:{host},IP:127.0.0.1,DNS:localhost"
        except ValueError:
            san = f"DNS:{host},IP:127.0.0.1,DNS:localhost"
        _leaf(d, "server", f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
        _leaf(d, "client", "extendedKeyUsage=clientAuth\n")
    finally:
        os.umask(old)
    for f in ("ca.crt", "server.crt", "client.crt"):
        os.chmod(d / f, 0o644)
    for f in d.iterdir():
        if f.name not in FILES:
            f.unlink()  # CSRs, extension files, the serial
    return str(d / "ca.crt"), str(d / "server.crt"), str(d / "server.key")


def _openssl(d: Path, *args: str) -> None:
    r = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
    if r.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {(r.stderr or r.stdout).strip()[:300]}")


def _key_args(name: str) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key"]


def _ca(d: Path) -> None:
    _openssl(d, "req", "-x509", *_key_args("ca"), "-out", "ca.crt", "-days", str(DAYS),
             "-subj", "/CN=hotspare job etcd CA")


def _leaf(d: Path, name: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(d, "req", "-new", *_key_args(name), "-out", f"{name}.csr", "-subj", f"/CN=hotspare {name}")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", str(DAYS), "-extfile", f"{name}.ext")
