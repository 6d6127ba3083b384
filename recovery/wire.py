"""Replica wire protocol: authenticated, checksummed frames; never pickle.

Connection: mutual challenge-response with the job's secret (HMAC-SHA256 over a fresh
nonce each way), so a stranger on the port is refused before a single frame is read.

Frame:  b"HSF1" | u32 header_len | u64 body_len | 32-byte HMAC | header JSON | body

The HMAC covers the connection's nonces, a per-direction sequence number and the header,
so frames cannot be forged or replayed. The header carries a CRC32 per tensor over its
bytes in the body; a frame whose checksum, lengths, tensor table or HMAC is wrong raises
:class:`WireError` and nothing of it is used. No torch import here: agents use it too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import zlib
from typing import Any

from .slotfile import DTYPES

MAGIC = b"HSF1"
HELLO = b"HSP1"
_HDR = "<4sIQ32s"
HDR_SIZE = struct.calcsize(_HDR)
MAX_HEADER = 16 * 1024 * 1024
MAX_BODY = 1 << 40
#: bytes per element of each snapshot dtype (derived from the one table, slotfile.DTYPES)
ELEM: dict[str, int] = {name: d.itemsize for name, d in DTYPES.items()}


class WireError(Exception):
    """A frame or peer that must not be trusted; the message says what was wrong."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes. Memory grows with what actually arrives (16 MiB at a time), never
    with what a peer merely claims it will send."""
    chunks = []
    got = 0
    while got < n:
        want = min(n - got, 16 << 20)
        buf = bytearray(want)
        view = memoryview(buf)
        have = 0
        while have < want:
            k = sock.recv_into(view[have:], want - have)
            if k == 0:
                raise WireError(f"peer closed the connection ({got + have} of {n} bytes read)")
            have += k
        chunks.append(buf)
        got += want
    return b"".join(chunks) if len(chunks) != 1 else bytes(chunks[0])


class Channel:
    """An authenticated connection (either side)."""

    def __init__(self, sock: socket.socket, secret: bytes, key: bytes) -> None:
        self.sock = sock
        self.secret = secret
        self.key = key  # binds frames to this connection
        self.send_seq = 0
        self.recv_seq = 0
        self.is_server = False

    # -- handshake ------------------------------------------------------------------------
    @classmethod
    def server(cls, sock: socket.socket, secret: bytes, timeout: float = 10.0) -> Channel:
        sock.settimeout(timeout)
        nonce = os.urandom(16)
        sock.sendall(HELLO + nonce)
        reply = _recv_exact(sock, 48)
        mac, client_nonce = reply[:32], reply[32:]
        want = hmac.new(secret, b"client" + nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise WireError("peer failed authentication (wrong or missing job secret)")
        sock.sendall(hmac.new(secret, b"server" + client_nonce, hashlib.sha256).digest())
        ch = cls(sock, secret, nonce + client_nonce)
        ch.is_server = True
        return ch

    @classmethod
    def client(cls, host: str, port: int, secret: bytes, timeout: float = 10.0) -> Channel:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            hello = _recv_exact(sock, 20)
            if hello[:4] != HELLO:
                raise WireError(f"{host}:{port} is not a hotspare replica server")
            nonce = hello[4:]
            client_nonce = os.urandom(16)
            sock.sendall(hmac.new(secret, b"client" + nonce, hashlib.sha256).digest() + client_nonce)
            mac = _recv_exact(sock, 32)
            if not hmac.compare_digest(mac, hmac.new(secret, b"server" + client_nonce, hashlib.sha256).digest()):
                raise WireError(f"{host}:{port} failed authentication (not our job's server)")
        except BaseException:
            sock.close()
            raise
        return cls(sock, secret, nonce + client_nonce)

    # -- frames ---------------------------------------------------------------------------
    def _mac(self, direction: bytes, seq: int, header: bytes, body_len: int) -> bytes:
        msg = self.key + direction + struct.pack("<QQ", seq, body_len) + header
        return hmac.new(self.secret, msg, hashlib.sha256).digest()

    def _dir(self, sending: bool) -> bytes:
        return b"s2c" if self.is_server == sending else b"c2s"

    def send(self, header: dict[str, Any], body: bytes | memoryview = b"") -> None:
        hb = json.dumps(header, separators=(",", ":")).encode()
        mac = self._mac(self._dir(True), self.send_seq, hb, len(body))
        self.send_seq += 1
        self.sock.sendall(struct.pack(_HDR, MAGIC, len(hb), len(body), mac) + hb)
        if len(body):
            self.sock.sendall(body)

    def recv(self) -> tuple[dict[str, Any], bytes]:
        magic, hlen, blen, mac = struct.unpack(_HDR, _recv_exact(self.sock, HDR_SIZE))
        if magic != MAGIC:
            raise WireError(f"bad frame magic {magic!r}")
        if hlen > MAX_HEADER or blen > MAX_BODY:
            raise WireError(f"frame too large (header {hlen} B, body {blen} B)")
        hb = _recv_exact(self.sock, hlen)
        if not hmac.compare_digest(mac, self._mac(self._dir(False), self.recv_seq, hb, blen)):
            raise WireError("frame failed its HMAC (forged, replayed or corrupted header)")
        self.recv_seq += 1
        try:
            header = json.loads(hb)
        except ValueError as e:
            raise WireError(f"frame header is not JSON: {e}") from e
        if not isinstance(header, dict):
            raise WireError("frame header must be a JSON object")
        body = _recv_exact(self.sock, blen) if blen else b""
        return header, body

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- snapshot payloads ----------------------------------------------------------------------
def checksums(tensors: list[dict], data: bytes | memoryview) -> list[int]:
    mv = memoryview(data)
    return [zlib.crc32(mv[t["offset"] : t["offset"] + t["nbytes"]]) for t in tensors]


def validate_snapshot(header: dict, body: bytes) -> None:
    """Check a received snapshot's tensor table and per-tensor CRC32 against its body."""
    tensors = header.get("tensors")
    crcs = header.get("crc")
    if not isinstance(tensors, list) or not isinstance(crcs, list) or len(crcs) != len(tensors):
        raise WireError("snapshot header lacks a tensor table with one checksum per tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, dict):
            raise WireError(f"tensor entry {i} is not an object")
        name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
        off, nb = t.get("offset"), t.get("nbytes")
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in ELEM or not isinstance(shape, list):
            raise WireError(f"tensor entry {i} is malformed ({name!r}, {dtype!r})")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WireError(f"tensor {name}: bad shape {shape!r}")
        n = 1
        for d in shape:
            n *= d
        if not isinstance(off, int) or not isinstance(nb, int) or off < 0 or nb != n * ELEM[dtype]:
            raise WireError(f"tensor {name}: size {nb!r} does not match shape {shape} x {dtype}")
        if off % ELEM[dtype] or off + nb > len(body):
            raise WireError(f"tensor {name}: bytes [{off}, {off + nb}) outside the {len(body)}-byte body")
        if not isinstance(crcs[i], int):
            raise WireError(f"tensor {name}: checksum {crcs[i]!r} is not an integer")
        got = zlib.crc32(memoryview(body)[off : off + nb])
        if got != crcs[i]:
            raise WireError(f"tensor {name}: checksum mismatch (corrupt replica): {got:#x} != {crcs[i]:#x}")
