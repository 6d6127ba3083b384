"""Start and stop a private etcd on loopback: the embedded default and the tests' server.

Fast raft timings (heartbeat 50 ms, election 500 ms) make etcd ready in ~0.1 s and let it
honour 1-second leases (see shared notes); a single member on loopback never elects.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .util import pid_alive


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

    def __post_init__(self) -> None:
        if self.tls:
            self.scheme = "https"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    def _listen(self, port: int, scheme: str) -> str:
        return f"{scheme}://{'127.0.0.1' if self.host == '127.0.0.1' else '0.0.0.0'}:{port}"

    def start(
        self, log_path: Path | None = None, extra_args: list[str] | None = None, detach: bool = False
    ) -> EtcdServer:
        binary = find_etcd()
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
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
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
                raise RuntimeError(f"etcd exited with code {self.proc.returncode} while starting")
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


def start_etcd(data_dir: Path, log_path: Path | None = None, detach: bool = False,
               attempts: int = 3) -> EtcdServer:
    """Start an etcd on two free loopback ports and wait until it is healthy.

    A port found free can be taken by another process before etcd binds it (two etcds
    started at once, an outgoing connection's ephemeral port): etcd then exits at once, and
    it is started again on other ports, up to ``attempts`` times -- only when ``data_dir`` is
    new: an existing member's data (its stored peer address) is never removed."""
    if data_dir.exists():
        attempts = 1
    for attempt in range(attempts):
        srv = EtcdServer(data_dir=data_dir, client_port=free_port(), peer_port=free_port())
        srv.start(log_path=log_path, detach=detach)
        try:
            srv.wait_ready()
            return srv
        except RuntimeError:  # exited while starting
            if attempt == attempts - 1 or not _bind_failed(log_path):
                raise
            shutil.rmtree(data_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def _bind_failed(log_path: Path | None) -> bool:
    """Whether etcd's log says it could not listen (its port was taken); with no log, assume so."""
    if log_path is None:
        return True
    try:
        return "address already in use" in Path(log_path).read_text(errors="replace")[-4000:]
    except OSError:
        return True
