"""Replicas streamed, never held whole twice (issue 14 item 4), over real loopback TCP.

A body larger than many receive pieces goes straight into its destination; a put goes straight
into a replica file and a cut or tampered one leaves nothing behind; a replica or a slot is
served from its file a piece at a time, and a slot rewritten while it is sent never arrives; a
spare's fetch lands in its own snapshot slot and restores from there; a full ``/dev/shm`` on the
receiving agent is an answer naming the sizes, not a dropped connection.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from hotspare.agents.replica import ReplicaServer, ReplicaStore
from hotspare.recovery.replica_client import fetch, fetch_first, list_steps
from hotspare.recovery.restore import PeerReplicas
from hotspare.recovery.slotfile import COMPLETE, EMPTY, read_slot, slot_ctrl
from hotspare.recovery.snapshot import SnapshotEngine
from hotspare.recovery.state import provider_for
from hotspare.recovery.wire import (
    CHUNK,
    Channel,
    FileBody,
    Growing,
    IntoBuffer,
    WireError,
    checksums,
)
from hotspare.recovery.wire_body import FILE_PIECE

pytestmark = pytest.mark.timeout(120)

SECRET = b"s" * 32
HOST = "127.0.0.1"


@pytest.fixture
def pair():
    """(server side, client side) Channels over a socketpair sharing one connection key."""
    made: list[socket.socket] = []

    def make():
        a, b = socket.socketpair()
        for s in (a, b):
            s.settimeout(20)
            made.append(s)
        srv, cli = Channel(a, SECRET, b"k" * 32), Channel(b, SECRET, b"k" * 32)
        srv.is_server = True
        return srv, cli

    yield make
    for s in made:
        s.close()


@pytest.fixture
def serve():
    servers: list[ReplicaServer] = []

    def start(directory: Path) -> ReplicaServer:
        directory.mkdir(parents=True, exist_ok=True)
        servers.append(ReplicaServer(ReplicaStore(directory), SECRET).start())
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(700, 1000), torch.nn.Linear(1000, 1500))  # ~8.8 MB: > 2 pieces


def _source(directory: Path, step: int = 10) -> tuple[SnapshotEngine, torch.nn.Module]:
    model = _model(1)
    eng = SnapshotEngine(directory, sid=3, replicate_every=0)
    eng.providers = provider_for("model", model)
    eng.lineage = {"timeline": 4, "world_rank": 3, "world_size": 4}
    eng.capture(step)
    eng.wait()
    return eng, model


def _frame(header: dict, body, *, key: bytes, server: bool = False, seq: int = 0) -> bytes:
    """The bytes a Channel of connection ``key`` sends for one frame."""
    tape: list[bytes] = []

    class Tape:
        def sendall(self, b) -> None:
            tape.append(bytes(b))

    ch = Channel(Tape(), SECRET, key)  # type: ignore[arg-type]
    ch.is_server, ch.send_seq = server, seq
    ch.send(header, body)
    return b"".join(tape)


def _send_in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


# -- receiving ------------------------------------------------------------------------------------
def test_a_body_of_many_pieces_lands_straight_in_its_destination(pair):
    body = os.urandom(3 * CHUNK + 12345)
    srv, cli = pair()
    dest = memoryview(bytearray(len(body)))
    seen: list[tuple[int, int]] = []
    t = _send_in_thread(cli.send, {"op": "put"}, memoryview(body))
    header, got = srv.recv(into=lambda h, n: IntoBuffer(dest, observe=lambda pos, v: seen.append((pos, len(v)))))
    t.join(20)
    assert header == {"op": "put"} and got is dest and bytes(dest) == body
    assert seen == [(i * CHUNK, min(CHUNK, len(body) - i * CHUNK)) for i in range(4)], "pieces in order, once each"


def test_a_stream_cut_midway_is_a_clear_error_and_the_sink_is_aborted(pair):
    body = os.urandom(2 * CHUNK + 99)
    srv, cli = pair()
    aborted: list[bool] = []

    class Recording(Growing):
        def abort(self) -> None:
            aborted.append(True)

    raw = _frame({"op": "put"}, body, key=b"k" * 32)
    cut = len(raw) - len(body) - 32 + CHUNK + 5  # the head and CHUNK + 5 bytes of the body
    t = _send_in_thread(lambda: (cli.sock.sendall(raw[:cut]), cli.sock.close()))
    with pytest.raises(WireError, match=rf"peer closed the connection \({CHUNK + 5} of {len(body)} bytes read\)"):
        srv.recv(into=lambda h, n: Recording(n))
    t.join(20)
    assert aborted == [True]


def _stored(node_dir):
    """A source holding sid 3's step 10, with that replica's header and bytes."""
    src, _ = _source(node_dir)
    header, body = ReplicaStore(node_dir).load(3, 10)
    with body:
        data = bytearray(len(body))
        body.read_into(0, memoryview(data))
    return src, header, data


# -- put: straight into a replica file ---------------------------------------------------------------
def test_a_put_goes_to_a_file_as_it_arrives_and_a_cut_put_leaves_nothing(tmp_path, serve):
    src, header, data = _stored(tmp_path / "node")
    dst_dir = tmp_path / "buddy"
    dst = serve(dst_dir)
    ch = Channel.client(HOST, dst.port, SECRET, timeout=20)
    try:
        ch.send({"op": "put", "rank": 5, "snapshot": header}, data)
        assert ch.recv()[0] == {"ok": True}
    finally:
        ch.close()
    h5, b5 = fetch(HOST, dst.port, SECRET, sid=5, step=10)
    assert b5 == data and h5["crc"] == header["crc"] and h5["rank"] == 5

    # the same put, cut after half its body: the server drops it and nothing of it stays
    ch = Channel.client(HOST, dst.port, SECRET, timeout=20)
    raw = _frame({"op": "put", "rank": 5, "snapshot": dict(header, step=11)}, data, key=ch.key)
    ch.sock.sendall(raw[: len(raw) - len(data) // 2])
    ch.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.name.startswith(".tmp") for p in dst_dir.iterdir()):
        time.sleep(0.05)  # the server's thread notices the cut and cleans up
    assert sorted(p.name for p in dst_dir.iterdir()) == ["replica-rank5-step10.bin"]
    assert list_steps(HOST, dst.port, SECRET, sid=5) == [10]
    src.close()


def test_a_full_shm_on_the_receiving_agent_is_an_answer_naming_the_sizes(tmp_path, serve, monkeypatch):
    src, header, data = _stored(tmp_path / "node")
    dst_dir = tmp_path / "buddy"
    dst = serve(dst_dir)

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)  # what a full tmpfs answers
    ch = Channel.client(HOST, dst.port, SECRET, timeout=20)
    try:
        ch.send({"op": "put", "rank": 5, "snapshot": header}, data)
        reply, _ = ch.recv()
        assert reply["ok"] is False
        assert reply["error"].startswith(f"no space left in {dst_dir} for the replica of sid 5 step 10 of "), reply
        assert "give /dev/shm more room" in reply["error"]
        ch.send({"op": "list", "rank": 5})  # the connection is still good
        assert ch.recv()[0] == {"ok": True, "steps": [], "timelines": {}}
    finally:
        ch.close()
    assert list(dst_dir.iterdir()) == [], "a half-written replica was left"
    src.close()


# -- serving from files ----------------------------------------------------------------------------
def test_replicas_and_slots_are_served_from_their_files_in_pieces(tmp_path, serve):
    src, model = _source(tmp_path / "node")
    store = ReplicaStore(tmp_path / "node")
    header, body = store.load(3, 10)
    assert isinstance(body, FileBody) and len(body) > 2 * FILE_PIECE
    with body:
        data = bytearray(len(body))
        body.read_into(0, memoryview(data))
    assert header["crc"] == checksums(header["tensors"], data)
    assert bytes(data) == bytes(read_slot(src.path(src._steps.index(10)))[1])
    store.save(dict(header, rank=7), data)
    h7, b7 = store.load(7, 10)
    with b7:
        assert isinstance(b7, FileBody) and len(b7) == len(data) and h7["crc"] == header["crc"]
    srv = serve(tmp_path / "node")
    for sid in (3, 7):
        got_h, got = fetch(HOST, srv.port, SECRET, sid=sid, step=10)
        assert bytes(got) == bytes(data) and got_h["crc"] == header["crc"], sid
    src.close()


def test_a_slot_rewritten_while_it_is_sent_never_arrives(tmp_path, pair):
    src, model = _source(tmp_path / "node", step=10)
    header, body = ReplicaStore(tmp_path / "node").load(3, 10)
    for step in (11, 12):  # the ring's two slots: 12 is written over 10's slot
        src.capture(step)
        src.wait()
    srv, cli = pair()
    out: dict = {}

    def receive() -> None:
        try:
            cli.recv()
        except WireError as e:
            out["error"] = e

    t = _send_in_thread(receive)
    with body, pytest.raises(WireError, match="rewritten while it was sent"):
        srv.send({"ok": True, "snapshot": header}, body)
    srv.sock.close()  # what the server's handler does
    t.join(20)
    assert "closed" in str(out.get("error")), out
    src.close()


# -- a spare's fetch: straight into its own slot ------------------------------------------------------
def _spare(directory: Path) -> tuple[SnapshotEngine, torch.nn.Module, PeerReplicas]:
    model = _model(2)
    eng = SnapshotEngine(directory, sid=3, replicate_every=10, replication_timeout=5)
    eng.providers = provider_for("model", model)
    eng.lineage = {"timeline": 7, "world_rank": 1, "world_size": 2}
    peers = PeerReplicas(None, 3, eng)  # type: ignore[arg-type] - no etcd: the holders are given
    peers._secret = SECRET
    return eng, model, peers


def test_a_spare_restores_from_the_slot_its_fetch_landed_in(tmp_path, serve):
    src, model = _source(tmp_path / "node")
    holder = serve(tmp_path / "node")
    eng, mine, peers = _spare(tmp_path / "spare")
    peers._holders = {10: [("node", HOST, holder.port)]}
    got = peers.load(10)
    assert (got.step, got.source) == (10, "replica on node")
    for a, b in zip(model.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)
    assert eng.available() == [10]
    h, data, _ = read_slot(eng.path(eng._steps.index(10)))
    assert bytes(data) == bytes(read_slot(src.path(src._steps.index(10)))[1]) and got.nbytes == len(data)
    assert (h["rank"], h["step"], h["timeline"], h["world_rank"], h["world_size"]) == (3, 10, 4, 1, 2)
    assert eng.path(eng._steps.index(10)).name == "rank3.point0", "a replication point: pushed on to buddies"
    assert ReplicaStore(tmp_path / "spare").points(3) == [(10, eng._last_point[1])]
    eng.close()
    src.close()


def test_a_fetch_that_fails_midway_falls_back_and_leaves_no_snapshot_behind(tmp_path, serve):
    src, model = _source(tmp_path / "node")
    good = serve(tmp_path / "node")
    lst = socket.create_server((HOST, 0))

    def half_a_replica() -> None:  # a holder that dies after half the body
        conn, _ = lst.accept()
        with conn:
            ch = Channel.server(conn, SECRET, timeout=20)
            req, _ = ch.recv()
            header, body = ReplicaStore(tmp_path / "node").load(req["rank"], req["step"])
            with body:
                raw = _frame({"ok": True, "snapshot": header}, body, key=ch.key, server=True, seq=ch.send_seq)
            conn.sendall(raw[: len(raw) // 2])

    eng, mine, peers = _spare(tmp_path / "spare")
    for holders in ([("dying", HOST, lst.getsockname()[1])], [("dying", HOST, lst.getsockname()[1]),
                                                               ("node", HOST, good.port)]):
        t = _send_in_thread(half_a_replica)
        peers._holders = {10: holders}
        if len(holders) == 1:
            with pytest.raises(RuntimeError, match=r"no usable replica of sid 3 at step 10: dying: peer closed"):
                peers.load(10)
            assert eng.available() == [] and slot_ctrl(eng.path(eng.nring))[0] == EMPTY, "a torn snapshot"
            assert not torch.equal(next(mine.parameters()), next(model.parameters())), "restored from a torn body"
        else:
            assert peers.load(10).source == "replica on node"
            assert eng.available() == [10] and slot_ctrl(eng.path(eng.nring))[0] == COMPLETE
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), mine.parameters(), strict=True))
        t.join(20)
    lst.close()
    eng.close()
    src.close()


def test_fetch_first_into_a_buffer_checks_the_table_before_a_byte_arrives(tmp_path, serve):
    src, _ = _source(tmp_path / "node")
    holder = serve(tmp_path / "node")
    asked: list[int] = []

    def into(header: dict, n: int) -> memoryview:
        asked.append(n)
        return memoryview(bytearray(n))

    h, body, name = fetch_first([("node", HOST, holder.port)], SECRET, 3, 10, into=into)
    assert name == "node" and asked == [len(body)] and h["data_len"] == len(body)
    src.close()


def test_a_spare_whose_node_cannot_hold_the_state_ends_the_job_instead_of_agreeing_again(tmp_path, serve):
    """The spare's node has no room for the state (ShmTooSmall from its first slot): that is the
    job's end with the sentence, not a failed load to agree again without (which would end in
    'no common snapshot' or, with a persisted tier, a rollback that fails the same way)."""
    from hotspare.recovery.errors import ShmTooSmall
    from hotspare.recovery.restore import LocalSlots, Membership, PersistentTier, RestoreAgreement
    from tests.unit.test_restore import _LOADED, ScriptedGroup, _head, _mask

    src, _ = _source(tmp_path / "node")
    holder = serve(tmp_path / "node")
    eng, mine, peers = _spare(tmp_path / "spare")
    peers._holders = {10: [("node", HOST, holder.port)]}

    def no_room(data_len: int, slot_bytes: int, slots: int) -> None:
        raise ShmTooSmall(f"this node's snapshots need {8 * slot_bytes} bytes (test)")

    eng.admit = no_room
    peers.offer = lambda: {10}  # type: ignore[method-assign] - what the holders answer
    me = Membership(rank=1, size=2, epoch=2)
    pg = ScriptedGroup(_head(10, 0, 0), _mask({10}, 10, -1), _LOADED)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    with pytest.raises(ShmTooSmall, match=r"this node's snapshots need \d+ bytes \(test\)"):
        RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None), peers], tier, fresh=False)
    assert eng.available() == [] and not [p for p in (tmp_path / "spare").iterdir() if "slot" in p.name
                                          or "point" in p.name], "nothing was received"
    eng.close()
    src.close()
