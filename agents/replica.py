"""Peer replicas: each agent serves and stores snapshots for its job, off the step path.

* :class:`ReplicaStore` -- the snapshots on this node: its workers' slot files (named by
  :class:`hotspare.recovery.slotfile.SlotDir`) and the replicas its buddies pushed to it.
* :class:`ReplicaServer` answers ``list`` (which steps of a sid do you hold?), ``get``
  (send me sid s at step n) and ``put`` (keep this replica) over authenticated,
  frames MACed over header and body (:mod:`hotspare.recovery.wire`). It serves the snapshot slots its own workers
  wrote -- also those of a worker that crashed: they live in shared memory -- and the
  replicas its buddies pushed to it. The client side is :mod:`hotspare.recovery.replica_client`.
* :class:`Replicator` watches this node's point slots and pushes every newly completed
  point to the ``replicas`` next nodes in ring order, then confirms it to the worker. It
  always sends the newest complete point: if the link is slower than training,
  intermediate points are skipped, never queued.

The protocol (``HSP1``, now ``HSP2``) calls the state id ``"rank"`` on the wire; in this module it is a sid.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from hotspare.orchestrator.util import PeriodicWorker
from hotspare.recovery.replica_client import fetch, fetch_first, list_steps  # noqa: F401 - re-exported (deprecated here)
from hotspare.recovery.slotfile import (
    COMPLETE,
    SlotDir,
    read_slot,
    slot_ctrl,
    slot_steps,
    write_confirmation,
)
from hotspare.recovery.wire import Channel, WireError, checksums, validate_snapshot

from .node_view import Buddy, NodeView

log = logging.getLogger("hotspare.replica")

KEEP = 3  # replicas kept per sid
_REPLICA = re.compile(r"^replica-rank(\d+)-step(-?\d+)\.bin\Z")


class ReplicaStore:
    """Snapshots on this node: local worker slots plus replicas pushed by peers.

    Every method takes a *sid* (the seat's state id: the name of the slot files), never a
    rank: after a shrink renumbers ranks, ``rank5.point0`` still belongs to sid 5."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.slots = SlotDir(directory)

    def replica_path(self, sid: int, step: int) -> Path:
        """Where a peer's replica of ``sid`` at ``step`` is kept."""
        return self.dir / f"replica-rank{sid}-step{step}.bin"

    def steps(self, sid: int) -> dict[int, str]:
        """step -> where (``slot``, ``point`` or ``replica``) for every complete snapshot
        of ``sid`` on this node."""
        out: dict[int, str] = {}
        for p in self.dir.iterdir():
            parsed = SlotDir.parse(p.name)
            if parsed and parsed[0] == sid:
                st = slot_steps(p)
                if st and st[0] == COMPLETE:
                    out[st[1]] = parsed[1]
            m = _REPLICA.match(p.name)
            if m and int(m.group(1)) == sid:
                out.setdefault(int(m.group(2)), "replica")
        return out

    def points(self, sid: int) -> list[tuple[int, int]]:
        """(step, seq) of each complete replication point of a local sid: reads two 64-byte
        control blocks, no directory listing (this runs 20 times a second)."""
        return [(c[1], c[2]) for p in self.slots.points(sid) if (c := slot_ctrl(p)) and c[0] == COMPLETE]

    def newest_point(self, sid: int, ignore: Collection[int] = ()) -> tuple[int, int] | None:
        """The newest of ``points(sid)`` whose seq is not in ``ignore``."""
        mine = [p for p in self.points(sid) if p[1] not in ignore]
        return max(mine) if mine else None

    def load(self, sid: int, step: int, seq: int | None = None) -> tuple[dict, bytes] | None:
        """Header (with checksums) and body of sid's snapshot at step (and of that write,
        if ``seq`` is given), or None."""
        for p in self.slots.files(sid):
            got = read_slot(p)
            if got and got[0]["step"] == step and seq in (None, got[2]):
                header, data, _ = got
                header = dict(header, crc=checksums(header["tensors"], data))
                return header, bytes(data)
        try:
            raw = self.replica_path(sid, step).read_bytes()
        except FileNotFoundError:
            return None
        hlen = int.from_bytes(raw[:8], "little")
        return json.loads(raw[8 : 8 + hlen]), raw[8 + hlen :]

    def confirm(self, sid: int, step: int, seq: int | None = None) -> None:
        """Tell sid's worker that its point ``step`` (the write ``seq``; default: the one
        in its point slots now) is safely replicated."""
        if seq is None:
            seq = next((q for s, q in self.points(sid) if s == step), 0)
        write_confirmation(self.slots.confirmation(sid), step, seq)

    def save(self, header: dict, body: bytes) -> None:
        """Keep a peer's replica (``header["rank"]`` is its sid: the wire's name for it).
        Written in pieces, not through :func:`hotspare.orchestrator.util.atomic_write`, so that a
        large body is never copied once more in memory; shared memory needs no fsync."""
        sid, step = int(header["rank"]), int(header["step"])
        hb = json.dumps(header, separators=(",", ":")).encode()
        tmp = self.dir / f".tmp-replica-{sid}-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            f.write(body)
        os.replace(tmp, self.replica_path(sid, step))
        reps = sorted(s for s, where in self.steps(sid).items() if where == "replica")
        for old in reps[:-KEEP]:
            self.replica_path(sid, old).unlink(missing_ok=True)


#: a stranger on the replica port gets this long to answer the challenge (was the wire's 10 s)
HANDSHAKE_TIMEOUT = 2.0
#: an authenticated connection may stay silent this long between frames
IDLE_TIMEOUT = 10.0
#: handshakes in progress at once: a stranger gets no more threads and descriptors than these
#: (each for at most HANDSHAKE_TIMEOUT), whatever number of connections it opens
MAX_PENDING = 32


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        srv = self.server
        try:
            if srv.owner.paused:  # chaos: partitioned node
                return
            try:
                ch = Channel.server(self.request, srv.secret, timeout=HANDSHAKE_TIMEOUT)
            except (WireError, OSError) as e:
                srv.refused(self.client_address[0], str(e))
                return
        finally:
            srv.handshake_over(self.request, self.client_address[0])
        try:
            self.request.settimeout(IDLE_TIMEOUT)
            while True:
                try:
                    header, body = ch.recv()
                except WireError as e:
                    if "closed" not in str(e):
                        log.warning("rejected frame from %s: %s", self.client_address[0], e)
                    return
                ch.send(*srv.answer(header, body))
        except OSError:
            return
        finally:
            ch.close()


class _Server(socketserver.ThreadingTCPServer):
    """A thread per connection, but a bounded number of them for connections that have not
    authenticated yet: with :data:`MAX_PENDING` handshakes pending, a new connection drops the
    oldest pending handshake of the source address that has the most. A flood therefore holds
    at most ``MAX_PENDING`` threads and descriptors, each for at most
    :data:`HANDSHAKE_TIMEOUT`, and it evicts itself: a genuine peer's handshake (one round
    trip) is served throughout -- from another address always, from the flood's own address
    unless the flood opens ``MAX_PENDING`` connections within that round trip."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # a burst of connections waits in the kernel, not in SYN retries
    secret: bytes
    answer: Callable[[dict, bytes], tuple[dict, bytes]]
    owner: ReplicaServer

    def __init__(self, address: tuple[str, int], handler: type[socketserver.BaseRequestHandler]) -> None:
        super().__init__(address, handler)
        self._lock = threading.Lock()
        #: source address -> its pending handshakes, oldest first (the dicts keep insertion order)
        self._pending: dict[str, dict[object, None]] = {}
        self._npending = 0
        self._refused = 0  # since the last log line about them
        self._refused_logged = 0.0
        self.refused_count = 0  # connections that failed their handshake or were dropped, in all

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's
        self._admit(request, client_address[0])
        try:
            super().process_request(request, client_address)  # its thread calls handshake_over
        except BaseException:
            self.handshake_over(request, client_address[0])
            raise

    def _admit(self, request: object, host: str) -> None:
        with self._lock:
            if self._npending >= MAX_PENDING:
                # the address holding the most pending handshakes pays, with its oldest: a
                # flood evicts itself, not a peer whose one handshake takes a round trip
                worst = max(self._pending, key=lambda h: len(self._pending[h]))
                old = next(iter(self._pending[worst]))
                self._forget(old, worst)
                try:  # its handler wakes, counts it refused and closes it. It cannot have closed it
                    # yet: it calls handshake_over (under this lock) first, and it was still pending
                    old.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
                except OSError:
                    pass
            self._pending.setdefault(host, {})[request] = None
            self._npending += 1

    def handshake_over(self, request: object, host: str) -> None:
        """``request`` (from ``host``) authenticated or failed: it no longer counts as pending."""
        with self._lock:
            if request in self._pending.get(host, ()):
                self._forget(request, host)

    def _forget(self, request: object, host: str) -> None:
        mine = self._pending[host]
        del mine[request]
        self._npending -= 1
        if not mine:
            del self._pending[host]

    def refused(self, host: str, why: str) -> None:
        """Count a connection that failed its handshake (or was dropped); log at most one line
        per 10 s about them (a flood must not flood the log)."""
        with self._lock:
            self.refused_count += 1
            self._refused += 1
            now = time.monotonic()
            if self._refused_logged and now - self._refused_logged < 10.0:
                return
            log.warning("refused %d replica connection(s) since the last such line; the latest from %s: %s",
                        self._refused, host, why)
            self._refused, self._refused_logged = 0, now


class ReplicaServer:
    def __init__(self, store: ReplicaStore, secret: bytes, host: str = "127.0.0.1") -> None:
        self.store = store
        self._srv = _Server((host, 0), _Handler)
        self._srv.secret = secret
        self._srv.answer = self.answer
        self._srv.owner = self
        self.paused = False
        self.port = self._srv.server_address[1]
        self._thread = threading.Thread(target=self._srv.serve_forever, name="replica-server", daemon=True)

    def start(self) -> ReplicaServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    def answer(self, header: dict, body: bytes) -> tuple[dict, bytes]:
        op = header.get("op")
        try:
            sid = int(header.get("rank", -1))  # HSP1's name for the sid
            if op == "list":
                return {"ok": True, "steps": sorted(self.store.steps(sid))}, b""
            if op == "get":
                got = self.store.load(sid, int(header["step"]))
                if got is None:  # "rank" in the text: what peers of HSP1 have always read
                    return {"ok": False, "error": f"no snapshot of rank {sid} at step {header['step']}"}, b""
                h, data = got
                return {"ok": True, "snapshot": h}, data
            if op == "put":
                if sid < 0:
                    raise WireError(f"put for invalid rank {sid}")
                snap = header.get("snapshot")
                if not isinstance(snap, dict) or not isinstance(snap.get("step"), int):
                    raise WireError("put without a snapshot header")
                validate_snapshot(snap, body)
                self.store.save(dict(snap, rank=sid), body)
                return {"ok": True}, b""
        except (WireError, KeyError, ValueError, TypeError) as e:
            log.warning("rejected %s request: %s", op, e)
            return {"ok": False, "error": str(e)}, b""
        return {"ok": False, "error": f"unknown op {op!r}"}, b""


class Replicator(PeriodicWorker):
    """Push each new complete local point to this node's ring buddies, then confirm it.

    Its bookkeeping (``sent``, ``confirmed``, ``stale``) belongs to its own thread: the
    agent's thread reads nothing of it and changes it only through :meth:`forget`, which
    posts to a queue the next round drains."""

    def __init__(
        self,
        store: ReplicaStore,
        secret: bytes,
        view: Callable[[], NodeView],
        interval: float = 0.05,
    ) -> None:
        super().__init__("replicator", interval)
        self.store = store
        self.secret = secret
        self.view = view
        # a point is one write, (step, seq): a new worker of a sid writes the same step again
        self.sent: dict[tuple[int, str], tuple[int, int]] = {}  # (sid, buddy) -> newest point sent
        self.confirmed: dict[int, tuple[int, int]] = {}  # sid -> newest point confirmed to its worker
        # sid -> seqs of points an earlier worker of the sid left here: still served to
        # peers (they are valid state), never confirmed to the new worker as its own
        self.stale: dict[int, set[int]] = {}
        self._forgotten: queue.SimpleQueue[tuple[int, set[int]]] = queue.SimpleQueue()
        self._channels: dict[str, Channel] = {}
        self.paused = False  # chaos: a partitioned node pushes nothing
        self.bytes_sent = 0

    def stop(self, join: float = 2.0) -> None:
        super().stop(join)
        for ch in self._channels.values():
            ch.close()

    def forget(self, sid: int) -> None:
        """A new worker took seat ``sid`` here: start its replication bookkeeping afresh.

        Runs on the agent's thread, so it only posts the request. The points the earlier
        worker left are read now, before the new worker can write one of its own."""
        self._forgotten.put((sid, {seq for _, seq in self.store.points(sid)}))

    def _apply_forgotten(self) -> None:
        while True:
            try:
                sid, stale = self._forgotten.get_nowait()
            except queue.Empty:
                return
            self.confirmed.pop(sid, None)
            for key in [k for k in self.sent if k[0] == sid]:
                del self.sent[key]
            self.stale[sid] = stale

    def once(self) -> None:
        self.push_once()

    def push_once(self) -> None:
        view = self.view()
        # drained after the view is read: a seat the view holds was forgotten before the
        # agent published it, so its fresh start is never missed
        self._apply_forgotten()
        if self.paused:
            return
        for sid in view.sids:
            self._push(sid, view.buddies)

    def _push(self, sid: int, buddies: tuple[Buddy, ...]) -> None:
        newest = self.store.newest_point(sid, ignore=self.stale.get(sid, ()))
        if newest is None:
            return
        if buddies:  # else nobody to replicate to (one node): do not hold training back
            todo = [b for b in buddies if self.sent.get((sid, b[0])) != newest]
            if todo:
                got = self.store.load(sid, *newest)
                if got is None:
                    return  # overwritten while reading; next round
                header, body = got
                for name, host, port in todo:
                    if self._send(name, host, port, sid, header, body):
                        self.sent[(sid, name)] = newest
            if not all(self.sent.get((sid, b[0])) == newest for b in buddies):
                return
        if self.confirmed.get(sid) != newest:
            self.store.confirm(sid, *newest)
            self.confirmed[sid] = newest

    def _send(self, name: str, host: str, port: int, sid: int, header: dict, body: bytes) -> bool:
        try:
            ch = self._channels.get(name)
            if ch is None:
                ch = self._channels[name] = Channel.client(host, port, self.secret, timeout=10)
            ch.send({"op": "put", "rank": sid, "snapshot": header}, body)
            reply, _ = ch.recv()
            if not reply.get("ok"):
                log.warning("replica of sid %d step %s refused by %s: %s", sid, header["step"], name, reply.get("error"))
                return False
            self.bytes_sent += len(body)
            return True
        except (TimeoutError, OSError, WireError) as e:
            log.info("replication to %s failed (%s); will retry", name, e)
            ch = self._channels.pop(name, None)
            if ch:
                ch.close()
            time.sleep(0.2)
            return False
