"""The replica wire protocol and the replica server over real loopback TCP (no etcd).

Snapshots are produced the way workers produce them (a SnapshotEngine writing slot files),
served by a ReplicaServer, pushed with ``put``, fetched with ``fetch``/``fetch_first``;
frames and handshakes are attacked directly over socket pairs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
import zlib
from pathlib import Path

import pytest
import torch

from hotspare.agents.node_view import NodeView
from hotspare.agents.replica import ReplicaServer, ReplicaStore, Replicator
from hotspare.recovery.replica_client import fetch, fetch_first, list_steps
from hotspare.recovery.snapshot import SnapshotEngine, tensors_from_bytes
from hotspare.recovery.state import provider_for
from hotspare.recovery.wire import (
    _FIXED,
    _HDR,
    CHUNK,
    HDR_SIZE,
    HELLO,
    MAGIC,
    MAX_BODY,
    MAX_HEADER,
    TAG_SIZE,
    Channel,
    WireError,
    checksums,
    validate_snapshot,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
HOST = "127.0.0.1"


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture
def serve():
    """serve(directory, secret=SECRET) -> a started ReplicaServer, stopped at teardown."""
    servers: list[ReplicaServer] = []

    def start(directory: Path, secret: bytes = SECRET) -> ReplicaServer:
        directory.mkdir(parents=True, exist_ok=True)
        srv = ReplicaServer(ReplicaStore(directory), secret).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture
def snap(tmp_path):
    """A rank-1 snapshot of step 5 written by a real SnapshotEngine into tmp_path."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()  # so that the optimizer has state (momentum buffers) to snapshot
    eng = SnapshotEngine(tmp_path, sid=1, replicate_every=0)
    eng.providers = provider_for("model", model) + provider_for("opt", opt)
    eng.capture(5)
    eng.wait()
    yield eng, model
    eng.close()


def _live(eng: SnapshotEngine) -> dict[str, torch.Tensor]:
    return {f"{n}/{k}": t for n, p in eng.providers for k, t in p.tensors().items()}


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


def _put(port: int, rank: int, header: dict, body: bytes, secret: bytes = SECRET) -> dict:
    ch = Channel.client(HOST, port, secret, timeout=10)
    try:
        ch.send({"op": "put", "rank": rank, "snapshot": header}, body)
        reply, _ = ch.recv()
    finally:
        ch.close()
    return reply


def _closed_port() -> int:
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    return port


# -- serving local slots -------------------------------------------------------------------------
def test_list_and_fetch_serve_a_worker_snapshot(snap, tmp_path, serve):
    eng, model = snap
    srv = serve(tmp_path)
    assert list_steps(HOST, srv.port, SECRET, sid=1) == [5]
    assert list_steps(HOST, srv.port, SECRET, sid=0) == []

    header, body = fetch(HOST, srv.port, SECRET, sid=1, step=5)
    validate_snapshot(header, body)
    assert header["step"] == 5 and header["rank"] == 1
    assert len(header["crc"]) == len(header["tensors"])
    got = tensors_from_bytes(header, body)
    live = _live(eng)
    assert set(got) == set(live) and "model.params/weight" in got
    for name, t in live.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert torch.equal(got["model.params/weight"], model.weight.detach())
    assert torch.equal(got["model.params/bias"], model.bias.detach())

    with pytest.raises(WireError, match="no snapshot of rank 1 at step 4"):
        fetch(HOST, srv.port, SECRET, sid=1, step=4)


# -- put ------------------------------------------------------------------------------------------
def test_put_keeps_a_replica_whose_checksums_are_checked_where_it_is_used(snap, tmp_path, serve):
    src = serve(tmp_path)
    header, body = fetch(HOST, src.port, SECRET, sid=1, step=5)
    dst_dir = tmp_path / "buddy"
    dst = serve(dst_dir)

    assert _put(dst.port, 3, header, body) == {"ok": True}
    assert (dst_dir / "replica-rank3-step5.bin").is_file()
    assert list_steps(HOST, dst.port, SECRET, sid=3) == [5]
    h3, b3 = fetch(HOST, dst.port, SECRET, sid=3, step=5)
    assert b3 == body and h3["rank"] == 3 and h3["crc"] == header["crc"]

    # same tensor table and checksums, one flipped byte in the first tensor's bytes: the MAC
    # passes (a job member sent it), the holder does not spend a pass over the bytes on the
    # CRC32s; the spare that fetches it checks them and never loads a byte of it
    off = header["tensors"][0]["offset"]
    ch = Channel.client(HOST, dst.port, SECRET, timeout=10)
    try:
        ch.send({"op": "put", "rank": 3, "snapshot": dict(header, step=6)}, _flip(body, off))
        assert ch.recv()[0] == {"ok": True}
        with pytest.raises(WireError, match="checksum mismatch"):
            fetch(HOST, dst.port, SECRET, sid=3, step=6)
        # a malformed table is refused at once, and the refusal does not cost the connection
        ch.send({"op": "put", "rank": 3, "snapshot": dict(header, step=7, crc=header["crc"][:-1])}, body)
        reply, _ = ch.recv()
        assert reply["ok"] is False and "one checksum per tensor" in reply["error"]
        ch.send({"op": "list", "rank": 3})
        assert ch.recv()[0] == {"ok": True, "steps": [5, 6], "timelines": {"5": 0, "6": 0}}  # one state per step (F20)
        ch.send({"op": "put", "rank": 3})
        reply, _ = ch.recv()
        assert reply["ok"] is False and "without a snapshot header" in reply["error"]
        ch.send({"op": "frobnicate"})
        assert "unknown op" in ch.recv()[0]["error"]
    finally:
        ch.close()
    assert not (dst_dir / "replica-rank3-step7.bin").exists()
    assert sorted(p.name for p in dst_dir.iterdir()) == ["replica-rank3-step5.bin", "replica-rank3-step6.bin"]


def test_put_keeps_only_the_newest_replicas_per_rank(snap, tmp_path, serve):
    src = serve(tmp_path)
    header, body = fetch(HOST, src.port, SECRET, sid=1, step=5)
    dst = serve(tmp_path / "buddy")
    for step in (5, 6, 7, 8, 9):
        assert _put(dst.port, 2, dict(header, step=step), body)["ok"]
    assert list_steps(HOST, dst.port, SECRET, sid=2) == [7, 8, 9]


# -- corrupt replicas ----------------------------------------------------------------------------
def test_corrupt_replica_is_rejected_and_fetch_first_falls_back(snap, tmp_path, serve):
    src = serve(tmp_path)
    header, body = fetch(HOST, src.port, SECRET, sid=1, step=5)
    good_dir, bad_dir = tmp_path / "good", tmp_path / "bad"
    good, bad = serve(good_dir), serve(bad_dir)
    assert _put(good.port, 3, header, body)["ok"] and _put(bad.port, 3, header, body)["ok"]

    f = bad_dir / "replica-rank3-step5.bin"
    raw = f.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    f.write_bytes(_flip(raw, 8 + hlen + header["tensors"][-1]["offset"]))
    assert list_steps(HOST, bad.port, SECRET, sid=3) == [5]  # it still claims to hold it

    with pytest.raises(WireError, match="checksum"):
        fetch(HOST, bad.port, SECRET, sid=3, step=5)

    h, b, name = fetch_first([("node-bad", HOST, bad.port), ("node-good", HOST, good.port)], SECRET, 3, 5)
    assert name == "node-good" and b == body and h["crc"] == header["crc"]

    with pytest.raises(RuntimeError) as e:
        fetch_first([("node-bad", HOST, bad.port), ("node-gone", HOST, _closed_port())], SECRET, 3, 5)
    msg = str(e.value)
    assert "node-bad" in msg and "node-gone" in msg and "checksum" in msg and "sid 3 at step 5" in msg


def test_fetch_first_skips_a_holder_with_an_unhashable_dtype(snap, tmp_path, serve):
    src = serve(tmp_path)
    header, body = fetch(HOST, src.port, SECRET, sid=1, step=5)

    class Rogue(ReplicaServer):
        def answer(self, req, data):
            bad = json.loads(json.dumps(header))
            bad["tensors"][0]["dtype"] = ["float32"]
            return {"ok": True, "snapshot": bad}, body

    rogue = Rogue(ReplicaStore(tmp_path), SECRET).start()
    try:
        h, b, name = fetch_first([("rogue", HOST, rogue.port), ("src", HOST, src.port)], SECRET, 1, 5)
        assert name == "src" and b == body
    finally:
        rogue.stop()


# -- authentication and strangers ---------------------------------------------------------------
def test_a_new_worker_of_a_rank_is_confirmed_its_own_points_never_its_predecessors(tmp_path, serve):
    """A rank's worker dies after point 15; a new worker of the same rank starts on the same
    node, restores step 5 and writes point 5 again. The agent must confirm the new write, not the dead worker's
    copy it still has on disk (that mix-up once held a worker at its replication gate for
    the whole replication timeout)."""
    buddy = serve(tmp_path / "buddy")
    node = tmp_path / "node"
    model = torch.nn.Linear(8, 4)
    rep = Replicator(ReplicaStore(node), SECRET,
                     view=lambda: NodeView(buddies=(("buddy", HOST, buddy.port),), seats={0: 0}))
    old = SnapshotEngine(node, sid=0, replicate_every=5, replication_timeout=3)
    old.providers = provider_for("model", model)
    for step in (-1, 5, 10, 15):
        old.capture(step)
        old.wait()
        rep.push_once()
    assert old.confirmed() == old._last_point  # the old worker's point 15 is replicated
    old.close()  # the worker dies; its slot files stay (peers may still restore from them)
    old_points = set(ReplicaStore(node).points(0))

    rep.forget(0)  # the agent hands rank 0 to a new worker here
    rep.push_once()  # a round before the new worker has written anything
    new = SnapshotEngine(node, sid=0, replicate_every=5, replication_timeout=3)
    new.providers = provider_for("model", model)
    assert new.confirmed()[0] == -2, "the dead worker's confirmation must not count for the new one"
    new.capture(5)  # rolled back to step 5: its own point 5, older than the dead worker's 15 (still on disk)
    new.wait()
    assert new._last_point not in old_points and new._last_point[0] == 5
    assert ReplicaStore(node).steps(0).get(15) == "point"  # still served to peers
    rep.push_once()
    assert new.confirmed() == new._last_point, "the new worker's point was never confirmed"
    assert ReplicaStore(tmp_path / "buddy").load(0, 5) is not None
    new.close()
    rep.stop()


def test_wrong_secret_is_refused_both_ways_and_the_server_keeps_serving(snap, tmp_path, serve):
    srv = serve(tmp_path)
    with pytest.raises(WireError):
        Channel.client(HOST, srv.port, b"t" * 32, timeout=10)
    with pytest.raises(WireError):
        list_steps(HOST, srv.port, b"", sid=1)
    with pytest.raises(WireError):  # a server of another job is refused by our client
        fetch(HOST, serve(tmp_path / "other", secret=b"o" * 32).port, SECRET, sid=1, step=5)
    assert list_steps(HOST, srv.port, SECRET, sid=1) == [5]


def test_client_refuses_something_that_is_not_a_replica_server():
    lst = socket.create_server((HOST, 0))
    port = lst.getsockname()[1]

    def impostor():
        conn, _ = lst.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nhello")
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(100)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(WireError, match="not a hotspare replica server"):
            Channel.client(HOST, port, SECRET, timeout=5)
    finally:
        t.join(10)
        lst.close()


def test_client_names_a_server_of_another_protocol_version():
    lst = socket.create_server((HOST, 0))

    def old_server():
        conn, _ = lst.accept()
        with conn:
            conn.sendall(b"HSP1" + os.urandom(16))  # hotspare before the frame MAC covered bodies
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(100)

    t = threading.Thread(target=old_server, daemon=True)
    t.start()
    try:
        with pytest.raises(WireError, match="speaks replica protocol HSP1, not HSP2"):
            Channel.client(HOST, lst.getsockname()[1], SECRET, timeout=5)
    finally:
        t.join(10)
        lst.close()


def _recv_n(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return got


def _stranger(port: int, payload: bytes) -> tuple[bytes, bytes]:
    """Connect without the secret, read the hello, send payload; return (hello, anything
    the server sent after it before closing)."""
    rest = b""
    with socket.create_connection((HOST, port), timeout=10) as s:
        hello = _recv_n(s, 20)
        with contextlib.suppress(OSError):
            s.sendall(payload)
        while True:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                break
            if not chunk:
                break
            rest += chunk
    return hello, rest


@pytest.mark.parametrize(
    "payload",
    [
        os.urandom(256),
        os.urandom(48),
        struct.pack(_HDR, MAGIC, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF, b"\0" * 32),  # huge lengths
        struct.pack(_HDR, MAGIC, 2, 0, b"\0" * 32) + b"{}",
    ],
    ids=["random-256", "random-48", "huge-length-header", "unauthenticated-frame"],
)
def test_strangers_are_refused_before_any_frame_and_do_not_hurt_the_server(snap, tmp_path, serve, payload):
    srv = serve(tmp_path)
    hello, rest = _stranger(srv.port, payload)
    assert hello[:4] == HELLO == b"HSP2" and len(hello) == 20
    assert rest == b"", "the server said more than its hello to a stranger"
    assert list_steps(HOST, srv.port, SECRET, sid=1) == [5]


def test_connect_and_close_and_idle_strangers_do_not_block_the_server(snap, tmp_path, serve):
    srv = serve(tmp_path)
    for _ in range(3):
        socket.create_connection((HOST, srv.port), timeout=10).close()
    assert list_steps(HOST, srv.port, SECRET, sid=1) == [5]
    idle = socket.create_connection((HOST, srv.port), timeout=10)
    try:
        idle.sendall(b"\x00" * 10)  # half a handshake, then silence
        assert list_steps(HOST, srv.port, SECRET, sid=1) == [5]
        assert fetch(HOST, srv.port, SECRET, sid=1, step=5)[0]["step"] == 5
    finally:
        idle.close()


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack(_HDR, MAGIC, MAX_HEADER + 1, 0, b"\0" * 32),
        struct.pack(_HDR, MAGIC, 2, MAX_BODY + 1, b"\0" * 32),
        struct.pack(_HDR, b"HTTP", 2, 0, b"\0" * 32),
        struct.pack(_HDR, MAGIC, 2, 0, b"\0" * 32) + b"{}",  # forged HMAC
    ],
    ids=["huge-header", "huge-body", "bad-magic", "forged-hmac"],
)
def test_authenticated_peer_sending_a_bad_frame_is_dropped(snap, tmp_path, serve, frame):
    srv = serve(tmp_path)
    ch = Channel.client(HOST, srv.port, SECRET, timeout=10)
    try:
        ch.sock.sendall(frame)
        with pytest.raises(WireError, match="closed"):
            ch.recv()
    finally:
        ch.close()
    assert list_steps(HOST, srv.port, SECRET, sid=1) == [5]


# -- frames over socket pairs -------------------------------------------------------------------------
class Tape:
    """A socket stand-in that records what a Channel sends."""

    def __init__(self) -> None:
        self.data = b""

    def sendall(self, b) -> None:
        self.data += bytes(b)


@pytest.fixture
def pair():
    """(server side, client side) Channels over a socketpair sharing one connection key."""
    made: list[socket.socket] = []

    def make(key: bytes = b"k" * 32, secret: bytes = SECRET, client_secret: bytes | None = None):
        a, b = socket.socketpair()
        for s in (a, b):
            s.settimeout(5)
            made.append(s)
        srv = Channel(a, secret, key)
        srv.is_server = True
        cli = Channel(b, client_secret or secret, key)
        return srv, cli

    yield make
    for s in made:
        s.close()


def _recorded(header: dict, body: bytes = b"", *, server: bool, key: bytes = b"k" * 32,
              secret: bytes = SECRET, seq: int = 0) -> bytes:
    tape = Tape()
    ch = Channel(tape, secret, key)  # type: ignore[arg-type]
    ch.is_server = server
    ch.send_seq = seq
    ch.send(header, body)
    return tape.data


def test_frames_round_trip_both_ways(pair):
    srv, cli = pair()
    cli.send({"op": "put", "n": [1, 2]}, b"\x00\x01body")
    cli.send({"op": "list"})
    assert srv.recv() == ({"op": "put", "n": [1, 2]}, b"\x00\x01body")
    assert srv.recv() == ({"op": "list"}, b"")
    srv.send({"ok": True}, memoryview(b"xyz"))
    assert cli.recv() == ({"ok": True}, b"xyz")
    assert (cli.send_seq, srv.recv_seq, srv.send_seq, cli.recv_seq) == (2, 2, 1, 1)


def test_recv_rejects_bad_magic(pair):
    srv, cli = pair()
    good = _recorded({"op": "list"}, server=False)
    cli.sock.sendall(b"XXXX" + good[4:])
    with pytest.raises(WireError, match="bad frame magic"):
        srv.recv()


@pytest.mark.parametrize(("hlen", "blen"), [(MAX_HEADER + 1, 0), (2, MAX_BODY + 1), (0xFFFFFFFF, 1 << 63)])
def test_recv_rejects_oversized_lengths_before_reading_them(pair, hlen, blen):
    srv, cli = pair()
    cli.sock.sendall(struct.pack(_HDR, MAGIC, hlen, blen, b"\0" * 32))
    with pytest.raises(WireError, match="too large"):
        srv.recv()


def test_recv_rejects_a_frame_keyed_with_another_secret(pair):
    srv, cli = pair(client_secret=b"x" * 32)
    cli.send({"op": "list"})
    with pytest.raises(WireError, match="HMAC"):
        srv.recv()


def test_recv_rejects_a_frame_from_another_connection(pair):
    srv, cli = pair(key=b"A" * 32)
    cli.sock.sendall(_recorded({"op": "list"}, server=False, key=b"B" * 32))
    with pytest.raises(WireError, match="HMAC"):
        srv.recv()


@pytest.mark.parametrize("where", ["header-json", "body-length", "hmac"])
def test_recv_rejects_a_tampered_frame(pair, where):
    srv, cli = pair()
    raw = bytearray(_recorded({"op": "get", "rank": 1, "step": 5}, b"abcd", server=False))
    at = {"header-json": HDR_SIZE + 10, "body-length": 8, "hmac": 20}[where]
    raw[at] ^= 0x01
    cli.sock.sendall(bytes(raw))
    with pytest.raises(WireError, match="HMAC"):
        srv.recv()


@pytest.mark.parametrize("where", ["first", "last"])
def test_recv_rejects_a_frame_whose_body_was_changed(pair, where):
    """Every byte of the body is under the MAC, not only its length (finding F3)."""
    srv, cli = pair()
    raw = bytearray(_recorded({"op": "put", "rank": 1}, b"body bytes", server=False))
    hlen = struct.unpack(_HDR, raw[:HDR_SIZE])[1]
    raw[HDR_SIZE + hlen + (0 if where == "first" else 9)] ^= 0x01
    cli.sock.sendall(bytes(raw))
    with pytest.raises(WireError, match="HMAC.*body"):
        srv.recv()


def test_a_large_body_arrives_in_pieces_and_a_byte_changed_in_any_of_them_fails(pair):
    body = os.urandom(2 * CHUNK + 12345)  # three pieces, hashed by the second thread
    srv, cli = pair()
    t = threading.Thread(target=cli.send, args=({"op": "put"}, memoryview(body)), daemon=True)
    t.start()
    assert srv.recv() == ({"op": "put"}, body)
    t.join(10)
    raw = _recorded({"op": "put"}, body, server=False)
    assert len(raw) == HDR_SIZE + len(b'{"op":"put"}') + len(body) + TAG_SIZE
    for at in (0, CHUNK - 1, CHUNK + 7, len(body) - 1):
        srv, cli = pair()
        bad = bytearray(raw)
        bad[HDR_SIZE + len(b'{"op":"put"}') + at] ^= 0x80
        t = threading.Thread(target=cli.sock.sendall, args=(bytes(bad),), daemon=True)
        t.start()
        with pytest.raises(WireError, match="HMAC over the body"):
            srv.recv()
        t.join(10)


def test_a_replayed_frame_fails_because_the_sequence_advanced(pair):
    srv, cli = pair()
    raw = _recorded({"op": "put", "rank": 1}, b"data", server=False)
    cli.sock.sendall(raw)
    assert srv.recv() == ({"op": "put", "rank": 1}, b"data")
    cli.sock.sendall(raw)
    with pytest.raises(WireError, match="HMAC"):
        srv.recv()


def test_a_reflected_frame_fails_because_direction_is_bound(pair):
    srv, cli = pair()
    raw = _recorded({"ok": True}, server=True)  # what the server would send at seq 0
    cli.sock.sendall(raw)  # bounced back to the server as if the client sent it
    with pytest.raises(WireError, match="HMAC"):
        srv.recv()
    srv2, cli2 = pair()
    srv2.sock.sendall(_recorded({"op": "list"}, server=False))  # and the other way round
    with pytest.raises(WireError, match="HMAC"):
        cli2.recv()


@pytest.mark.parametrize(("hb", "what"), [(b"[1,2]", "JSON object"), (b"{nope", "not JSON")])
def test_recv_rejects_an_authentic_header_that_is_not_a_json_object(pair, hb, what):
    srv, cli = pair()
    fixed = struct.pack(_FIXED, MAGIC, len(hb), 0)
    mac, _ = cli._macs(True, 0, fixed, hb)
    cli.sock.sendall(fixed + mac + hb)
    with pytest.raises(WireError, match=what):
        srv.recv()


@pytest.mark.parametrize("cut", [3, TAG_SIZE + 3], ids=["in-the-tag", "in-the-body"])
def test_recv_reports_a_peer_that_closes_mid_frame(pair, cut):
    srv, cli = pair()
    raw = _recorded({"op": "put"}, b"0123456789", server=False)
    cli.sock.sendall(raw[:-cut])
    cli.sock.close()
    with pytest.raises(WireError, match="closed"):
        srv.recv()


def _handshake(server_secret: bytes, client_secret: bytes):
    """Channel.server on an accepted TCP connection in a thread, Channel.client here."""
    lst = socket.create_server((HOST, 0))
    out: dict = {}

    def accept():
        conn, _ = lst.accept()
        try:
            out["server"] = Channel.server(conn, server_secret, timeout=5)
        except (WireError, OSError) as e:
            out["error"] = e
            conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        try:
            cli = Channel.client(HOST, lst.getsockname()[1], client_secret, timeout=5)
        except WireError as e:
            cli = e
        t.join(10)
    finally:
        lst.close()
    return out, cli


def test_handshake_agrees_on_a_fresh_key_per_connection():
    out, cli = _handshake(SECRET, SECRET)
    srv = out["server"]
    try:
        assert srv.is_server and not cli.is_server
        assert srv.key == cli.key and len(srv.key) == 32
        cli.send({"op": "list", "rank": 0})
        assert srv.recv() == ({"op": "list", "rank": 0}, b"")
        srv.send({"ok": True}, b"z")
        assert cli.recv() == ({"ok": True}, b"z")
        out2, cli2 = _handshake(SECRET, SECRET)
        assert cli2.key != cli.key
        # a frame recorded on the first connection does not pass on the second
        cli2.sock.sendall(_recorded({"op": "list"}, server=False, key=cli.key, seq=0))
        with pytest.raises(WireError, match="HMAC"):
            out2["server"].recv()
        cli2.close()
        out2["server"].close()
    finally:
        cli.close()
        srv.close()


def test_handshake_with_the_wrong_secret_fails_on_both_sides():
    out, cli = _handshake(SECRET, b"t" * 32)
    assert isinstance(cli, WireError)
    assert isinstance(out.get("error"), WireError) and "authentication" in str(out["error"])


# -- validate_snapshot -------------------------------------------------------------------------------
def _snapshot() -> tuple[dict, bytes]:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([7, 8, 9, 10], dtype=torch.int64)
    body = a.numpy().tobytes() + b"\0" * 40 + b.numpy().tobytes()
    tensors = [
        {"name": "m/a", "dtype": "float32", "shape": [2, 3], "offset": 0, "nbytes": 24},
        {"name": "m/b", "dtype": "int64", "shape": [4], "offset": 64, "nbytes": 32},
    ]
    return {"step": 1, "tensors": tensors, "crc": checksums(tensors, body)}, body


def test_validate_snapshot_accepts_a_good_one_and_its_tensors_decode():
    header, body = _snapshot()
    validate_snapshot(header, body)
    got = tensors_from_bytes(header, body)
    assert torch.equal(got["m/b"], torch.tensor([7, 8, 9, 10]))
    validate_snapshot({"tensors": [], "crc": []}, b"")
    # the padding between tensors is not covered (nothing reads it)
    validate_snapshot(header, _flip(body, 30))


def _mutate(fn):
    header, body = _snapshot()
    header = json.loads(json.dumps(header))
    changed = fn(header, body)
    return header, changed if isinstance(changed, bytes) else body


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (lambda h, b: h.pop("crc"), "one checksum per tensor"),
        (lambda h, b: h.update(crc=None), "one checksum per tensor"),
        (lambda h, b: h["crc"].pop(), "one checksum per tensor"),
        (lambda h, b: h["crc"].append(0), "one checksum per tensor"),
        (lambda h, b: h.pop("tensors"), "tensor table"),
        (lambda h, b: h["tensors"].__setitem__(0, "m/a"), "entry 0 is not an object"),
        (lambda h, b: h["tensors"][1].update(dtype="complex64"), "entry 1 is malformed"),
        (lambda h, b: h["tensors"][0].update(dtype=None), "entry 0 is malformed"),
        (lambda h, b: h["tensors"][0].pop("name"), "entry 0 is malformed"),
        (lambda h, b: h["tensors"][0].update(shape=[2, -3]), "bad shape"),
        (lambda h, b: h["tensors"][0].update(shape="2x3"), "entry 0 is malformed"),
        (lambda h, b: h["tensors"][0].update(nbytes=20), "does not match shape"),
        (lambda h, b: h["tensors"][1].update(shape=[5]), "does not match shape"),
        (lambda h, b: h["tensors"][1].update(dtype="int32"), "does not match shape"),
        (lambda h, b: h["tensors"][0].update(offset=-8), "does not match shape"),
        (lambda h, b: h["tensors"][1].update(offset=96), "outside the 96-byte body"),
        (lambda h, b: h["tensors"][1].update(offset=1 << 40), "outside"),
        (lambda h, b: b[:-1], "outside the 95-byte body"),
        (lambda h, b: h["tensors"][0].update(offset=2), "outside"),  # misaligned
        (lambda h, b: h["crc"].__setitem__(1, str(h["crc"][1])), "is not an integer"),
        (lambda h, b: h["crc"].__setitem__(0, float(h["crc"][0])), "is not an integer"),
        (lambda h, b: h["crc"].__setitem__(0, h["crc"][0] ^ 1), "m/a: checksum mismatch"),
        (lambda h, b: _flip(b, 64 + 31), "m/b: checksum mismatch"),
    ],
)
def test_validate_snapshot_rejects_with_a_clear_message(mutation, message):
    header, body = _mutate(mutation)
    with pytest.raises(WireError) as e:
        validate_snapshot(header, body)
    assert message in str(e.value)


# -- F3: a man in the middle without the secret cannot change a frame's body -----------------------
def _forge_crc32(data: bytearray, at: int, want: int) -> None:
    """Change ``data[at:at + 4]`` so that ``zlib.crc32(data) == want``: what an attacker does.
    CRC32 is affine in the message (crc(x ^ d) = crc(x) ^ crc(d) ^ crc(0...0) at one length), so
    the 32 bits of 4 bytes can be solved for any CRC over GF(2); no secret needed."""
    n, zero = len(data), zlib.crc32(bytes(len(data)))
    basis: list[tuple[int, int]] = []  # (CRC difference, which of the 32 bits give it)
    for bit in range(32):
        d = bytearray(n)
        d[at + bit // 8] = 1 << (bit % 8)
        v, m = zlib.crc32(d) ^ zero, 1 << bit
        for bv, bm in basis:
            if v ^ bv < v:
                v, m = v ^ bv, m ^ bm
        if v:
            basis = sorted([*basis, (v, m)], reverse=True)
    v, m = zlib.crc32(data) ^ want, 0
    for bv, bm in basis:
        if v ^ bv < v:
            v, m = v ^ bv, m ^ bm
    assert v == 0, "these 4 bytes cannot reach every CRC"
    for bit in range(32):
        if m >> bit & 1:
            data[at + bit // 8] ^= 1 << (bit % 8)


def _poison_weight(snapshot: dict, body: bytearray) -> None:
    """weight[0] 0.5 -> 1e9, and the tensor's CRC32 kept right through its last 4 bytes."""
    i = next(i for i, t in enumerate(snapshot["tensors"]) if t["name"] == "model.params/weight")
    off, nb = snapshot["tensors"][i]["offset"], snapshot["tensors"][i]["nbytes"]
    assert struct.unpack_from("<f", body, off)[0] == 0.5
    struct.pack_into("<f", body, off, 1e9)
    tensor = bytearray(body[off : off + nb])
    _forge_crc32(tensor, nb - 4, snapshot["crc"][i])
    body[off : off + nb] = tensor
    validate_snapshot(snapshot, bytes(body))  # the CRC32s alone are fooled


class TamperingProxy:
    """A loopback man in the middle without the job secret, between a client and a server.

    It relays the handshake and every byte unchanged, except the body of the first frame that
    carries a snapshot in ``direction`` (``"c2s"``: a put, ``"s2c"``: a get's reply), which
    ``tamper(snapshot_header, body)`` rewrites in place before it is passed on."""

    def __init__(self, port: int, direction: str, tamper) -> None:
        self.target, self.direction, self.tamper = port, direction, tamper
        self.tampered = 0  # frames rewritten
        self.errors: list[BaseException] = []
        self.lst = socket.create_server((HOST, 0))
        self.port = self.lst.getsockname()[1]
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self) -> None:
        try:
            down, _ = self.lst.accept()
            up = socket.create_connection((HOST, self.target), timeout=10)
            down.settimeout(10)
            for src, dst, n in ((up, down, 20), (down, up, 48), (up, down, 32)):  # the handshake
                dst.sendall(_recv_n(src, n))
            for src, dst, d in ((down, up, "c2s"), (up, down, "s2c")):
                t = threading.Thread(target=self._pump, args=(src, dst, d == self.direction), daemon=True)
                t.start()
                self.threads.append(t)
        except OSError as e:
            self.errors.append(e)

    def _pump(self, src: socket.socket, dst: socket.socket, attack: bool) -> None:
        try:
            while attack:
                prefix = _recv_n(src, HDR_SIZE)
                if len(prefix) < HDR_SIZE:
                    break
                _, hlen, blen, _ = struct.unpack(_HDR, prefix)
                hb = _recv_n(src, hlen)
                body = bytearray(_recv_n(src, blen))
                snapshot = json.loads(hb).get("snapshot")
                if isinstance(snapshot, dict) and blen:
                    self.tamper(snapshot, body)
                    self.tampered += 1
                    attack = False  # the rest (a trailing tag, if any, and later frames) unchanged
                dst.sendall(prefix + hb + bytes(body))
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        except (OSError, AssertionError, ValueError) as e:
            self.errors.append(e)
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.lst.close()
        for t in self.threads:
            t.join(10)


@pytest.fixture
def poisonable(tmp_path):
    """A sid-1 step-5 snapshot by a real SnapshotEngine whose model.params/weight[0] is 0.5."""
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.view(-1)[0] = 0.5
    eng = SnapshotEngine(tmp_path / "node", sid=1, replicate_every=0)
    eng.providers = provider_for("model", model)
    eng.capture(5)
    eng.wait()
    yield tmp_path / "node"
    eng.close()


def test_a_man_in_the_middle_cannot_poison_a_fetched_replica(poisonable, serve):
    """Finding F3: the frame MAC must cover the body, not only its length (the CRC32s are forgeable)."""
    srv = serve(poisonable)
    proxy = TamperingProxy(srv.port, "s2c", _poison_weight)
    try:
        with pytest.raises(WireError, match="HMAC") as e:
            got = fetch(HOST, proxy.port, SECRET, sid=1, step=5)
            pytest.fail(f"a tampered replica was accepted, weight[0] = {struct.unpack_from('<f', got[1])[0]}")
        assert "body" in str(e.value)
    finally:
        proxy.close()
    assert proxy.tampered == 1 and not proxy.errors, proxy.errors
    header, body = fetch(HOST, srv.port, SECRET, sid=1, step=5)  # the holder's copy is still good
    assert tensors_from_bytes(header, body)["model.params/weight"].view(-1)[0].item() == 0.5


def test_a_man_in_the_middle_cannot_plant_a_poisoned_replica(poisonable, serve, caplog):
    src = serve(poisonable)
    header, body = fetch(HOST, src.port, SECRET, sid=1, step=5)
    dst_dir = poisonable.parent / "buddy"
    dst = serve(dst_dir)
    proxy = TamperingProxy(dst.port, "c2s", _poison_weight)
    try:
        with caplog.at_level(logging.WARNING, logger="hotspare.replica"):
            with pytest.raises(WireError):  # the server drops the connection without a reply
                reply = _put(proxy.port, 3, header, body)
                pytest.fail(f"a tampered put was answered: {reply}")
    finally:
        proxy.close()
    assert proxy.tampered == 1 and not proxy.errors, proxy.errors
    assert any("failed its HMAC" in r.getMessage() and "body" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    assert list(dst_dir.iterdir()) == [], "something of the tampered put was stored"
    assert list_steps(HOST, dst.port, SECRET, sid=3) == []


def test_a_man_in_the_middle_cannot_change_bytes_outside_every_tensor(tmp_path, serve):
    """Bytes no CRC32 covers (here the padding between two tensors) are under the MAC too."""
    header, body = _snapshot()  # 40 bytes between its two tensors
    dst_dir = tmp_path / "buddy"
    dst = serve(dst_dir)

    def flip_padding(snapshot: dict, body: bytearray) -> None:
        body[30] ^= 0xFF
        validate_snapshot(snapshot, bytes(body))  # the CRC32s cannot see it

    proxy = TamperingProxy(dst.port, "c2s", flip_padding)
    try:
        with pytest.raises(WireError):
            reply = _put(proxy.port, 2, header, body)
            pytest.fail(f"a tampered put was answered: {reply}")
    finally:
        proxy.close()
    assert proxy.tampered == 1 and not proxy.errors, proxy.errors
    assert list(dst_dir.iterdir()) == []
