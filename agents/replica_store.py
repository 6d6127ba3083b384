"""The snapshots on one node, as its agent serves and keeps them: its workers' slot files and
the replicas its buddies pushed to it (part of :mod:`hotspare.agents.replica`).

Neither is ever read whole into the agent's memory. A snapshot is served as a
:class:`~hotspare.recovery.wire.FileBody`, read from its file a piece at a time as it is sent; a
slot is checked after the last byte to be the same write it was when its CRC32s were computed
(else the frame goes without its MAC and the peer drops it). A pushed replica is written to a
temporary file as it arrives (:class:`ReplicaSink`), its CRC32s computed on the way, and renamed
into place only once the frame MAC and the CRC32s passed.

A replica file is ``u64 header length | header JSON (with the CRC32s) | body``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Collection
from pathlib import Path

from hotspare.recovery.bell import Ringer, confirm_bell
from hotspare.recovery.shm_budget import no_room
from hotspare.recovery.slotfile import (
    COMPLETE,
    CTRL_FORMAT,
    CTRL_SIZE,
    MAGIC,
    REPLICAS_KEPT,
    SlotDir,
    open_slot,
    reserve,
    slot_ctrl,
    slot_steps,
    write_confirmation,
)
from hotspare.recovery.wire import CHUNK, FileBody, WireError
from hotspare.recovery.wire_body import Scratch

log = logging.getLogger("hotspare.replica")

KEEP = REPLICAS_KEPT  # replicas kept per sid
_REPLICA = re.compile(r"^replica-rank(\d+)-step(-?\d+)\.bin\Z")
#: a refused replica (no room) is logged at most this often per sid: its sender retries every round
REFUSAL_LOG_INTERVAL = 60.0


class ReplicaStore:
    """Snapshots on this node: local worker slots plus replicas pushed by peers.

    Every method takes a *sid* (the seat's state id: the name of the slot files), never a
    rank: after a shrink renumbers ranks, ``rank5.point0`` still belongs to sid 5."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.slots = SlotDir(directory)
        self._ringers: dict[int, Ringer] = {}  # sid -> its worker's confirmation bell (replicator's thread)
        self._refusals: dict[int, float] = {}  # sid -> when a refused replica of it was last logged

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

    def timelines(self, sid: int) -> dict[int, int]:
        """step -> the timeline (the epoch whose restore the state descends from) of each
        complete snapshot of ``sid`` here, read from the headers only. A step computed again
        after a rollback is another state: the restore agreement must not mix them (F20)."""
        out: dict[int, int] = {}
        for path in self.slots.files(sid):
            view = open_slot(path)
            if view is not None:
                try:
                    if view.valid():
                        out[int(view.header["step"])] = int(view.header.get("timeline") or 0)
                finally:
                    view.close()
        for step, where in self.steps(sid).items():
            if where != "replica" or step in out:
                continue
            try:
                with open(self.replica_path(sid, step), "rb", buffering=0) as f:
                    hlen = int.from_bytes(os.pread(f.fileno(), 8, 0), "little")
                    out[step] = int(json.loads(os.pread(f.fileno(), hlen, 8)).get("timeline") or 0)
            except (OSError, ValueError, TypeError):
                continue
        return out

    def points(self, sid: int) -> list[tuple[int, int]]:
        """(step, seq) of each complete replication point of a local sid: reads two 64-byte
        control blocks, no directory listing (this runs 20 times a second)."""
        return [(c[1], c[2]) for p in self.slots.points(sid) if (c := slot_ctrl(p)) and c[0] == COMPLETE]

    def newest_point(self, sid: int, ignore: Collection[int] = ()) -> tuple[int, int] | None:
        """The newest of ``points(sid)`` whose seq is not in ``ignore``."""
        mine = [p for p in self.points(sid) if p[1] not in ignore]
        return max(mine) if mine else None

    def load(self, sid: int, step: int, seq: int | None = None) -> tuple[dict, FileBody] | None:
        """Header (with checksums) and body of sid's snapshot at step (and of that write, if
        ``seq`` is given), or None. The body is read from its file as it is sent: close it."""
        for p in self.slots.files(sid):
            got = _open_slot(p, step, seq)
            if got is not None:
                return got
        try:
            f = open(self.replica_path(sid, step), "rb", buffering=0)  # noqa: SIM115 - the FileBody owns it
        except FileNotFoundError:
            return None
        try:
            hlen = int.from_bytes(os.pread(f.fileno(), 8, 0), "little")
            header = json.loads(os.pread(f.fileno(), hlen, 8))
            size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError):
            f.close()
            return None
        return header, FileBody(f, 8 + hlen, size - 8 - hlen, name=f"replica of sid {sid} step {step}")

    def confirm(self, sid: int, step: int, seq: int | None = None) -> None:
        """Tell sid's worker that its point ``step`` (the write ``seq``; default: the one
        in its point slots now) is safely replicated."""
        if seq is None:
            seq = next((q for s, q in self.points(sid) if s == step), 0)
        write_confirmation(self.slots.confirmation(sid), step, seq)
        ringer = self._ringers.get(sid)
        if ringer is None:
            ringer = self._ringers[sid] = Ringer(self.dir / confirm_bell(sid))
        ringer.ring()  # a worker waiting for it wakes now

    def receiving(self, header: dict, n: int) -> ReplicaSink:
        """Where a pushed replica (``header["rank"]``: its sid; its tensor table already checked
        against ``n``) goes as it arrives."""
        return ReplicaSink(self, header, n)

    def save(self, header: dict, body: bytes | bytearray | memoryview) -> None:
        """Keep a peer's replica (``header["rank"]`` is its sid: the wire's name for it), already
        checked; raises WireError if there is no room for it."""
        view = memoryview(body)
        sink = self.receiving(header, len(view))
        for pos in range(0, len(view), CHUNK):
            sink.landed(pos, view[pos : pos + CHUNK])
        sink.keep()

    def _install(self, tmp: Path, sid: int, step: int) -> None:
        """Put a received replica in place and drop the oldest beyond KEEP."""
        os.replace(tmp, self.replica_path(sid, step))
        self._refusals.pop(sid, None)
        reps = sorted(s for s, where in self.steps(sid).items() if where == "replica")
        for old in reps[:-KEEP]:
            self.replica_path(sid, old).unlink(missing_ok=True)

    def _refused(self, sid: int, why: str) -> None:
        """Log a replica refused for lack of room, at most once a minute per sid."""
        now = time.monotonic()
        if now - self._refusals.get(sid, -REFUSAL_LOG_INTERVAL) >= REFUSAL_LOG_INTERVAL:
            self._refusals[sid] = now
            log.error("%s", why)


class ReplicaSink(Scratch):
    """A pushed replica written to a temporary file as it arrives (through two small buffers;
    :mod:`hotspare.recovery.wire_body`); :meth:`keep` renames it into place once the frame passed
    its MAC. The file's room is reserved before the first byte arrives: a full ``/dev/shm`` is an
    answer naming the sizes, not a half-written file.

    Its CRC32s are not computed here (the holder's steady-state cost: one pass over every byte
    fewer per point). The MAC already proves the bytes are the sender's, and the CRC32s are
    checked where a replica is used: the spare fetching it checks every tensor as the body
    arrives (:class:`~hotspare.recovery.wire.SnapshotCheck`), so damage in transit or at rest
    is caught before a byte is loaded, and the spare falls back to another holder."""

    def __init__(self, store: ReplicaStore, header: dict, n: int) -> None:
        super().__init__(n)
        self.store, self.n = store, n
        self.sid, self.step = int(header["rank"]), int(header["step"])
        self.error: str | None = None
        self.tmp = store.dir / f".tmp-replica-{self.sid}-{os.getpid()}-{threading.get_ident()}"
        hb = json.dumps(header, separators=(",", ":")).encode()
        self.off = 8 + len(hb)
        self.fd = -1
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            reserve(self.fd, self.off + n)
            _pwrite_all(self.fd, memoryview(len(hb).to_bytes(8, "little") + hb), 0)
        except OSError as e:
            self._fail(e)

    def landed(self, pos: int, view: memoryview) -> None:
        if self.error is None:
            try:
                _pwrite_all(self.fd, view, self.off + pos)
            except OSError as e:
                self._fail(e)

    def result(self) -> ReplicaSink:
        return self

    def abort(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def keep(self) -> None:
        """The frame passed its MAC: put the replica in place. WireError (the file removed) if
        there was no room."""
        try:
            if self.error is not None:
                raise WireError(self.error)
            self._close()
            self.store._install(self.tmp, self.sid, self.step)
        finally:
            self.abort()  # nothing left behind if it was not installed

    def _fail(self, e: OSError) -> None:
        full = no_room(self.store.dir, self.off + self.n, f"the replica of sid {self.sid} step {self.step}", e)
        self.error = str(full) if full is not None else f"cannot keep the replica of sid {self.sid} step {self.step}: {e}"
        self.store._refused(self.sid, self.error)
        self.abort()

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        k = os.pwrite(fd, view, offset)
        view, offset = view[k:], offset + k


def _ctrl(fd: int) -> tuple | None:
    raw = os.pread(fd, CTRL_SIZE, 0)
    if len(raw) < CTRL_SIZE:
        return None
    c = struct.unpack(CTRL_FORMAT, raw)
    return c if c[0] == MAGIC else None


def _open_slot(path: Path, step: int, seq: int | None) -> tuple[dict, FileBody] | None:
    """A COMPLETE slot of ``step`` (and write ``seq``) as (header with CRC32s, body), else None."""
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - the FileBody owns it
    except FileNotFoundError:
        return None
    try:
        fd = f.fileno()
        c = _ctrl(fd)
        if c is None or c[1] != COMPLETE or c[2] != step or seq not in (None, c[3]):
            f.close()
            return None
        _, _, _, wseq, hlen, doff, dlen, _ = c
        header = json.loads(os.pread(fd, hlen, CTRL_SIZE))
        used = int(header.get("data_len", dlen))
        if doff + used > os.fstat(fd).st_size:
            raise ValueError("slot shorter than its header says")

        def same_write() -> bool:
            now = _ctrl(fd)
            return now is not None and now[1:4] == (COMPLETE, step, wseq)

        body = FileBody(f, doff, used, name=f"snapshot slot {path.name} (step {step})", still_valid=same_write)
        crcs = _checksums(body, header["tensors"])
        if not same_write():  # rewritten while we read it
            raise ValueError("slot rewritten")
        return dict(header, crc=crcs), body
    except (OSError, ValueError, KeyError, TypeError, struct.error, WireError):
        f.close()
        return None


def _checksums(body: FileBody, tensors: list[dict]) -> list[int]:
    """CRC32 of each tensor's bytes, in one pass over the body read a ``CHUNK`` at a time
    (a tensor may span pieces; a piece holds many small tensors: one read, not one per tensor)."""
    spans = sorted((int(t["offset"]), int(t["nbytes"]), i) for i, t in enumerate(tensors))
    out = [0] * len(tensors)
    if not spans:
        return out
    end = max(off + nb for off, nb, _ in spans)
    buf = memoryview(bytearray(max(1, min(CHUNK, end))))
    j = 0  # the first span not yet complete
    for pos in range(0, end, len(buf)):
        piece = buf[: min(len(buf), end - pos)]
        body.read_into(pos, piece)
        stop = pos + len(piece)
        for off, nb, i in spans[j:]:
            if off >= stop:
                break
            a, b = max(off, pos), min(off + nb, stop)
            if a < b:
                out[i] = zlib.crc32(piece[a - pos : b - pos], out[i])
        while j < len(spans) and spans[j][0] + spans[j][1] <= stop:
            j += 1
    return out
