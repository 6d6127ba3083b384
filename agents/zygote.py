"""Warm workers forked from a zygote: torch is imported once, not once per worker.

A warm worker spends ~4.5 s of CPU importing torch (and ``torch._dynamo``, which the first
optimizer step pulls in) before it can take a seat. An agent that respawns a worker after a
swap pays that on the node's CPUs while its other ranks train, and a machine that hosts many
agents (the local backend, a test) pays it once per worker. The zygote is a small fork
server (the pattern of Android's zygote and multiprocessing's ``forkserver``): it imports
what every worker needs (:data:`PRELOAD`) and then forks a worker per request, in ~20 ms.

Ownership and trust
  * Each agent starts its own zygote as its child, in its own process group
    (:meth:`Zygote.start`), with the environment its workers get. The local launcher (and the
    test suite) may instead share one zygote between the agents of one machine
    (``hotspare agent --zygote PATH``, or ``$HOTSPARE_ZYGOTE``).
  * The socket is a ``SOCK_SEQPACKET`` Unix socket in a fresh 0700 directory; the server
    serves only peers of its own uid and the client talks only to a server of its own uid
    (``SO_PEERCRED`` on both sides).

What a forked worker gets that a started one had
  * stdin (the assignment pipe) and stdout/stderr (its slot log) are the agent's own file
    descriptors, passed with the request (``SCM_RIGHTS``); its environment and working
    directory are the request's. The zygote refuses (and the agent starts a worker the plain
    way) when the request's environment differs from its own in a variable that is read
    while importing (:func:`env_mismatch`: ``PYTHON*``, ``LD_*``, ``TORCH*``, ``OMP_*``, ...).
    CUDA is never initialised in the zygote, so ``CUDA_VISIBLE_DEVICES`` may differ.
  * Python's ``random`` reseeds itself after a fork; numpy's global generator is reseeded
    from the OS here, as a fresh process would seed it.
  * It dies with its agent: a worker whose parent is not its agent watches the agent's
    pidfd (:func:`die_with_agent`) and kills itself when the agent is gone, as PDEATHSIG does
    for a child.

Exit statuses
  The zygote is the worker's parent: it learns each exit from the worker's pidfd (no
  polling) and sends ``{"exit": pid, "code": c}`` to the agent that asked for it; the
  agent's :class:`ForkedProc` reads like a :class:`subprocess.Popen` (``returncode``
  negative for a signal). Signals go through a pidfd, never a bare pid that may have been
  reused. A zygote that dies takes no worker with it: they train on, and the agent watches
  their pidfds itself (an exit then reads as :data:`EXIT_STATUS_UNKNOWN`).
"""

from __future__ import annotations

import array
import io
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from .worker_link import worker_command

log = logging.getLogger("hotspare.zygote")

#: What every worker imports before it can take a seat (what ``prewarm_torch`` would pay).
PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "hotspare.recovery.session",
           "hotspare.agents.worker")

#: Environment variables read while Python, torch or its math libraries load: a worker
#: forked from a zygote that loaded with other values would not be the worker asked for.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_",
                        "NUMPY", "MALLOC_")
IMPORT_TIME_EXEMPT = frozenset({"PYTHONUNBUFFERED"})  # a forked worker's stdio is unbuffered anyway

_MAX_MESSAGE = 1 << 20  # bytes of one request (its environment, mostly)
#: A worker forked from a zygote whose set-up after the fork failed (never the job's code).
EXIT_FORK_SETUP = 7
#: The exit code an agent reads for a forked worker that ended after its zygote was gone:
#: nobody is left to tell its real status.
EXIT_STATUS_UNKNOWN = 255


def env_mismatch(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The import-time variables (:data:`IMPORT_TIME_PREFIXES`) that differ between two
    environments, sorted; empty when a worker for ``theirs`` may be forked from ``mine``."""
    names = {k for k in (*mine, *theirs) if k.startswith(IMPORT_TIME_PREFIXES) and k not in IMPORT_TIME_EXEMPT}
    return sorted(k for k in names if mine.get(k) != theirs.get(k))


def pidfd_supported() -> bool:
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    os.close(fd)
    return True


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the file descriptors that came with it; (None, []) at EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, maxfds) if maxfds else \
        (sock.recv(_MAX_MESSAGE), [], 0, None)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def zygote_for_agent(at: str | None, env: Mapping[str, str], log_path: Path) -> Zygote | None:
    """The zygote an agent's workers are forked from: the shared one at ``at`` if it can fork
    into the agent's process group with the workers' environment ``env``, else one of the
    agent's own (``at`` None, or not usable); None -- each worker starts as its own process --
    with ``at == "off"``, without pidfd support, or when no zygote can be had."""
    if at == "off" or not pidfd_supported():
        return None
    try:
        if at:
            z = Zygote.connect(at)
            why = z.usable(env)
            if not why:
                return z
            z.close()
            log.info("not using the zygote at %s: %s; starting one of our own", at, why)
        return Zygote.start(env, log_path, owner=os.getpid())
    except OSError as e:
        log.warning("no zygote (%s): every worker starts as its own process", e)
        return None


def die_with_agent(agent_pid: int) -> None:
    """In a worker: SIGKILL ourselves when our agent is gone (a lost node loses its
    workers). A child of the agent asks the kernel (PR_SET_PDEATHSIG); a worker forked by a
    zygote watches the agent's pidfd from a daemon thread."""
    if not agent_pid or os.getppid() == agent_pid:
        _pdeathsig()
        return
    try:
        fd = os.pidfd_open(agent_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (AttributeError, OSError):
        return

    def wait() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="agent-watch", daemon=True).start()


def _pdeathsig() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# -- the agent's side -----------------------------------------------------------------------
class ForkedProc:
    """A worker forked by a zygote, read like a :class:`subprocess.Popen`."""

    def __init__(self, pid: int, stdin: io.BufferedWriter | None, owner: Zygote) -> None:
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None
        self.args = ["<forked by zygote>"]
        self._owner = owner
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None  # already gone and reaped: its exit message is on its way

    def poll(self) -> int | None:
        if self.returncode is None and self._owner.lost and self._gone(0):
            self._exited(EXIT_STATUS_UNKNOWN)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._owner._cond:
            if not self._owner._cond.wait_for(lambda: self.returncode is not None or self._owner.lost, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        if self.returncode is None:  # the zygote is gone: no exit message will come, watch it ourselves
            if not self._gone(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._exited(EXIT_STATUS_UNKNOWN)
        return self.returncode

    def _gone(self, timeout: float | None) -> bool:
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], timeout)[0])

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None or self._pidfd is None:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _exited(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Zygote:
    """A connection to a zygote: :meth:`spawn` forks a worker, :meth:`run` starts an agent;
    exits arrive on a reader thread, which calls ``on_exit`` (the agent's wake-up) after each."""

    def __init__(self, sock: socket.socket, path: str, proc: subprocess.Popen | None = None) -> None:
        self.sock = sock
        self.path = path
        self.proc = proc  # our own zygote (None: a shared one)
        self._cond = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._procs: dict[int, ForkedProc] = {}
        self._early: dict[int, int] = {}  # exits that arrived before their spawn reply was handled
        self._next = 0
        self.lost: str | None = None  # why the connection ended
        self.on_exit: Callable[[], None] = lambda: None
        self.env: dict[str, str] | None = None  # the environment our own zygote was started with
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    # -- getting one
    @classmethod
    def connect(cls, path: str, timeout: float = 10.0, starting: subprocess.Popen | None = None) -> Zygote:
        """Connect to the zygote listening on ``path``, waiting up to ``timeout`` for one we
        have just started (``starting``, unless it exits first) to bind it."""
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline or (starting is not None and starting.poll() is not None):
                    raise
                time.sleep(0.05)  # start-up only: the zygote binds within a fraction of a second
        if _peer(sock)[1] != os.getuid():
            sock.close()
            raise PermissionError(f"zygote socket {path} is served by another user")
        return cls(sock, path)

    @classmethod
    def start(cls, env: Mapping[str, str], log_path: Path, *, owner: int | None = None) -> Zygote:
        """Start our own zygote with ``env`` (its workers' environment, less their own
        variables) in our process group, and connect to it. It leaves with ``owner``."""
        proc, path = spawn_server(env, log_path, owner=owner)
        try:
            z = cls.connect(path, timeout=60.0, starting=proc)
            z.proc = proc
        except OSError:
            proc.kill()
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            raise
        z.env = dict(env)
        return z

    # -- using it
    def _ask(self, msg: dict, fds: list[int], timeout: float) -> dict:
        """Send one request and wait for its reply (the caller holds ``_cond``)."""
        if self.lost:
            raise ConnectionError(f"zygote {self.path}: {self.lost}")
        self._next += 1
        rid = msg["id"] = self._next
        _send(self.sock, msg, fds)
        if not self._cond.wait_for(lambda: rid in self._replies or self.lost is not None, timeout):
            self.lost = f"no answer within {timeout:.0f}s"
            raise TimeoutError(f"zygote {self.path}: {self.lost}")
        reply = self._replies.pop(rid, None)
        if reply is None:
            raise ConnectionError(f"zygote {self.path}: {self.lost}")
        if reply.get("refused"):
            raise ZygoteRefused(reply["error"])
        if "error" in reply:
            self.lost = reply["error"]
            raise ConnectionError(f"zygote {self.path}: {reply['error']}")
        return reply

    def usable(self, env: Mapping[str, str], timeout: float = 10.0) -> str:
        """Why this zygote cannot fork our workers with ``env`` ("" if it can): another
        session than ours (a shared zygote we were not started by) or an environment that
        differs where it matters."""
        with self._cond:
            return self._ask({"op": "hello", "env": dict(env)}, [], timeout)["why"]

    def run(self, argv: list[str], env: Mapping[str, str], cwd: str, log_fd: int,
            timeout: float = 30.0) -> ForkedProc:
        """Start the program ``argv`` (an agent) in a process group of its own in the zygote's
        session, output to ``log_fd``, stdin from /dev/null."""
        with self._cond:
            reply = self._ask({"op": "exec", "argv": list(argv), "env": dict(env), "cwd": cwd}, [log_fd], timeout)
            return self._adopt(ForkedProc(reply["pid"], None, self))

    def spawn(self, target: str, env: Mapping[str, str], cwd: str, log_fd: int,
              timeout: float = 120.0) -> ForkedProc:
        """Fork a process that runs ``target`` (``module:function``) with ``env`` in ``cwd``,
        in our process group, its output going to ``log_fd`` and its stdin the returned
        process's ``stdin``; the function's return value is its exit code. Waits for the
        zygote's preload. Raises :class:`ZygoteRefused` (start this one the plain way) or
        :class:`OSError` (the zygote is gone or failed: :attr:`lost` says why)."""
        r, w = os.pipe()
        try:
            with self._cond:
                reply = self._ask({"op": "fork", "target": target, "env": dict(env), "cwd": cwd}, [r, log_fd],
                                  timeout)
                proc = self._adopt(ForkedProc(reply["pid"], open(w, "wb"), self))
                w = -1
                return proc
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)

    def _adopt(self, proc: ForkedProc) -> ForkedProc:
        self._procs[proc.pid] = proc
        if proc.pid in self._early:
            proc._exited(self._early.pop(proc.pid))
        return proc

    def _read(self) -> None:
        while True:
            try:
                msg, _ = _recv(self.sock)
            except (OSError, ValueError) as e:
                msg, why = None, f"connection failed ({e})"
            else:
                why = "the zygote went away"
            with self._cond:
                if msg is None:  # our workers keep running; ForkedProc watches them itself now
                    self.lost = self.lost or why
                    self._cond.notify_all()
                elif "exit" in msg:
                    proc = self._procs.pop(msg["exit"], None)
                    if proc is None:
                        self._early[msg["exit"]] = msg["code"]
                    else:
                        proc._exited(msg["code"])
                    self._cond.notify_all()
                else:
                    self._replies[msg.get("id")] = msg
                    self._cond.notify_all()
            if msg is None or "exit" in msg:
                self.on_exit()
            if msg is None:
                return

    def close(self) -> None:
        """Disconnect (a shared zygote leaves after its last agent; our own one with us)."""
        with self._cond:
            self.lost = self.lost or "closed"
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.proc is not None:  # our own: it leaves when we disconnect
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def spawn_server(env: Mapping[str, str], log_path: Path, *, owner: int | None = None, linger: bool = False,
                 new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """Start a zygote process with ``env``; (its process, its socket's path). The socket is
    in a fresh 0700 directory the zygote removes when it leaves. With ``owner`` it leaves
    when that process does; without ``linger``, after the last agent that connected left
    (or when none connected within two minutes)."""
    path = os.path.join(tempfile.mkdtemp(prefix="hotspare-z"), "sock")
    cmd = [*worker_command(module="hotspare.agents.zygote_server"), "--socket", path]  # started as a worker is
    if owner:
        cmd += ["--owner", str(owner)]
    if linger:
        cmd.append("--linger")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, env=dict(env), stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=new_session)
    return proc, path


class ZygoteRefused(RuntimeError):
    """The zygote will not fork this worker (another session, or an environment that differs
    where it matters): start it the plain way."""
