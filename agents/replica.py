"""Peer replicas: each agent serves and stores snapshots for its job, off the step path.

* :class:`ReplicaServer` answers ``list`` (which steps of a rank do you hold?), ``get``
  (send me rank r at step s) and ``put`` (keep this replica) over authenticated,
  checksummed frames (:mod:`recovery.wire`). It serves the snapshot slots its own workers
  wrote — also those of a worker that crashed: they live in shared memory — and the
  replicas its buddies pushed to it.
* :class:`Replicator` watches this node's slot files and pushes every newly completed
  snapshot to the ``replicas`` next nodes in ring order. It always sends the newest
  complete snapshot: if the link is slower than training, intermediate steps are skipped,
  never queued.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socketserver
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from recovery.replica_client import fetch, fetch_first, list_steps  # noqa: F401 - re-exported (deprecated here)
from recovery.slotfile import COMPLETE, read_slot, slot_ctrl, slot_steps, write_confirmation
from recovery.wire import Channel, WireError, checksums, validate_snapshot

log = logging.getLogger("hotspare.replica")

KEEP = 3  # replicas kept per rank
_SLOT = re.compile(r"^rank(\d+)\.(slot|point)(\d+)$")
_REPLICA = re.compile(r"^replica-rank(\d+)-step(-?\d+)\.bin$")


class ReplicaStore:
    """Snapshots on this node: local worker slots plus replicas pushed by peers."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def steps(self, rank: int) -> dict[int, str]:
        """step -> where (``slot``, ``point`` or ``replica``) for every complete snapshot
        of ``rank`` on this node."""
        out: dict[int, str] = {}
        for p in self.dir.iterdir():
            m = _SLOT.match(p.name)
            if m and int(m.group(1)) == rank:
                st = slot_steps(p)
                if st and st[0] == COMPLETE:
                    out[st[1]] = m.group(2)
            m = _REPLICA.match(p.name)
            if m and int(m.group(1)) == rank:
                out.setdefault(int(m.group(2)), "replica")
        return out

    def points(self, rank: int) -> list[tuple[int, int]]:
        """(step, seq) of each complete replication point of a local rank: reads two 64-byte
        control blocks, no directory listing (this runs 20 times a second)."""
        return [(c[1], c[2]) for k in range(2)
                if (c := slot_ctrl(self.dir / f"rank{rank}.point{k}")) and c[0] == COMPLETE]

    def newest_point(self, rank: int, ignore: Collection[int] = ()) -> tuple[int, int] | None:
        """The newest of ``points(rank)`` whose seq is not in ``ignore``."""
        mine = [p for p in self.points(rank) if p[1] not in ignore]
        return max(mine) if mine else None

    def load(self, rank: int, step: int, seq: int | None = None) -> tuple[dict, bytes] | None:
        """Header (with checksums) and body of rank's snapshot at step (and of that write,
        if ``seq`` is given), or None."""
        for p in sorted(self.dir.glob(f"rank{rank}.*")):
            if not _SLOT.match(p.name):
                continue
            got = read_slot(p)
            if got and got[0]["step"] == step and seq in (None, got[2]):
                header, data, _ = got
                header = dict(header, crc=checksums(header["tensors"], data))
                return header, bytes(data)
        p = self.dir / f"replica-rank{rank}-step{step}.bin"
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        hlen = int.from_bytes(raw[:8], "little")
        return json.loads(raw[8 : 8 + hlen]), raw[8 + hlen :]

    def confirm(self, rank: int, step: int, seq: int | None = None) -> None:
        """Tell rank's worker that its point ``step`` (the write ``seq``; default: the one
        in its point slots now) is safely replicated."""
        if seq is None:
            seq = next((q for s, q in self.points(rank) if s == step), 0)
        write_confirmation(self.dir / f"rank{rank}.replicated", step, seq)

    def save(self, header: dict, body: bytes) -> None:
        rank, step = int(header["rank"]), int(header["step"])
        hb = json.dumps(header, separators=(",", ":")).encode()
        tmp = self.dir / f".tmp-replica-{rank}-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            f.write(body)
        os.replace(tmp, self.dir / f"replica-rank{rank}-step{step}.bin")
        reps = sorted(s for s, where in self.steps(rank).items() if where == "replica")
        for old in reps[:-KEEP]:
            (self.dir / f"replica-rank{rank}-step{old}.bin").unlink(missing_ok=True)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        srv = self.server
        if srv.owner.paused:  # chaos: partitioned node
            return
        try:
            ch = Channel.server(self.request, srv.secret)
        except (WireError, OSError) as e:
            log.warning("refused replica connection from %s: %s", self.client_address[0], e)
            return
        try:
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
    daemon_threads = True
    allow_reuse_address = True
    secret: bytes
    answer: Callable[[dict, bytes], tuple[dict, bytes]]
    owner: ReplicaServer


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
            rank = int(header.get("rank", -1))
            if op == "list":
                return {"ok": True, "steps": sorted(self.store.steps(rank))}, b""
            if op == "get":
                got = self.store.load(rank, int(header["step"]))
                if got is None:
                    return {"ok": False, "error": f"no snapshot of rank {rank} at step {header['step']}"}, b""
                h, data = got
                return {"ok": True, "snapshot": h}, data
            if op == "put":
                if rank < 0:
                    raise WireError(f"put for invalid rank {rank}")
                snap = header.get("snapshot")
                if not isinstance(snap, dict) or not isinstance(snap.get("step"), int):
                    raise WireError("put without a snapshot header")
                validate_snapshot(snap, body)
                self.store.save(dict(snap, rank=rank), body)
                return {"ok": True}, b""
        except (WireError, KeyError, ValueError, TypeError) as e:
            log.warning("rejected %s request: %s", op, e)
            return {"ok": False, "error": str(e)}, b""
        return {"ok": False, "error": f"unknown op {op!r}"}, b""


class Replicator:
    """Push each new complete local snapshot to this node's ring buddies."""

    def __init__(
        self,
        store: ReplicaStore,
        secret: bytes,
        buddies: Callable[[], list[tuple[str, str, int]]],
        local_ranks: Callable[[], set[int]],
        interval: float = 0.05,
    ) -> None:
        self.store = store
        self.secret = secret
        self.buddies = buddies
        self.local_ranks = local_ranks
        self.interval = interval
        # a point is one write, (step, seq): a new worker of a rank writes the same step again
        self.sent: dict[tuple[int, str], tuple[int, int]] = {}  # (rank, buddy) -> newest point sent
        self.confirmed: dict[int, tuple[int, int]] = {}  # rank -> newest point confirmed to its worker
        # rank -> seqs of points an earlier worker of the rank left here: still served to
        # peers (they are valid state), never confirmed to the new worker as its own
        self.stale: dict[int, set[int]] = {}
        self._channels: dict[str, Channel] = {}
        self._stop = threading.Event()
        self.paused = False
        self._thread = threading.Thread(target=self._run, name="replicator", daemon=True)
        self.bytes_sent = 0

    def start(self) -> Replicator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        for ch in self._channels.values():
            ch.close()

    def forget(self, rank: int) -> None:
        """A new worker took ``rank`` here: start its replication bookkeeping afresh."""
        self.confirmed.pop(rank, None)
        for key in [k for k in self.sent if k[0] == rank]:
            del self.sent[key]
        self.stale[rank] = {seq for _, seq in self.store.points(rank)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.push_once()
            except Exception:  # noqa: BLE001 - replication is best effort, never fatal
                log.exception("replication round failed")

    def push_once(self) -> None:
        if self.paused:
            return
        buddies = self.buddies()
        for rank in self.local_ranks():
            newest = self.store.newest_point(rank, ignore=self.stale.get(rank, ()))
            if newest is None:
                continue
            if not buddies:  # nobody to replicate to (one node): do not hold training back
                if self.confirmed.get(rank) != newest:
                    self.store.confirm(rank, *newest)
                    self.confirmed[rank] = newest
                continue
            todo = [b for b in buddies if self.sent.get((rank, b[0])) != newest]
            if todo:
                got = self.store.load(rank, *newest)
                if got is None:
                    continue  # overwritten while reading; next round
                header, body = got
                for name, host, port in todo:
                    if self._send(name, host, port, rank, header, body):
                        self.sent[(rank, name)] = newest
            if all(self.sent.get((rank, b[0])) == newest for b in buddies):
                if self.confirmed.get(rank) != newest:
                    self.store.confirm(rank, *newest)
                    self.confirmed[rank] = newest

    def _send(self, name: str, host: str, port: int, rank: int, header: dict, body: bytes) -> bool:
        try:
            ch = self._channels.get(name)
            if ch is None:
                ch = self._channels[name] = Channel.client(host, port, self.secret, timeout=10)
            ch.send({"op": "put", "rank": rank, "snapshot": header}, body)
            reply, _ = ch.recv()
            if not reply.get("ok"):
                log.warning("replica of rank %d step %s refused by %s: %s", rank, header["step"], name, reply.get("error"))
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
