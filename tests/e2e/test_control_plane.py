"""End to end on a real etcd with real agents, workers and gloo: failures get swapped.

Each test runs the allreduce example job (every step checks that all ranks took part)
with a real controller, and asserts on the job's outcome and its event timeline.
"""

from __future__ import annotations

import os
import signal

import pytest

pytestmark = pytest.mark.timeout(300)


def _pids_by_rank(events) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for e in events:
        if e.kind == "rebuilt":
            out.setdefault(e.data["rank"], set()).add(e.data["pid"])
    return out


def _epochs(events, kind="rebuilt") -> set[int]:
    return {e.data["epoch"] for e in events if e.kind == kind}


def test_worker_kill_is_swapped_to_spare_and_survivors_keep_their_pids(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="kill", chaos=[{"at_step": 40, "action": "kill-rank", "rank": 1}])
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "succeeded", r.stdout + r.stderr
    assert summary["steps_done"] == 120
    [rec] = summary["recoveries"]
    assert rec["failed_rank"] == 1 and rec["failed_node"] == "node1"
    assert rec["spare_node"] == "spare0" and rec["kind"] == "signal"
    assert rec["total_s"] is not None and rec["total_s"] > 0
    events = cluster.job("kill").events()
    pids = _pids_by_rank(events)
    assert len(pids[0]) == 1 and len(pids[2]) == 1, f"survivors were restarted: {pids}"
    assert len(pids[1]) == 2, "rank 1 should have had its original worker and the spare's"
    assert _epochs(events) == {1, 2}
    # the spare's worker was warm (interpreter and torch loaded) when it got the rank
    [assigned] = [e for e in events if e.kind == "assigned" and e.data["epoch"] == 2]
    assert assigned.data["node"] == "spare0" and assigned.data["warm"] is True
    # each rank publishes its last step's progress (and metrics) before its done mark, so
    # the summary's numbers are the final ones, not the last periodic ones
    assert {r: p.step for r, p in cluster.job("kill").snapshot().progress.items()} == {0: 119, 1: 119, 2: 119}


def test_node_loss_without_report_is_swapped_after_lease_expiry(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="nodeloss", chaos=[{"at_step": 40, "action": "kill-node", "rank": 2}])
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "succeeded", r.stdout + r.stderr
    [rec] = summary["recoveries"]
    assert rec["kind"] == "node-loss" and rec["failed_node"] == "node2" and rec["spare_node"] == "spare0"
    events = cluster.job("nodeloss").events()
    assert not [e for e in events if e.kind == "worker-exit"], "a lost node cannot report"
    # detection waited for the lease (TTL 2 s), not for a report
    assert rec["detect_s"] >= 1.0


def test_hung_worker_is_killed_by_the_watchdog_and_swapped(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="hang", hang_timeout=3,
                             chaos=[{"at_step": 40, "action": "hang-rank", "rank": 0}])
    summary, r = cluster.run_json(str(spec))
    assert summary["state"] == "succeeded", r.stdout + r.stderr
    [rec] = summary["recoveries"]
    assert rec["kind"] == "hang" and rec["failed_rank"] == 0 and rec["spare_node"] == "spare0"
    pids = _pids_by_rank(cluster.job("hang").events())
    assert len(pids[1]) == 1 and len(pids[2]) == 1


def test_cli_random_chaos_injects_seeded_failures_through_etcd(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="clichaos", steps=400)
    cluster.hotspare("submit", str(spec), check=True)
    js = cluster.job("clichaos")
    cluster.wait(lambda: any(p.step >= 20 for p in js.snapshot().progress.values()), what="step 20")
    r = cluster.hotspare("chaos", "clichaos", "--mtbf", "0.5", "--seed", "7", "--kinds", "kill-rank",
                         "--count", "1", check=True)
    assert "[1] kill-rank sent to" in r.stdout
    cluster.wait(lambda: js.snapshot().state.terminal, timeout=180, what="job end")
    snap = js.snapshot()
    assert snap.state.value == "succeeded", snap.state_message
    assert snap.epoch == 2
    injected = [e for e in js.events() if e.kind == "chaos"]
    assert len(injected) == 1 and injected[0].data["action"] == "kill-rank"
    assert snap.world.seats[injected[0].data["rank"]].node == "spare0"


def test_standby_controller_finishes_the_job_when_the_leader_is_killed(cluster):
    controllers = [cluster.controller(ttl=2), cluster.controller(ttl=2)]
    spec = cluster.spec_file(name="leader", steps=300,
                             chaos=[{"at_step": 200, "action": "kill-rank", "rank": 1}])
    cluster.hotspare("submit", str(spec), check=True)
    js = cluster.job("leader")
    cluster.wait(lambda: js.snapshot().leader is not None, what="a leader")
    leader = js.snapshot().leader
    [first] = [p for p in controllers if leader.endswith(f":{p.pid}")]
    cluster.wait(lambda: any(p.step >= 30 for p in js.snapshot().progress.values()), what="step 30")
    os.killpg(first.pid, signal.SIGKILL)
    cluster.wait(lambda: js.snapshot().state.terminal, timeout=180, what="job end")
    snap = js.snapshot()
    assert snap.state.value == "succeeded", snap.state_message
    assert snap.leader != leader
    # the standby also handled the failure that came after the takeover
    assert snap.epoch == 2 and snap.world.seats[1].node == "spare0"
    leads = [e for e in js.events() if e.kind == "leader"]
    assert len(leads) == 2


def test_no_spare_with_fail_policy_fails_with_a_clear_message(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="nofail", spares=0, on_no_spare="fail",
                             chaos=[{"at_step": 30, "action": "kill-rank", "rank": 1}])
    summary, r = cluster.run_json(str(spec))
    assert r.returncode == 1
    assert summary["state"] == "failed"
    state, message = cluster.job("nofail").state()
    assert "no spare left" in message and "on_no_spare" in message and "spares" in message
    assert "rank 1" in message


def test_no_spare_with_wait_policy_finishes_once_a_spare_agent_joins(cluster):
    cluster.controller()
    spec = cluster.spec_file(name="nowait", spares=0, on_no_spare="wait",
                             chaos=[{"at_step": 30, "action": "kill-rank", "rank": 0}])
    cluster.hotspare("submit", str(spec), check=True)
    js = cluster.job("nowait")
    cluster.wait(lambda: any(e.kind == "waiting" and "no spare left" in e.message for e in js.events()),
                 what="the controller to wait for a spare")
    assert not js.snapshot().state.terminal
    cluster.agent("nowait", "late0", spare=True)
    cluster.wait(lambda: js.snapshot().state.terminal, timeout=180, what="job end")
    snap = js.snapshot()
    assert snap.state.value == "succeeded", snap.state_message
    assert snap.world.seats[0].node == "late0"
