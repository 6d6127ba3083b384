"""Failures inside a recovery: each ends with the job bit-identical to the undisturbed run, or
failed with a sentence that says why -- never hung (the pytest timeout), never silently wrong.

A spec entry with ``during: rendezvous | restore | fetch`` fires inside the first recovery
that reaches that phase (recovery/chaos_hook.py); the other faults here are the control plane
and etcd going away at awkward moments. The workload is the small GPT of
tests/e2e/test_exact_recovery.py, compared tensor for tensor with the ``reference`` run.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hotspare.agents.node_services import sweep_stale_run_dirs
from hotspare.orchestrator.etcd_server import EtcdServer, free_port
from hotspare.orchestrator.spec import load_spec
from hotspare.orchestrator.store import StoreFull
from hotspare.orchestrator.store.client import parse_endpoint
from hotspare.orchestrator.util import pid_alive

from ..e2e.test_exact_recovery import assert_identical, gpt_spec, run_ok
from .test_etcd_outage import _max_hb_step

pytestmark = pytest.mark.timeout(400)


def _during(events, phase: str):
    """The chaos event of the entry scheduled ``during`` ``phase`` (it fired exactly once)."""
    [ev] = [e for e in events if e.kind == "chaos" and e.data.get("during") == phase]
    return ev


def _restored(events, epoch: int) -> dict[int, dict]:
    return {e.data["rank"]: e.data for e in events if e.kind == "restored" and e.data["epoch"] == epoch}


def test_a_rank_killed_during_the_new_epochs_rendezvous_ends_bit_identical(cluster, reference):
    # rank 1 dies at step 24; while the others rendezvous for epoch 2, rank 2 dies too
    cluster.controller()
    s = run_ok(cluster, "rdzv", spares=2, chaos=[
        {"at_step": 24, "action": "kill-rank", "rank": 1},
        {"at_step": 24, "action": "kill-rank", "rank": 2, "during": "rendezvous"}])
    assert_identical(reference, cluster.tmp / "out" / "rdzv")
    events = cluster.job("rdzv").events()
    assert _during(events, "rendezvous").data["rank"] == 2
    assert sorted(r["failed_rank"] for r in s["recoveries"]) == [1, 2]
    # rank 2's first worker never built epoch 2's group: it died in its rendezvous
    built = {(e.data["epoch"], e.data["rank"]) for e in events if e.kind == "rebuilt"}
    assert (2, 2) not in built and any(epoch > 2 for epoch, rank in built if rank == 2)


def test_the_spare_dying_during_its_restore_ends_bit_identical(cluster, reference):
    # rank 1 dies; the spare that takes its seat dies after the agreement, before it loads
    cluster.controller()
    run_ok(cluster, "spare", spares=2, chaos=[
        {"at_step": 24, "action": "kill-rank", "rank": 1},
        {"at_step": 24, "action": "kill-rank", "rank": 1, "during": "restore"}])
    assert_identical(reference, cluster.tmp / "out" / "spare")
    events = cluster.job("spare").events()
    died = _during(events, "restore")
    assert died.source == "rank1" and died.data["node"].startswith("spare")
    assert 1 not in _restored(events, 2), "the spare died before restoring"
    assert 1 in _restored(events, 3), "rank 1's next holder restored it"


def test_the_replica_holder_lost_while_the_spare_fetches_from_it_ends_bit_identical(cluster, reference):
    # rank 1's worker dies at step 24: its node's agent still serves the dead worker's ring
    # slots, so the spare is to fetch step 23 (or 22) from node1 -- which is killed as the
    # fetch begins. The spare withdraws that step and all members agree on a replication point
    # (step 20, or 10 if 20 was not replicated yet) that node2 holds a replica of. (Every
    # candidate is a point here, replicate_interval 0: the steps are known in advance.)
    cluster.controller()
    run_ok(cluster, "fetch", replicate_interval=0, chaos=[
        {"at_step": 24, "action": "kill-rank", "rank": 1},
        {"at_step": 24, "action": "kill-node", "node": "node1", "during": "fetch"}])
    assert_identical(reference, cluster.tmp / "out" / "fetch")
    events = cluster.job("fetch").events()
    assert _during(events, "fetch").source == "rank1"
    restored = _restored(events, 2)
    assert restored[1]["source"] == "replica on node2" and restored[1]["restore_step"] in (10, 20)
    assert restored[0]["restore_step"] == restored[2]["restore_step"] == restored[1]["restore_step"]


def test_the_only_holder_lost_mid_fetch_fails_the_job_saying_why(cluster):
    # no replication (replicas: 0), no persisted checkpoints: the dead worker's own node holds
    # the only copy of rank 1's state, and it is killed as the spare starts fetching it
    cluster.controller()
    summary, r = cluster.run_json(str(gpt_spec(cluster, "gone", replicas=0, chaos=[
        {"at_step": 24, "action": "kill-rank", "rank": 1},
        {"at_step": 24, "action": "kill-node", "node": "node1", "during": "fetch"}])))
    assert summary["state"] == "failed" and r.returncode == 1
    _until_agents_left(cluster, _launched_agents(cluster, "gone"))
    sweep_stale_run_dirs(Path("/dev/shm"))  # what the next agent would do: node1 was killed, not stopped
    state, message = cluster.job("gone").state()
    assert "no snapshot step is held by every member of epoch 2" in message, message
    assert "set persist_every to survive this" in message and "raised" not in message, message


def test_the_controller_and_a_node_lost_together_end_bit_identical(cluster, reference):
    cluster.controller()
    cluster.controller()  # the standby
    s = run_ok(cluster, "both", chaos=[{"at_step": 24, "action": "kill-controller"},
                                       {"at_step": 24, "action": "kill-node", "rank": 1}])
    assert_identical(reference, cluster.tmp / "out" / "both")
    [rec] = s["recoveries"]
    assert rec["kind"] == "node-loss" and rec["failed_node"] == "node1"
    leaders = [e for e in cluster.job("both").events() if e.kind == "leader"]
    assert len(leaders) == 2, "the standby took over"


class CuttableLink:
    """A TCP relay to etcd for one node, which the test can cut: every open connection is
    closed and new ones are closed as soon as they are accepted (the node's link to a healthy
    etcd is down), until :meth:`heal`."""

    def __init__(self, endpoint: str) -> None:
        host, port, _ = parse_endpoint(endpoint)
        self.upstream = (host, port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.cut = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                if self.cut.is_set():
                    raise OSError("cut")
                up = socket.create_connection(self.upstream)
            except OSError:
                down.close()
                continue
            with self._lock:
                self._open |= {down, up}
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(a, b), name="link-pipe", daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            self._close(a, b)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
            with self._lock:
                self._open.discard(s)

    def sever(self) -> None:
        self.cut.set()
        with self._lock:
            socks = list(self._open)
        self._close(*socks)

    def heal(self) -> None:
        self.cut.clear()

    def close(self) -> None:
        self.server.close()
        self.sever()


def _until_agents_left(cluster, pids) -> None:
    """The job ended: its agents stop their workers and remove their shared memory. Wait for
    that, so that the cluster's teardown (SIGKILL) leaves nothing behind in /dev/shm."""
    cluster.wait(lambda: not any(pid_alive(p) for p in pids), timeout=60, what="the job's agents to leave")


def _launched_agents(cluster, job: str) -> list[int]:
    return list(json.loads((cluster.tmp / "out" / job / "agents.json").read_text()).values())


def _wait_step(job: str, step: int, timeout: float = 120) -> None:
    """Until some rank's heartbeat (read without etcd) has passed ``step``."""
    deadline = time.monotonic() + timeout
    while _max_hb_step(job) < step:
        assert time.monotonic() < deadline, f"{job} did not reach step {step}"
        time.sleep(0.05)


def test_a_node_cut_off_from_a_healthy_etcd_past_its_lease_is_replaced_and_fenced(cluster, reference):
    # node1's agent and workers reach etcd through a link the test cuts for 3 lease TTLs while
    # the controller and the other nodes keep theirs: node1 is declared lost, the spare takes
    # its rank; when the link heals the agent finds its lease gone, kills its worker (fenced)
    # and registers again as a new incarnation. Rank 0 is slowed (no effect on the result) so
    # that the cut lands mid-run.
    cluster.controller()
    spec = load_spec(gpt_spec(cluster, "cut", chaos=[{"at_step": 0, "action": "slow-rank", "rank": 0,
                                                       "seconds": 0.15}]))
    js = cluster.job("cut")
    js.submit(spec, secrets.token_bytes(32))
    link = CuttableLink(cluster.endpoint)
    try:
        agents = [cluster.agent("cut", node).pid for node in ("node0", "node2")]
        agents.append(cluster.spawn("agent", "--job", "cut", "--node", "node1", "--etcd", link.url,
                                    log="agent-node1.log").pid)
        agents.append(cluster.agent("cut", "spare0", spare=True).pid)
        _wait_step("cut", 10)
        [cut_rank] = [r for r, seat in enumerate(js.snapshot().world.seats) if seat.node == "node1"]
        link.sever()
        time.sleep(3 * spec.lease_ttl)
        link.heal()
        cluster.wait(lambda: js.state()[0].terminal, timeout=240, what="the job's end")
        _until_agents_left(cluster, agents)
    finally:
        link.close()
    state, message = js.state()
    assert state.value == "succeeded", message
    assert_identical(reference, cluster.tmp / "out" / "cut")
    snap = js.snapshot()
    assert snap.world.seats[cut_rank].node == "spare0"
    events = js.events()
    joined = [e.data["incarnation"] for e in events if e.kind == "node-joined" and e.data["node"] == "node1"]
    assert len(set(joined)) == 2, f"node1 should have registered again as a new incarnation: {joined}"
    log = (cluster.tmp / "agent-node1.log").read_text(errors="replace")
    assert "lease lost: killing assigned workers" in log


def test_etcd_down_as_the_ranks_finish_still_ends_the_job_succeeded(cluster, etcd):
    # etcd stops just before the last step and comes back 3 lease TTLs later: the ranks
    # finish training meanwhile and retry their done marks; nobody is reported failed
    cluster.controller()
    spec = cluster.spec_file(name="finish", steps=100, args={"step_sleep": 0.05})
    cluster.hotspare("submit", str(spec), check=True)
    _wait_step("finish", 92)
    etcd.stop()
    time.sleep(6)
    etcd.start(log_path=cluster.tmp / "etcd-again.log")
    etcd.wait_ready()
    js = cluster.job("finish")
    cluster.wait(lambda: js.state()[0].terminal, timeout=180, what="the job's end")
    _until_agents_left(cluster, _launched_agents(cluster, "finish"))
    state, message = js.state()
    assert state.value == "succeeded", message
    snap = js.snapshot()
    assert snap.epoch == 1 and not snap.failures, snap.failures
    assert not [e for e in js.events() if e.kind in ("worker-exit", "failure")]
    logs = [f.read_text(errors="replace") for f in (cluster.tmp / "out" / "finish" / "logs").glob("rank*.log")]
    assert any("etcd unavailable while writing the done mark; retrying" in t for t in logs), \
        "etcd came back before any rank finished: the test missed its moment"


def test_etcds_space_quota_reached_mid_job_is_named_and_the_job_ends_once_it_is_cleared(tmp_path, reference):
    # etcd's quota is small and the test fills it until the NOSPACE alarm: etcd still answers
    # reads, deletes and keepalives, but refuses every write. Training goes on (it never writes
    # to etcd) to the end; the ranks wait to record it, saying why once; `hotspare run` and
    # `status` name the quota and the fix. Once the operator's fix is applied the job ends,
    # bit-identical.
    from ..conftest import Cluster

    srv = EtcdServer(tmp_path / "etcd", free_port(), free_port())
    srv.start(log_path=tmp_path / "etcd.log", extra_args=["--quota-backend-bytes", str(16 * 2**20)])
    srv.wait_ready()
    cluster = Cluster(srv, tmp_path)
    run = None
    try:
        cluster.controller()
        spec = gpt_spec(cluster, "quota", chaos=[{"at_step": 0, "action": "slow-rank", "rank": 0, "seconds": 0.1}])
        with open(tmp_path / "run.out", "wb") as out:
            run = subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", "run", "--no-check", str(spec)],
                                   env=cluster.env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        _wait_step("quota", 10)
        blob = bytes(512 * 1024)
        with pytest.raises(StoreFull, match="space quota is exhausted"):
            for i in range(1000):  # 16 MiB of junk, and then some
                cluster.store.put(f"/junk/{i}", blob)
        assert cluster.store.alarms() == ["NOSPACE"]
        logs = cluster.tmp / "out" / "quota" / "logs"
        cluster.wait(lambda: all("waits to record it" in (logs / f"rank{r}.log").read_text(errors="replace")
                                 for r in range(3)), timeout=120, what="every rank to finish training")
        js = cluster.job("quota")
        assert not js.state()[0].terminal
        shown = cluster.hotspare("status", "quota").stdout
        assert "its space quota is exhausted (NOSPACE alarm)" in shown and "etcdctl alarm disarm" in shown, shown
        time.sleep(3)  # the ranks keep waiting, without a line per retry
        for r in range(3):
            text = (logs / f"rank{r}.log").read_text(errors="replace")
            assert text.count("space quota is exhausted") == 1, text[-2000:]
        # `hotspare run` reads etcd's alarms every round once no step advanced for 15 s
        cluster.wait(lambda: "its space quota is exhausted (NOSPACE alarm)" in (tmp_path / "run.out").read_text(),
                     timeout=60, what="`hotspare run` to name the alarm")
        # the operator's fix: free the space, compact, defragment, disarm
        client = cluster.store._client
        cluster.store.delete_prefix("/junk/")
        _, revision = cluster.store.get_prefix("/junk/")
        client.compact(revision, physical=True)
        client.defragment()
        for alarm in list(client.list_alarms()):  # what `etcdctl alarm disarm` does
            client.disarm_alarm(member_id=alarm.member_id)
        assert cluster.store.alarms() == []
        cluster.wait(lambda: js.state()[0].terminal, timeout=120, what="the job's end")
        _until_agents_left(cluster, _launched_agents(cluster, "quota"))
        state, message = js.state()
        assert state.value == "succeeded", message
        assert run.wait(60) == 0
        said = (tmp_path / "run.out").read_text()
        assert said.count("its space quota is exhausted (NOSPACE alarm)") == 1, said
        assert_identical(reference, cluster.tmp / "out" / "quota")
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        cluster.close()
        srv.stop()
