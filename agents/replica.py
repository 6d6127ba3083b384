"""Peer replicas: each agent serves and stores snapshots for its job, off the step path.

* :class:`ReplicaStore` -- the snapshots on this node: its workers' slot files (named by
  :class:`hotspare.recovery.slotfile.SlotDir`) and the replicas its buddies pushed to it
  (:mod:`hotspare.agents.replica_store`; served and kept as streams, never read whole into memory).
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

import logging
import queue
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from hotspare.orchestrator.util import PeriodicWorker
from hotspare.recovery.replica_client import fetch, fetch_first, list_steps  # noqa: F401 - re-exported (deprecated here)
from hotspare.recovery.wire import (
    Channel,
    FileBody,
    Sink,
    SnapshotCheck,
    WireError,
    validate_snapshot,
)

from .node_view import Buddy, NodeView
from .replica_store import KEEP, ReplicaSink, ReplicaStore  # noqa: F401 - KEEP, ReplicaStore re-exported

log = logging.getLogger("hotspare.replica")


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
                    header, body = ch.recv(into=srv.owner.sink_for)
                except WireError as e:
                    if "closed" not in str(e):
                        log.warning("rejected frame from %s: %s", self.client_address[0], e)
                    return
                try:
                    reply, out = srv.answer(header, body)
                finally:
                    if isinstance(body, ReplicaSink):
                        body.abort()  # nothing of a put is left behind unless answer() put it in place
                try:
                    ch.send(reply, out)
                except WireError as e:  # a slot rewritten while it was sent: the peer drops the frame
                    log.info("answer to %s cut short: %s", self.client_address[0], e)
                    return
                finally:
                    if isinstance(out, FileBody):
                        out.close()
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
    answer: Callable[[dict, Any], tuple[dict, Any]]
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
        try:
            self._srv = _Server((host, 0), _Handler)
        except OSError as e:  # most often: --host names another machine's address
            raise OSError(e.errno, f"the replica server cannot listen on {host} ({e.strerror}); --host "
                                   "(or $HOTSPARE_HOST) must be an address of this machine") from e
        self._srv.secret = secret
        self._srv.answer = self.answer
        self._srv.owner = self
        self.paused = False
        #: the last tensor table that passed its check, with its body length: a sid's points share
        #: one layout, and comparing a table with it costs far less than checking it again
        self._table_ok: tuple[int, list] = (-1, [])
        self.port = self._srv.server_address[1]
        self._thread = threading.Thread(target=self._srv.serve_forever, name="replica-server", daemon=True)

    def start(self) -> ReplicaServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    def sink_for(self, header: dict, n: int) -> Sink | None:
        """Where the body of a frame goes: a ``put`` of a well-formed snapshot straight into a
        replica file (:class:`~hotspare.agents.replica_store.ReplicaSink`); anything else into
        memory (:meth:`answer` refuses a malformed put, saying why)."""
        snap = header.get("snapshot")
        if header.get("op") != "put" or not n or not isinstance(snap, dict) or not isinstance(snap.get("step"), int):
            return None
        try:
            sid = int(header.get("rank", -1))
            crc, tensors = snap.get("crc"), snap.get("tensors")
            same = (self._table_ok == (n, tensors) and isinstance(crc, list) and len(crc) == len(tensors)
                    and all(type(c) is int for c in crc))
            if not same:  # its table against the body's length (not its CRC32s: see ReplicaSink)
                SnapshotCheck(snap, n)
                self._table_ok = (n, tensors)
        except (WireError, ValueError, TypeError):
            return None
        return self.store.receiving(dict(snap, rank=sid), n) if sid >= 0 else None

    def answer(self, header: dict, body: Any) -> tuple[dict, Any]:
        """The reply to one request, and its body (a FileBody for a snapshot: close it)."""
        op = header.get("op")
        try:
            sid = int(header.get("rank", -1))  # HSP1's name for the sid
            if op == "list":
                timelines = self.store.timelines(sid)  # step -> timeline: one state per step (F20)
                return {"ok": True, "steps": sorted(self.store.steps(sid)),
                        "timelines": {str(k): v for k, v in timelines.items()}}, b""
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
                if isinstance(body, ReplicaSink) and body.error is not None:  # no room: the store said so
                    return {"ok": False, "error": body.error}, b""
                if isinstance(body, ReplicaSink):
                    body.keep()  # its CRC32s were computed as it arrived
                else:
                    validate_snapshot(snap, body)
                    self.store.save(dict(snap, rank=sid), body)
                return {"ok": True}, b""
        except (WireError, KeyError, ValueError, TypeError) as e:
            log.warning("rejected %s request: %s", op, e)
            return {"ok": False, "error": str(e)}, b""
        return {"ok": False, "error": f"unknown op {op!r}"}, b""


#: How often the replicator looks without being kicked: a ring on the agent's bell (a point
#: completed) or a new view kicks it at once; this only bounds the cost of a ring that got
#: lost, and paces retries to a buddy that did not answer.
SAFETY_INTERVAL = 1.0


class Replicator(PeriodicWorker):
    """Push each new complete local point to this node's ring buddies, then confirm it.
    Event-driven: it runs when kicked (see :class:`~hotspare.agents.node_services.NodeServices`)
    and otherwise every ``SAFETY_INTERVAL`` seconds.

    Its bookkeeping (``sent``, ``confirmed``, ``stale``) belongs to its own thread: the
    agent's thread reads nothing of it and changes it only through :meth:`forget`, which
    posts to a queue the next round drains."""

    def __init__(
        self,
        store: ReplicaStore,
        secret: bytes,
        view: Callable[[], NodeView],
        interval: float = SAFETY_INTERVAL,
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
        self.kick()

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
                try:
                    for name, host, port in todo:
                        if self._send(name, host, port, sid, header, body):
                            self.sent[(sid, name)] = newest
                finally:
                    if isinstance(body, FileBody):
                        body.close()
            if not all(self.sent.get((sid, b[0])) == newest for b in buddies):
                return
        if self.confirmed.get(sid) != newest:
            self.store.confirm(sid, *newest)
            self.confirmed[sid] = newest

    def _send(self, name: str, host: str, port: int, sid: int, header: dict, body: bytes | FileBody) -> bool:
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
