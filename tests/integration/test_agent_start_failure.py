"""An agent that cannot start ends the job, with its error, instead of leaving it waiting
for that node forever (before the first world the controller places no rank without it).

Two ways it is told: the agent itself reports to etcd why it could not start (a rank -1
report of kind ``agent``, with its traceback), and `hotspare run` reports an agent process
it started that died before it reached etcd, with the last line of its log."""

from __future__ import annotations

import os

from hotspare.orchestrator.commands.jobs import _report_exited_agents
from hotspare.orchestrator.decide import Action, decide
from hotspare.orchestrator.spec import load_spec
from hotspare.orchestrator.store import JobState


def test_an_agent_that_cannot_start_fails_the_job_with_its_error(cluster):
    """A wrong --host ($HOTSPARE_HOST: not an address of this machine) stops each agent in its
    start-up; `hotspare run` ends with the agent's sentence instead of waiting forever."""
    cluster.controller()
    cluster.env["HOTSPARE_HOST"] = "192.0.2.7"  # TEST-NET-1: never this machine's
    spec = cluster.spec_file(name="nohost", ranks=2, spares=0)
    summary, r = cluster.run_json(str(spec), "--timeout", "180")
    assert r.returncode == 1 and summary["state"] == "failed", (r.stdout, r.stderr[-3000:])
    state, message = cluster.job("nohost").state()
    assert state is JobState.FAILED
    assert message.startswith("the agent of node node"), message
    assert "could not start: OSError: [Errno 99] the replica server cannot listen on 192.0.2.7" in message
    assert "--host (or $HOTSPARE_HOST) must be an address of this machine" in message
    assert "hotspare logs nohost --node node" in message
    assert "agents/replica.py" in summary["error"], "the traceback is kept as the evidence"
    node = message.split()[4]  # the first agent that reported (it logged before it reported)
    log = (cluster.tmp / "out" / "nohost" / "logs" / f"agent-{node}.log").read_text()
    assert "Traceback" in log and "cannot listen on 192.0.2.7" in log, log


DIE_EARLY = """\
import os, sys
argv = sys.argv
if argv[1:2] == ["agent"] and "--node" in argv and argv[argv.index("--node") + 1] == "node1":
    sys.stderr.write("hotspare agent: error: simulated death before etcd\\n")
    os._exit(2)
"""


def test_hotspare_run_ends_the_job_when_an_agent_it_started_dies_before_reaching_etcd(cluster):
    """node1's agent process dies at interpreter start (a sitecustomize on its PYTHONPATH), so
    it writes nothing to etcd; node0 and spare0 register and the controller would wait for
    node1 forever. `hotspare run` sees the process gone and reports it with its log's last line."""
    cluster.controller()
    (cluster.tmp / "site").mkdir()
    (cluster.tmp / "site" / "sitecustomize.py").write_text(DIE_EARLY)
    cluster.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cluster.tmp / "site"),
                                                              cluster.env.get("PYTHONPATH")]))
    spec = cluster.spec_file(name="early", ranks=2, spares=1)
    summary, r = cluster.run_json(str(spec), "--timeout", "180")
    assert r.returncode == 1 and summary["state"] == "failed", (r.stdout, r.stderr[-3000:])
    assert summary["message"] == (
        "the agent of node node1 could not start: its process exited before it registered; its log ends: "
        "hotspare agent: error: simulated death before etcd; the job cannot be placed without it "
        "(its log: `hotspare logs early --node node1`)"), summary["message"]


def test_a_local_agent_that_died_before_reaching_etcd_is_reported_by_hotspare_run(cluster):
    """What `hotspare run`'s watch loop does with the agents it started that exited before
    they registered: one report each, which fails the job with the agent's last words; a
    node that registered, or that reported already, is left alone."""
    spec = load_spec(cluster.spec_file(name="gone", ranks=2, spares=1))
    js = cluster.job("gone")
    js.submit(spec, os.urandom(16))
    snap = js.snapshot()
    assert decide(snap).action is Action.WAIT
    _report_exited_agents(js, snap, lambda: {"node1": "hotspare agent: error: No such file or directory", "spare0": ""})
    snap = js.snapshot()
    assert sorted((r.node, r.rank, r.kind) for r in snap.reports) == [("node1", -1, "agent"), ("spare0", -1, "agent")]
    _report_exited_agents(js, snap, lambda: {"node1": "a second look"})  # reported already: not again
    snap = js.snapshot()
    assert [r.message for r in snap.reports if r.node == "node1"] == [
        "its process exited before it registered; its log ends: hotspare agent: error: No such file or directory"]
    d = decide(snap)
    assert d.action is Action.FAIL
    assert str(d).startswith("the agent of node node1 could not start: its process exited before it registered; "
                             "its log ends: hotspare agent: error: No such file or directory"), str(d)
