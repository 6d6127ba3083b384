"""Security review findings on the node and the control loop, against real sockets and etcd.

F8: a stranger on the replica port gets no thread and no file descriptor beyond a small
bound of pending handshakes, and only for a short handshake timeout, so a flood of idle
connections does not lock the job's own peers out.

F10: a record under a job's prefix that does not parse (written by anyone with write access
to etcd, or by a buggy or newer writer) costs nothing but itself: the controller reconciles
every other job, and the agent of the job goes on.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import zlib

import pytest

from hotspare.orchestrator.spec import load_spec
from hotspare.orchestrator.store import JobState
from hotspare.recovery.replica_client import fetch, list_steps
from hotspare.recovery.wire import Channel

from ..conftest import wait_until

pytestmark = pytest.mark.timeout(300)

SECRET = b"k" * 32
HOST = "127.0.0.1"
FLOOD = 120  # the review's number: idle connections that never say a word
#: where the flood comes from: several hosts (loopback addresses), none of them the genuine peer's
SOURCES = [f"127.0.0.{i}" for i in range(2, 8)]
#: file descriptors the server process may open beyond what it holds when it starts serving:
#: room for the bound on pending handshakes (32) and the genuine peer, not for the flood
FD_ROOM = 80

SERVER = r"""
import os, resource, sys
from pathlib import Path
from hotspare.agents.replica import ReplicaServer, ReplicaStore

directory, secret, room = Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3])
srv = ReplicaServer(ReplicaStore(directory), secret).start()
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + room, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(srv.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
srv.stop()
"""


@pytest.fixture
def replica_server(tmp_path):
    """A ReplicaServer in a process of its own whose file descriptors are limited to what it
    holds plus FD_ROOM (an agent's limit, scaled down to the flood); yields its port."""
    directory = tmp_path / "replicas"
    directory.mkdir()
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(directory), SECRET.hex(), str(FD_ROOM)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield port
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Flood:
    """Strangers that hold up to ``n`` idle connections to the port, spread over the source
    addresses ``sources``, and open a new one whenever the server drops one: a flood that
    lasts, as an attacker's would (not one the server outlives by a timeout)."""

    def __init__(self, port: int, n: int, sources: list[str]) -> None:
        self.port, self.n, self.sources = port, n, sources
        self.open: list[socket.socket] = []
        self.accepted = 0  # connections the server took (it sent them its challenge)
        self.connects = 0  # connections established (the server may have dropped them since)
        self.grew = time.monotonic()  # when a connection was last established
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> _Flood:
        self._thread.start()
        return self

    @property
    def at_full_strength(self) -> bool:
        """The flood has opened as many connections as it holds, or the server has taken no
        new one for a second."""
        return self.connects >= self.n or (self.connects > 0 and time.monotonic() - self.grew > 1.0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for s in self.open:
            s.close()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self._prune()
            if len(self.open) >= self.n:
                time.sleep(0.01)
                continue
            src = self.sources[i % len(self.sources)]
            i += 1
            try:
                s = socket.create_connection((HOST, self.port), timeout=0.2, source_address=(src, 0))
            except OSError:
                continue  # the server's queue is full: try again
            self.connects += 1
            self.grew = time.monotonic()
            s.setblocking(False)
            self.open.append(s)

    def _prune(self) -> None:
        """Forget the connections the server closed; count the challenges received."""
        ready, _, _ = select.select(self.open, [], [], 0) if self.open else ([], [], [])
        for s in ready:
            try:
                got = s.recv(64)
            except OSError:
                got = b""
            if got:
                self.accepted += 1
                continue
            self.open.remove(s)
            s.close()


def _snapshot(step: int, values: bytes) -> tuple[dict, bytes]:
    tensors = [{"name": "w", "dtype": "float32", "shape": [len(values) // 4], "offset": 0, "nbytes": len(values)}]
    return {"step": step, "tensors": tensors, "crc": [zlib.crc32(values)], "meta": {}}, values


@pytest.mark.parametrize("sources", [SOURCES, [HOST]], ids=["from-other-hosts", "from-the-peers-own-address"])
def test_a_flood_of_idle_connections_does_not_lock_genuine_peers_out(replica_server, sources):
    """The review's attack: 120 idle connections to an agent's replica port. Each used to hold
    a thread and a descriptor for the 10 s handshake timeout, so the agent ran out of
    descriptors and a genuine list/get failed. Now at most 32 handshakes are pending (the
    oldest of the address with the most is dropped for a newer one) and a handshake has 2 s:
    the genuine peer is served while the flood goes on, also from the peer's own address (a
    local attacker, on a machine where the job's agents talk over loopback)."""
    port = replica_server
    with _Flood(port, FLOOD, sources) as flood:
        wait_until(lambda: flood.at_full_strength, "the flood to reach full strength", timeout=60)
        assert list_steps(HOST, port, SECRET, 3) == []  # a spare asking what the node holds
        header, body = _snapshot(7, os.urandom(64))
        ch = Channel.client(HOST, port, SECRET, timeout=10)  # a buddy pushing a replica
        try:
            ch.send({"op": "put", "rank": 3, "snapshot": header}, body)
            reply, _ = ch.recv()
        finally:
            ch.close()
        assert reply == {"ok": True}, reply
        assert list_steps(HOST, port, SECRET, 3) == [7]
        got, data = fetch(HOST, port, SECRET, 3, 7)
        assert data == body and got["step"] == 7
        assert flood.open, "the flood ended before the genuine peer was served: the test proves nothing"


# -- F10 -------------------------------------------------------------------------------------------
def _submit(cluster, name: str, steps: int) -> None:
    spec = load_spec(cluster.spec_file(name=name, ranks=1, spares=0, steps=steps, args={"step_sleep": 0.02}))
    cluster.job(name).submit(spec, os.urandom(32))


def test_a_malformed_record_under_one_job_stops_neither_the_other_jobs_nor_its_agent(cluster):
    """A node record missing its fields, planted under job ``a`` (listed first). It used to
    raise in the snapshot's parser: the controller's one try around all jobs then never
    reached job ``b``, and ``a``'s agent died of the same error. Now the record is skipped
    (and reported on ``a``'s timeline), ``b`` and ``a`` both run to success, and ``a``'s agent
    leaves only when its run is over."""
    cluster.controller()
    _submit(cluster, "a", steps=40)
    ja, jb = cluster.job("a"), cluster.job("b")
    ghost = ja.keys.node("ghost")
    cluster.store.put(ghost, json.dumps({"name": "ghost"}))  # no incarnation, role, slots
    agent_a = cluster.agent("a", "a0")
    _submit(cluster, "b", steps=40)
    agent_b = cluster.agent("b", "b0")

    def ended(js) -> bool:
        return js.state()[0].terminal

    try:
        wait_until(lambda: ended(jb) and ended(ja), "both jobs to end", timeout=150)
    except AssertionError as e:
        logs = {p.name: p.read_text()[-1500:] for p in cluster.tmp.glob("*.log")
                if p.name.startswith(("agent-a0", "controller"))}
        raise AssertionError(f"{e}; job a {ja.state()}, job b {jb.state()}, agent a exit {agent_a.poll()}\n"
                             + "\n".join(f"--- {k}\n{v}" for k, v in logs.items())) from None
    assert jb.state()[0] is JobState.SUCCEEDED, jb.state()
    assert ja.state()[0] is JobState.SUCCEEDED, ja.state()
    assert agent_a.wait(30) == 0, "the agent of the job with the bad record did not leave cleanly"
    assert agent_b.wait(30) == 0
    bad = [e for e in ja.events() if e.kind == "bad-record"]
    assert bad and bad[0].data.get("key") == ghost, [(e.kind, e.message) for e in ja.events()]
    assert "ghost" in bad[0].message
    assert not [e for e in jb.events() if e.kind == "bad-record"]


def test_a_job_whose_epoch_does_not_parse_waits_alone_and_resumes_once_it_is_fixed(cluster):
    """A record the job cannot be judged without (its epoch) does not parse: that job cannot be
    reconciled -- the controller says so on its timeline, once -- but the job after it is, and
    the agent of the stuck job waits instead of dying. Once the record is repaired the job
    runs."""
    cluster.controller()
    _submit(cluster, "a", steps=30)
    ja, jb = cluster.job("a"), cluster.job("b")
    cluster.store.put(ja.keys.epoch, "garbage")
    agent_a = cluster.agent("a", "a0")
    _submit(cluster, "b", steps=30)
    cluster.agent("b", "b0")

    wait_until(lambda: jb.state()[0].terminal, "job b to end", timeout=150)
    assert jb.state()[0] is JobState.SUCCEEDED, jb.state()
    wait_until(lambda: any(e.kind == "reconcile-failed" for e in ja.events()), "the failure on job a's timeline",
               timeout=60)
    failed = [e for e in ja.events() if e.kind == "reconcile-failed"]
    assert len(failed) == 1 and failed[0].data.get("key") == ja.keys.epoch, [e.message for e in failed]
    assert ja.state()[0] is JobState.PENDING
    assert agent_a.poll() is None, "the agent of the job with the bad record died"

    cluster.store.delete(ja.keys.epoch)  # repaired: no world yet, as before the bad write
    wait_until(lambda: ja.state()[0].terminal, "job a to end once repaired", timeout=150)
    assert ja.state()[0] is JobState.SUCCEEDED, ja.state()
    assert agent_a.wait(30) == 0
