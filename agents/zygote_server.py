"""The zygote process itself (:mod:`hotspare.agents.zygote` has the design, the protocol
helpers and the agents' side): it preloads, then runs agents and forks warm workers for the
agents connected to it, and reaps them all. Started by :func:`~hotspare.agents.zygote.spawn_server`
as ``<worker_link.worker_command(module=...)> --socket PATH [--owner PID] [--linger]``."""

from __future__ import annotations

import importlib
import io
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback

from .zygote import EXIT_FORK_SETUP, PRELOAD, _pdeathsig, _peer, _recv, _send, env_mismatch


class _Server:
    """The zygote process. It preloads, then runs agents (``exec``, each in a process group of
    its own, so that a machine's agents live in the zygote's session) and forks workers
    (``fork``), each into its agent's process group, so that killing an agent's group kills
    the node as before. It preloads in its only thread before it serves: a child forked after
    another thread had used MKL hangs in MKL's allocator (measured: 1 start in 2)."""

    def __init__(self, path: str, owner: int | None, linger: bool, idle: float) -> None:
        self.path = path
        self.linger = linger
        self.idle = idle
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(64)  # agents may connect (and queue requests) while we preload
        self.sel.register(self.listener, selectors.EVENT_READ, ("listen", None))
        self.peers: dict[socket.socket, int] = {}  # connection -> the peer's pid (SO_PEERCRED)
        #: pid -> (pidfd, who asked, the Popen of an exec'd one: it must reap its own)
        self.children: dict[int, tuple[int, socket.socket, subprocess.Popen | None]] = {}
        self.served = 0  # connections ever accepted: the zygote leaves after its last one
        self.env = dict(os.environ)
        self.preload_error = ""
        self.owner_fd = os.pidfd_open(owner) if owner else None
        if self.owner_fd is not None:
            self.sel.register(self.owner_fd, selectors.EVENT_READ, ("owner", None))

    def _preload(self) -> None:
        try:
            for name in PRELOAD:
                importlib.import_module(name)
            import torch

            if torch.cuda.is_initialized():  # a fork would inherit a CUDA context it cannot use
                raise RuntimeError("CUDA was initialised while preloading")
        except BaseException as e:  # noqa: BLE001 - reported to every fork request
            self.preload_error = f"preloading failed: {type(e).__name__}: {e}"
            print(f"zygote: {self.preload_error}", file=sys.stderr, flush=True)
        else:
            print(f"zygote pid {os.getpid()} ready on {self.path}", file=sys.stderr, flush=True)

    def serve(self) -> int:
        started = time.monotonic()
        self._preload()  # agents may connect and queue requests meanwhile (the listen backlog)
        while True:
            if not (self.linger or self.peers or self.children):
                if self.served or time.monotonic() - started > self.idle:
                    return 0  # the last agent left (or none came)
            timeout = None if self.linger or self.peers or self.children else \
                max(0.1, self.idle - (time.monotonic() - started))
            for key, _ in self.sel.select(timeout):
                kind, data = key.data
                if kind == "listen":
                    self._accept()
                elif kind == "owner":
                    return 0
                elif kind == "client":
                    self._request(key.fileobj)
                elif kind == "child":
                    self._reap(data)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        pid, uid = _peer(conn)
        if uid != os.getuid():  # only our own user's agents
            conn.close()
            return
        self.peers[conn] = pid
        self.served += 1
        self.sel.register(conn, selectors.EVENT_READ, ("client", None))

    def _drop(self, conn: socket.socket) -> None:
        if self.peers.pop(conn, None) is not None:
            self.sel.unregister(conn)
            conn.close()

    def _request(self, conn: socket.socket) -> None:
        try:
            msg, fds = _recv(conn, maxfds=2)
        except (OSError, ValueError):
            msg, fds = None, []
        if msg is None:
            self._drop(conn)
            return
        for fd in fds:
            os.set_inheritable(fd, False)
        self._answer(conn, msg, fds)

    def _answer(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        try:
            reply = self._handle(conn, msg, fds)
        except OSError as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        reply["id"] = msg.get("id")
        try:
            _send(conn, reply)
        except OSError:
            self._drop(conn)

    def _handle(self, conn: socket.socket, msg: dict, fds: list[int]) -> dict:
        op, env = msg.get("op"), msg.get("env")
        if op not in ("hello", "fork", "exec") or not isinstance(env, dict):
            return {"error": "bad request: op must be hello, fork or exec, with an env"}
        if op == "exec":
            return self._exec(conn, msg, fds)
        why = self._refuse(self.peers.get(conn, 0), env)
        if op == "hello" or why:
            return {"ok": not why, "why": why} if op == "hello" else {"error": why, "refused": True}
        if self.preload_error:
            return {"error": self.preload_error}
        if len(fds) != 2 or ":" not in str(msg.get("target", "")):
            return {"error": "bad request: fork needs a target and 2 descriptors"}
        pgid = os.getpgid(self.peers[conn])
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            _become_worker(msg, fds, pgid, self._fds_to_close())
        self._watch(pid, conn)
        return {"pid": pid}

    def _refuse(self, peer: int, env: dict) -> str:
        """Why a worker for this peer and environment cannot be forked here ("" if it can)."""
        try:
            if os.getsid(peer) != os.getsid(0):
                return "the agent is not in this zygote's session (its workers could not join its process group)"
        except ProcessLookupError:
            return "the agent is gone"
        differ = env_mismatch(self.env, env)
        return f"the environment differs in {', '.join(differ[:5])}" if differ else ""

    def _exec(self, conn: socket.socket, msg: dict, fds: list[int]) -> dict:
        argv = msg.get("argv")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)) or len(fds) != 1:
            return {"error": "bad request: exec needs an argv and 1 descriptor"}
        log_fd = fds[0]
        # a process group of its own, in our session
        proc = subprocess.Popen(argv, cwd=msg.get("cwd") or "/", env={str(k): str(v) for k, v in msg["env"].items()},
                                stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, process_group=0)
        self._watch(proc.pid, conn, proc)
        return {"pid": proc.pid}

    def _watch(self, pid: int, conn: socket.socket, proc: subprocess.Popen | None = None) -> None:
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (pidfd, conn, proc)
        self.sel.register(pidfd, selectors.EVENT_READ, ("child", pid))

    def _fds_to_close(self) -> list[int]:
        fds = [self.listener.fileno(), self.sel.fileno(), *(c.fileno() for c in self.peers)]
        fds += [pidfd for pidfd, _, _ in self.children.values()]
        if self.owner_fd is not None:
            fds.append(self.owner_fd)
        return fds

    def _reap(self, pid: int) -> None:
        pidfd, conn, proc = self.children.pop(pid)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        code = proc.wait() if proc is not None else os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if conn in self.peers:
            try:
                _send(conn, {"exit": pid, "code": code})
            except OSError:
                self._drop(conn)

    def close(self) -> None:
        for remove in (os.unlink, os.rmdir):  # the socket, then its private directory
            try:
                remove(self.path if remove is os.unlink else os.path.dirname(self.path))
            except OSError:
                pass


def _become_worker(msg: dict, fds: list[int], pgid: int, close: list[int]) -> None:
    """In the forked child: join process group ``pgid`` (its agent's), take the request's
    stdio, environment and directory, then run its ``target`` (``module:function``, called
    without arguments: the worker's ``main``) and exit with what it returns. Never returns."""
    code = EXIT_FORK_SETUP
    try:
        os.setpgid(0, pgid)
        for fd in close:
            try:
                os.close(fd)
            except OSError:
                pass
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else
                          signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)
        stdin_fd, out_fd = fds
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(stdin_fd)
        os.close(out_fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
        os.chdir(msg.get("cwd") or "/")
        os.environ.clear()
        os.environ.update(msg["env"])
        if "numpy" in sys.modules:  # as a fresh process would seed it (random reseeds itself)
            sys.modules["numpy"].random.seed()
        module, _, func = str(msg.get("target", "")).partition(":")
        code = getattr(importlib.import_module(module), func)()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else EXIT_FORK_SETUP
    except BaseException:  # noqa: BLE001 - a worker must never fall back into the zygote's loop
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """``<worker_command> --socket PATH [--owner PID] [--linger] [--idle S]``: serve until the
    owner dies, or (without ``--linger``) until the last agent that connected has left."""
    import argparse

    p = argparse.ArgumentParser(prog="hotspare-zygote")
    p.add_argument("--socket", required=True)
    p.add_argument("--owner", type=int, default=0, help="leave when this process is gone")
    p.add_argument("--linger", action="store_true", help="stay when no agent is connected")
    p.add_argument("--idle", type=float, default=120.0, help="leave if no agent connects within this")
    a = p.parse_args(argv)
    if a.owner and os.getppid() == a.owner:  # the agent's own zygote, in its process group:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when we leave (a Ctrl-C
        _pdeathsig()  # meant for it reaches us too), and we leave with it
    server = _Server(a.socket, a.owner or None, a.linger, a.idle)
    try:
        return server.serve()
    finally:
        server.close()


if __name__ == "__main__":  # started through worker_link.worker_command(module=...), as a worker is
    sys.exit(main(sys.argv[1:]))
