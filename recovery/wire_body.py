"""How a frame's body moves between a socket and where it lives, in pieces, under the frame MAC.

Part of :mod:`hotspare.recovery.wire` (use that module's :class:`~hotspare.recovery.wire.Channel`).
A body is never held whole in memory more than once, and not at all when it lives in a file:

* Receiving, a :class:`Sink` says where each piece goes: straight into its destination
  (:class:`IntoBuffer`: a snapshot slot the spare restores from) or through two small buffers
  (:class:`Scratch`: appended to a growing buffer by :class:`Growing`, the default; written to a
  replica file by the agent's sink). A second thread feeds each piece to the frame MAC while the
  receiving thread hands the same piece, still in cache, to the sink's ``landed`` (the CRC32s of a
  snapshot, the copy onward) and then fills the next one (hashlib lets go of the GIL). Nothing a
  sink was given may be used before :meth:`Channel.recv <hotspare.recovery.wire.Channel.recv>`
  returns: the MAC over the last byte is checked only then; on any failure the sink's ``abort``
  undoes what it did.
* Sending, a :class:`FileBody` is read from its file a piece at a time (``preadv`` into one of two
  small buffers), hashed by the second thread while the socket sends it. A body that changed
  while it was sent (a snapshot slot rewritten) is left without its MAC: the peer drops it.

No torch import here: agents use it too.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

#: bodies are received (and hashed, by a second thread) in pieces of this size; smaller ones in one
CHUNK = 4 << 20
#: a file body is read, hashed and sent in pieces of this size: small enough that the hash and
#: the socket both find it in the CPU's cache
FILE_PIECE = 1 << 20


class WireError(Exception):
    """A frame or peer that must not be trusted; the message says what was wrong."""


def fill(sock: socket.socket, view: memoryview, got: int, n: int) -> None:
    """Fill ``view`` from the socket (``got`` of the ``n`` bytes expected already read)."""
    have, want = 0, len(view)
    while have < want:
        k = sock.recv_into(view[have:], want - have)
        if k == 0:
            raise WireError(f"peer closed the connection ({got + have} of {n} bytes read)")
        have += k


class Sink(Protocol):
    """Where a received body goes (see :meth:`hotspare.recovery.wire.Channel.recv`)."""

    def target(self, pos: int, n: int) -> memoryview:
        """A writable view for the body's bytes ``[pos, pos + n)``; pieces come in order."""
        ...

    def landed(self, pos: int, view: memoryview) -> None:
        """Those bytes arrived (in order, on the receiving thread while the MAC's thread hashes
        them; not yet authenticated). A scratch buffer is refilled only after this returned."""
        ...

    def result(self) -> Any:
        """The body, once every byte arrived and passed the MAC."""
        ...

    def abort(self) -> None:
        """The frame failed: undo whatever was done with its bytes."""
        ...


Observer = Callable[[int, memoryview], None]


class IntoBuffer:
    """Straight into ``dest`` (exactly the body's length): no copy but the socket's."""

    def __init__(self, dest: memoryview, observe: Observer | None = None) -> None:
        self.dest = dest
        self.observe = observe

    def target(self, pos: int, n: int) -> memoryview:
        return self.dest[pos : pos + n]

    def landed(self, pos: int, view: memoryview) -> None:
        if self.observe is not None:
            self.observe(pos, view)

    def result(self) -> memoryview:
        return self.dest

    def abort(self) -> None:
        pass


class Scratch:
    """Pieces land in one of two ``CHUNK``-sized buffers in turn (the receiving loop waits until
    a buffer's previous piece was hashed before it refills it); ``landed`` moves them on."""

    def __init__(self, n: int) -> None:
        size = min(n, CHUNK)
        self._bufs = (memoryview(bytearray(size)), memoryview(bytearray(size if n > CHUNK else 0)))

    def target(self, pos: int, n: int) -> memoryview:
        return self._bufs[(pos // CHUNK) % 2][:n]

    def abort(self) -> None:
        pass


class Growing(Scratch):
    """The default: a ``bytearray`` that grows with what actually arrives, never with what a peer
    merely claims it will send (a small body is received into it directly)."""

    def __init__(self, n: int, observe: Observer | None = None) -> None:
        self.observe = observe
        self.small = n <= CHUNK
        self.body = bytearray(n if self.small else 0)
        if not self.small:
            super().__init__(n)

    def target(self, pos: int, n: int) -> memoryview:
        return memoryview(self.body)[pos : pos + n] if self.small else super().target(pos, n)

    def landed(self, pos: int, view: memoryview) -> None:
        if self.observe is not None:
            self.observe(pos, view)
        if not self.small:
            self.body += view

    def result(self) -> bytearray:
        return self.body


def recv_body(sock: socket.socket, n: int, mac: Any, sink: Sink) -> None:
    """The ``n``-byte body into ``sink``, fed to ``mac`` as it arrives. A large body is hashed by
    a second thread while the receiving thread passes each piece on (``landed``) and fills the next."""
    if n <= CHUNK:
        view = sink.target(0, n)
        fill(sock, view, 0, n)
        mac.update(view)
        sink.landed(0, view)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="wire-mac") as hasher:  # one thread: in order
        pending: deque[Future] = deque()
        for pos in range(0, n, CHUNK):
            if len(pending) == 2:
                pending.popleft().result()  # the piece before last is hashed: its buffer may be refilled
            view = sink.target(pos, min(CHUNK, n - pos))
            fill(sock, view, pos, n)
            pending.append(hasher.submit(mac.update, view))
            sink.landed(pos, view)
        for f in pending:
            f.result()


class FileBody:
    """A body read from an open file, ``length`` bytes from ``offset``, a piece at a time as it
    is sent: a replica file or a snapshot slot an agent serves, never read whole into memory.

    ``still_valid()`` is asked after the last byte and before the frame MAC: False (a slot
    rewritten while it was sent) leaves the frame without its MAC, so the peer drops it and
    nothing of it is used. The body can be sent more than once (to several buddies)."""

    def __init__(self, f: BinaryIO, offset: int, length: int, name: str,
                 still_valid: Callable[[], bool] = lambda: True) -> None:
        self.f = f
        self.offset = offset
        self.length = length
        self.name = name
        self.still_valid = still_valid

    def __len__(self) -> int:
        return self.length

    def read_into(self, pos: int, view: memoryview) -> None:
        """Bytes ``[pos, pos + len(view))`` of the body."""
        have = 0
        while have < len(view):
            k = os.preadv(self.f.fileno(), [view[have:]], self.offset + pos + have)
            if k == 0:
                raise WireError(f"{self.name} ended after {pos + have} of its {self.length} bytes")
            have += k

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> FileBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_file(sock: socket.socket, prefix: bytes, mac: Any, body: FileBody) -> None:
    """``prefix`` (the frame's head), ``body`` read from its file and hashed by a second thread
    while it is sent, then the frame MAC -- unless the body changed meanwhile (WireError; the
    caller closes the connection)."""
    n = len(body)
    if n <= CHUNK:  # a second thread costs more than it saves: read, hash and send in one pass
        buf = memoryview(bytearray(n))
        sock.sendall(prefix)
        for pos in range(0, n, FILE_PIECE):
            view = buf[pos : pos + FILE_PIECE]
            body.read_into(pos, view)
            mac.update(view)
        _check_unchanged(body)
        sock.sendall(buf)
        sock.sendall(mac.digest())
        return
    bufs = (memoryview(bytearray(FILE_PIECE)), memoryview(bytearray(FILE_PIECE)))
    sock.sendall(prefix)
    with ThreadPoolExecutor(1, thread_name_prefix="wire-mac") as hasher:
        pending: deque[Future] = deque()
        for i, pos in enumerate(range(0, n, FILE_PIECE)):
            if len(pending) == 2:
                pending.popleft().result()  # that buffer is hashed: it may be refilled
            view = bufs[i % 2][: min(FILE_PIECE, n - pos)]
            body.read_into(pos, view)
            pending.append(hasher.submit(mac.update, view))
            sock.sendall(view)
        for f in pending:
            f.result()
    _check_unchanged(body)
    sock.sendall(mac.digest())


def _check_unchanged(body: FileBody) -> None:
    if not body.still_valid():
        raise WireError(f"{body.name} was rewritten while it was sent; the frame goes without its MAC "
                        "and the peer drops it")
