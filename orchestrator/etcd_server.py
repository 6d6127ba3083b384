"""Start and stop a private etcd on loopback: the embedded default and the tests' server.

Fast raft timings (heartbeat 50 ms, election 500 ms) make etcd ready in ~0.1 s and let it
honour 1-second leases (see shared notes); a single member on loopback never elects.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .util import pid_alive

log = logging.getLogger("hotspare.etcd")

#: A one-member etcd's raft heartbeat costs it CPU on every tick, with or without clients:
#: idle, 0.013 cores at 50 ms, 0.010 at 100, 0.0053 at 500 (2-vCPU sandbox, 15 s windows);
#: but it elects itself only after its election timeout, so the first request waits 0.1 s at
#: 50 ms and 2.5 s at 500. Throwaway etcds (tests, benchmarks) start QUICK; one that lives as
#: long as the cluster (`hotspare up`) is LONG_LIVED.
QUICK_HEARTBEAT_MS = 50
LONG_LIVED_HEARTBEAT_MS = 500
#: overrides both (the test suite sets it to QUICK: it starts dozens of embedded clusters)
HEARTBEAT_ENV = "HOTSPARE_ETCD_HEARTBEAT_MS"


class EtcdNotFound(RuntimeError):
    pass


def find_etcd() -> str:
    for cand in (os.environ.get("HOTSPARE_ETCD_BIN"), shutil.which("etcd"), "/usr/bin/etcd"):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise EtcdNotFound(
        "no 'etcd' binary found: install it (apt-get install -y etcd-server, or run "
        "`make setup`), put it on PATH, or set HOTSPARE_ETCD_BIN"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EtcdServer:
    """A running etcd process we started."""

    data_dir: Path
    client_port: int
    peer_port: int
    proc: subprocess.Popen | None = None
    pid: int = 0
    scheme: str = "http"
    #: Address clients use. Loopback (the default) listens on loopback only; any other address
    #: (a node's IP, for etcd inside a Slurm allocation) listens on every interface.
    host: str = "127.0.0.1"
    #: Serve https: (CA that client certificates must be signed by, server certificate, its
    #: key). Clients must present a certificate (--client-cert-auth); the health check presents
    #: the server's own, so it needs extendedKeyUsage clientAuth too.
    tls: tuple[str, str, str] | None = None
    log_path: Path | None = None  # where its output goes (set by start)

    def __post_init__(self) -> None:
        if self.tls:
            self.scheme = "https"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    def _listen(self, port: int, scheme: str) -> str:
        return f"{scheme}://{'127.0.0.1' if self.host == '127.0.0.1' else '0.0.0.0'}:{port}"

    def start(
        self, log_path: Path | None = None, extra_args: list[str] | None = None, detach: bool = False,
        heartbeat_ms: int = QUICK_HEARTBEAT_MS,
    ) -> EtcdServer:
        binary = find_etcd()
        self.log_path = log_path
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # one member: its peer port never needs to be reachable from another host
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            binary,
            "--name", "hotspare",
            "--logger", "zap",
            "--log-level", "warn",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self._listen(self.client_port, self.scheme),
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"hotspare={peer}",
            *tick_args(heartbeat_ms),
            "--quota-backend-bytes", str(2 * 1024**3),
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", "10000",
        ]
        if self.tls:
            ca, cert, key = self.tls
            args += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth"]
        args += extra_args or []
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        env = dict(os.environ)
        env.setdefault("ETCD_UNSUPPORTED_ARCH", os.uname().machine if os.uname().machine != "x86_64" else "")
        if not env["ETCD_UNSUPPORTED_ARCH"]:
            env.pop("ETCD_UNSUPPORTED_ARCH")
        self.proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=detach
        )
        self.pid = self.proc.pid
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls[0])
            ctx.load_cert_chain(self.tls[1], self.tls[2])
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode} while starting"
                                   + (f" (its log: {self.log_path})" if self.log_path else ""))
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1, context=ctx) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError as e:
                last = str(e)
            time.sleep(0.05)
        raise TimeoutError(f"etcd at {self.endpoint} not healthy after {timeout:.0f}s ({last})")

    def stop(self, timeout: float = 10.0) -> None:
        stop_pid(self.pid, timeout)

    def suspend(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL. Quiet if the process is already gone."""
    if pid <= 0:
        return
    try:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tick_args(heartbeat_ms: int) -> list[str]:
    """etcd's raft timing flags for a one-member cluster: ``heartbeat_ms`` unless
    ``$HOTSPARE_ETCD_HEARTBEAT_MS`` says otherwise, and an election timeout 5-10 x that."""
    ms = int(os.environ.get(HEARTBEAT_ENV) or heartbeat_ms)
    return ["--heartbeat-interval", str(ms), "--election-timeout", str(max(500, 5 * ms))]


def start_etcd(data_dir: Path, log_path: Path | None = None, detach: bool = False, attempts: int = 3, *,
               ports: tuple[int, int] | None = None, extra_args: list[str] | None = None,
               say: Callable[[str], object] = log.warning, heartbeat_ms: int = QUICK_HEARTBEAT_MS) -> EtcdServer:
    """Start an etcd on two loopback ports (``ports`` first, if given, else free ones) and
    wait until it is healthy.

    A port found free can be taken by another process before etcd binds it (two etcds
    started at once, an outgoing connection's ephemeral port): etcd then exits at once with
    "address already in use" in its log, and it is started again on fresh ports, up to
    ``attempts`` times, each retry said in one line (``say``). Its data is kept: etcd exits
    before it writes any, and a single member restarts on other ports with its old data (a
    data directory that was new is removed, as it was before the first try)."""
    new = not data_dir.exists()
    for attempt in range(1, attempts + 1):
        client, peer = ports if ports and attempt == 1 else (free_port(), free_port())
        srv = EtcdServer(data_dir=data_dir, client_port=client, peer_port=peer)
        offset = _log_size(log_path)
        srv.start(log_path=log_path, detach=detach, extra_args=extra_args, heartbeat_ms=heartbeat_ms)
        try:
            srv.wait_ready()
            return srv
        except RuntimeError:  # exited while starting
            if attempt == attempts or not bind_failed(log_path, offset):
                raise
            if new:
                shutil.rmtree(data_dir, ignore_errors=True)
            say(f"etcd could not listen on port {client} or {peer}: address already in use (another process "
                f"took it); starting it on fresh ports (try {attempt + 1} of {attempts})")
    raise AssertionError("unreachable")


def _log_size(log_path: Path | None) -> int:
    try:
        return Path(log_path).stat().st_size if log_path else 0
    except OSError:
        return 0


def bind_failed(log_path: Path | None, offset: int = 0) -> bool:
    """Whether what etcd wrote to its log after ``offset`` says it could not listen (its port
    was taken); with no log, assume so."""
    if log_path is None:
        return True
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return b"address already in use" in f.read()
    except OSError:
        return True
