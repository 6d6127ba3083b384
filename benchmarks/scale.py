"""How hotspare's control plane copes with many nodes: a real etcd, a real controller, and N
simulated node agents (issue 15).

The simulated agents run no training. Each one does to etcd what a real agent does
(``agents/agent.py``): it grants its own lease and keeps it alive, registers its node record
under it (``role``, ``slots``, ``warm``), holds the watches a real agent holds (the keys of
``JobStore.agent_keys``), and on every watch event reads the job the way ``Agent._follow_job``
does (``JobStore.agent_snapshot``: its own keys and the current world) and notes the newest world it sees. Agents share
processes (``--procs``, default one per core): within a process the leases share one
``LeaseKeepAlive`` stream (one request per lease every TTL/3, as each real agent sends on its
own stream; from a process of their own, so that busy readers cannot starve them) and the watches share the client's watch stream (as python-etcd3 multiplexes
them); each agent's reads are its own.

Per failure the harness measures, from one clock (``time.monotonic`` is system-wide):

* **node loss**: an active node stops its keepalives and its watch (a machine gone). Its
  lease expires, etcd deletes its node key (``t_expiry``: seen by the harness's own watch),
  the controller commits a new world (``t_commit``: the epoch key's watch), and every live
  agent has read it (``t_all``: the last agent's note). Decision latency = ``t_all - t_expiry``.
* **worker exit**: an agent writes the report an agent writes for a dead worker
  (``JobStore.report``); decision latency = ``t_all - t_report``.

After each failure the lost node comes back as a spare (a rebooted machine) so that the
pool never runs dry. Also per decision: the controller's CPU seconds (``/proc``), etcd's
requests by method (its ``/metrics``), and at the end etcd's and the controller's RSS.

    .venv/bin/python benchmarks/scale.py --nodes 100 --failures 20
    .venv/bin/python benchmarks/scale.py --smoke        # N = 50, 4 failures: correctness only
    .venv/bin/python benchmarks/scale.py --model --plot benchmarks/scale_latency.png  # no etcd: scale_model.py
"""

from __future__ import annotations

import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    base_parser,
    etcd_requests,
    finish,
    machine_info,
    parse_args_smoke,
    table,
    write_json,
)

JOB = "scale"


# -- the simulated agents (child process) ------------------------------------------------------
class SimAgent:
    def __init__(self, name: str, role: str, slots: int) -> None:
        self.name, self.role, self.slots = name, role, slots
        self.lease_id = 0
        self.cancel_watch = lambda: None
        self.epoch_seen = 0
        self.alive = True
        self.dirty = threading.Event()
        self.follow = None  # its JobFollower (keys mode): what its watches said, its last view
        self.buddies_key: tuple = ()


class Simulator:
    """The agents of one process; commands on stdin, observations on stdout (JSON lines)."""

    def __init__(self, endpoint: str, ttl: int, readers: int, mode: str = "keys") -> None:
        from hotspare.orchestrator.store import JobStore, Store

        self.prefix, self.full_world = mode == "prefix", mode == "world"
        self.store = Store([endpoint])
        self.js = JobStore(self.store, JOB)
        self.ttl = ttl
        self.agents: dict[str, SimAgent] = {}
        self.todo: queue.Queue[SimAgent] = queue.Queue()
        self.out_lock = threading.Lock()
        for i in range(readers):
            threading.Thread(target=self._reader, name=f"reader-{i}", daemon=True).start()
        # the keepalives go out from a process of their own: in a real deployment each agent's
        # keepalive thread has its node to itself, and here the readers' GIL would starve it
        self.pump = subprocess.Popen([sys.executable, __file__, "--_pump", endpoint, str(ttl)],
                                     stdin=subprocess.PIPE, text=True)

    def emit(self, **msg: Any) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def start_agent(self, name: str, role: str, slots: int) -> None:
        from hotspare.orchestrator.store import Node

        a = SimAgent(name, role, slots)
        # its own lease; kept alive on this process's shared keepalive stream (below)
        a.lease_id = self.store._call("lease grant", lambda: self.store._client.lease(self.ttl)).id
        self._pump_send(f"+{a.lease_id}")
        self.js.register_node(Node(name=name, incarnation=os.urandom(6).hex(), role=role, slots=slots,
                                   pid=os.getpid(), warm=slots), _LeaseId(a.lease_id))
        self.agents[name] = a
        # the watches a real agent holds: its JobFollower (Agent.run); "world": the same keys
        # but every event a read; "prefix": the whole job, as before issue 15
        if self.full_world or self.prefix:
            keys, prefixes = ([], [self.js.keys.prefix]) if self.prefix else self.js.agent_keys(name)
            cancels = [self.store.watch_prefix(k, lambda a=a: self._changed(a)) for k in (*keys, *prefixes)]
            a.cancel_watch = lambda: [c() for c in cancels]
        else:
            from hotspare.agents.job_follower import JobFollower

            a.follow = JobFollower(self.js, name, lambda a=a: self._changed(a))
            a.follow.start()
            a.cancel_watch = a.follow.stop
        self._changed(a)

    def _changed(self, a: SimAgent) -> None:
        if a.alive and not a.dirty.is_set():
            a.dirty.set()
            self.todo.put(a)

    def _reader(self) -> None:
        """Read the job for each agent whose watch fired, as ``Agent._follow_job`` does (and,
        at a new world, its ring buddies' records, as ``Agent._buddies`` does)."""
        from hotspare.agents.node_services import buddies_key, ring_successors

        while True:
            a = self.todo.get()
            a.dirty.clear()
            if not a.alive:
                continue
            try:
                if self.prefix:
                    snap = self.js.snapshot(progress=False)
                elif self.full_world:
                    snap = self.js.agent_snapshot(a.name)
                else:  # as Agent._follow_job: the watched change applied, or a read
                    snap = a.follow.read()
                if not self.prefix:
                    if snap.world is not None and snap.world.epoch > a.epoch_seen:
                        key = buddies_key(snap.world, a.name, 1)  # replicas: 1
                        if key != a.buddies_key or self.full_world:
                            self.js.nodes(ring_successors(snap.world, a.name)[:4])
                            a.buddies_key = key
            except Exception as e:  # noqa: BLE001 - etcd busy: read again
                self.emit(kind="error", node=a.name, error=str(e))
                self._changed(a)
                continue
            if snap.world is not None and snap.world.epoch > a.epoch_seen:
                a.epoch_seen = snap.world.epoch
                self.emit(kind="seen", node=a.name, epoch=snap.world.epoch, t=time.monotonic())

    def _pump_send(self, line: str) -> None:
        with self.out_lock:
            self.pump.stdin.write(line + "\n")
            self.pump.stdin.flush()

    def kill(self, name: str) -> None:
        a = self.agents[name]
        a.alive = False  # no more keepalives, no more reads: a lost machine
        self._pump_send(f"-{a.lease_id}")
        a.cancel_watch()

    def report(self, name: str, rank: int, epoch: int, step: int) -> None:
        from hotspare.orchestrator.store import Report

        self.js.report(Report(node=name, rank=rank, epoch=epoch, kind="signal", signal=9, time=time.time(),
                              message=f"rank {rank} killed (scale harness)", step=step))
        self.emit(kind="reported", node=name, rank=rank, t=time.monotonic())


class _LeaseId:
    """What ``Store.put(lease=...)`` reads of a lease: its id."""

    def __init__(self, lease_id: int) -> None:
        self.id = lease_id


def pump_main(argv: list[str]) -> int:
    """Keep leases alive on one LeaseKeepAlive stream: ``+ID`` / ``-ID`` lines on stdin add
    and drop a lease; each live lease gets a request every TTL/3."""
    from etcd3 import etcdrpc

    from hotspare.orchestrator.store import Store

    store, ttl = Store([argv[0]]), float(argv[1])
    live: set[int] = set()

    def commands() -> None:
        for line in sys.stdin:
            (live.add if line[0] == "+" else live.discard)(int(line[1:]))
        os._exit(0)  # the simulator is gone

    threading.Thread(target=commands, daemon=True).start()

    def requests():
        while True:
            ids = list(live)
            gap = (ttl / 3.0) / max(len(ids), 1)
            if not ids:
                time.sleep(0.1)
            for lid in ids:
                if lid in live:
                    yield etcdrpc.LeaseKeepAliveRequest(ID=lid)
                time.sleep(gap)

    while True:
        client = store._client
        try:
            for _ in client.leasestub.LeaseKeepAlive(requests(), metadata=client.metadata):
                pass
        except Exception as e:  # noqa: BLE001 - reopen
            print(f"keepalive stream broke: {e!r}"[:300], file=sys.stderr, flush=True)
            time.sleep(0.5)


def sim_main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    sim = Simulator(cfg["endpoint"], cfg["ttl"], cfg["readers"], cfg["agent_read"])
    for name, role in cfg["agents"]:
        sim.start_agent(name, role, cfg["slots"])
    sim.emit(kind="ready", count=len(cfg["agents"]))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "kill":
            sim.kill(cmd["node"])
        elif cmd["op"] == "start":
            sim.start_agent(cmd["node"], "spare", cfg["slots"])
            sim.emit(kind="started", node=cmd["node"])
        elif cmd["op"] == "report":
            sim.report(cmd["node"], cmd["rank"], cmd["epoch"], cmd["step"])
    return 0


# -- the harness (parent process) --------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Harness:
    def __init__(self, a) -> None:
        import tempfile

        from hotspare.orchestrator.etcd_server import start_etcd
        from hotspare.orchestrator.store import JobStore, Store

        self.a = a
        self.tmp = Path(tempfile.mkdtemp(prefix="hotspare-scale-"))
        self.etcd = start_etcd(self.tmp / "etcd", log_path=self.tmp / "etcd.log")
        self.store = Store([self.etcd.endpoint])
        self.js = JobStore(self.store, JOB)
        self.procs: list[subprocess.Popen] = []
        self.where: dict[str, int] = {}  # node -> simulator index
        self.alive: set[str] = set()
        self.latest: dict[str, int] = {}  # node -> newest epoch it has read
        self.target, self.pending, self.last_seen = 0, set(), 0.0
        self.expired: dict[str, float] = {}
        self.commits: dict[int, float] = {}
        self.reported: dict[str, float] = {}
        self.lock = threading.Condition()
        self.errors: list[str] = []

    # setting up
    def submit(self) -> None:
        a = self.a
        self.js.submit({"name": JOB, "entrypoint": "scale_harness.py:train", "ranks": a.nodes * a.ranks_per_node,
                        "spares": a.spares, "ranks_per_node": a.ranks_per_node, "steps": 10**9,
                        "lease_ttl": a.lease_ttl, "hang_timeout": 600, "on_no_spare": "wait",
                        "max_failures": 10**6, "replicas": 0}, os.urandom(32))

    def watch(self) -> None:
        client = self.store._client
        nodes_prefix = self.js.keys.prefix + "nodes/"

        def on_nodes(resp: Any) -> None:
            from etcd3.events import DeleteEvent

            now = time.monotonic()
            for ev in getattr(resp, "events", []):
                if isinstance(ev, DeleteEvent):
                    with self.lock:
                        self.expired[ev.key.decode()[len(nodes_prefix):]] = now
                        self.lock.notify_all()

        def on_epoch(resp: Any) -> None:
            now = time.monotonic()
            for ev in getattr(resp, "events", []):
                try:
                    epoch = int(ev.value)
                except ValueError:
                    continue
                with self.lock:
                    self.commits.setdefault(epoch, now)
                    self.lock.notify_all()

        client.add_watch_prefix_callback(nodes_prefix, on_nodes)
        client.add_watch_callback(self.js.keys.epoch, on_epoch)

    def start_sims(self) -> None:
        a = self.a
        names = [(f"node{i}", "active") for i in range(a.nodes)] + [(f"spare{i}", "spare") for i in range(a.spares)]
        groups = [names[i::a.procs] for i in range(a.procs)]
        for i, group in enumerate(groups):
            cfg = {"endpoint": self.etcd.endpoint, "ttl": a.lease_ttl, "readers": a.readers, "slots": a.ranks_per_node,
                   "agents": group, "agent_read": a.agent_read}
            p = subprocess.Popen([sys.executable, __file__, "--_sim", json.dumps(cfg)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, bufsize=1)
            self.procs.append(p)
            for name, _ in group:
                self.where[name] = i
                self.alive.add(name)
            threading.Thread(target=self._listen, args=(p,), daemon=True).start()

    def _listen(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            msg = json.loads(line)
            with self.lock:
                if msg["kind"] == "seen":
                    node, epoch = msg["node"], msg["epoch"]
                    self.latest[node] = max(self.latest.get(node, 0), epoch)
                    if epoch >= self.target and node in self.pending:
                        self.pending.discard(node)
                        self.last_seen = max(self.last_seen, msg["t"])
                elif msg["kind"] == "reported":
                    self.reported[msg["node"]] = msg["t"]
                elif msg["kind"] == "error":
                    self.errors.append(f"{msg['node']}: {msg['error']}")
                self.lock.notify_all()

    def send(self, node: str, **cmd: Any) -> None:
        p = self.procs[self.where[node]]
        p.stdin.write(json.dumps(dict(cmd, node=node)) + "\n")
        p.stdin.flush()

    def start_controller(self) -> subprocess.Popen:
        log = open(self.tmp / "controller.log", "wb")  # noqa: SIM115 - the child keeps it
        p = subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", "controller", "--etcd",
                              self.etcd.endpoint, "--job", JOB], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    # waiting
    def expect(self, epoch: int) -> None:
        """From now on, track which live agents have yet to read a world of ``epoch`` or newer."""
        with self.lock:
            self.target, self.last_seen = epoch, 0.0
            self.pending = {n for n in self.alive if self.latest.get(n, 0) < epoch}

    def wait_all_seen(self, timeout: float) -> float | None:
        """When the last live agent read the expected world (None: not within ``timeout``)."""
        return self.wait_for(lambda: None if self.pending else self.last_seen, timeout)

    def wait_for(self, what, timeout: float):
        deadline = time.monotonic() + timeout
        with self.lock:
            while (got := what()) is None:
                if time.monotonic() >= deadline:
                    return None
                self.lock.wait(max(deadline - time.monotonic(), 0.05))
            return got

    def close(self) -> None:
        import shutil

        from hotspare.orchestrator.etcd_server import stop_pid

        for p in self.procs:
            p.kill()
            p.wait()
        stop_pid(self.etcd.pid)
        shutil.rmtree(self.tmp, ignore_errors=True)


def one_failure(h: Harness, i: int, kind: str, rng: random.Random, timeout: float) -> dict[str, Any]:
    """Inject one failure and measure it; the lost node comes back as a spare."""
    epoch = h.js.epoch()
    world = h.js.world(epoch)
    seat = rng.choice(list(world.seats))
    node = seat.node
    cpu0, req0, t0 = cpu_seconds(h.controller.pid), etcd_requests(h.etcd.endpoint), time.monotonic()
    h.expect(epoch + 1)
    if kind == "node loss":
        h.send(node, op="kill")
        with h.lock:
            h.alive.discard(node)
            h.pending.discard(node)
        start = h.wait_for(lambda: h.expired.get(node), timeout)
    else:
        rank = world.seats.index(seat)
        h.send(node, op="report", rank=rank, epoch=epoch, step=i)
        start = h.wait_for(lambda: h.reported.get(node), timeout)
    commit = h.wait_for(lambda: min((t for e, t in h.commits.items() if e > epoch), default=None), timeout)
    done = h.wait_all_seen(timeout)
    cpu1, req1 = cpu_seconds(h.controller.pid), etcd_requests(h.etcd.endpoint)
    row = {"kind": kind, "node": node, "epoch": epoch, "ok": None not in (start, commit, done),
           "detect_to_commit_s": None if None in (start, commit) else commit - start,
           "decision_latency_s": None if None in (start, done) else done - start,
           "controller_cpu_s": cpu1 - cpu0, "wall_s": time.monotonic() - t0,
           "etcd_requests": {m: req1.get(m, 0) - req0.get(m, 0) for m in req1 if req1.get(m, 0) != req0.get(m, 0)}}
    if kind == "node loss":  # the machine reboots and rejoins as a spare, under a new name
        fresh = f"back{i}"
        h.where[fresh] = h.where[node]
        h.send(fresh, op="start")
        with h.lock:
            h.alive.add(fresh)
    return row


def run(a) -> tuple[dict[str, Any], list[str]]:
    h = Harness(a)
    problems: list[str] = []
    rows: list[dict[str, Any]] = []
    try:
        h.submit()
        h.watch()
        t0 = time.monotonic()
        h.start_sims()
        h.controller = h.start_controller()
        h.expect(1)
        first = h.wait_all_seen(a.timeout + a.nodes / 20)
        if first is None:
            raise RuntimeError(f"not every agent saw the first world within the timeout "
                               f"({len(h.pending)} of {len(h.alive)} still waiting)")
        setup_s = first - t0
        rng = random.Random(a.seed)
        for i in range(a.failures):
            kind = "node loss" if i % 2 == 0 else "worker exit"
            row = one_failure(h, i, kind, rng, a.timeout)
            rows.append(row)
            print(f"  {i + 1}/{a.failures} {kind:<11} latency {row['decision_latency_s']}", flush=True)
            if not row["ok"]:
                problems.append(f"failure {i + 1} ({kind} of {row['node']}): no new world seen by every agent "
                                f"within {a.timeout:.0f}s")
                break
            time.sleep(a.pause)
        mem = {"etcd_rss_mb": rss_mb(h.etcd.pid), "controller_rss_mb": rss_mb(h.controller.pid),
               "simulator_rss_mb": [rss_mb(p.pid) for p in h.procs if p is not h.controller]}
    except RuntimeError as e:
        problems.append(str(e))
        setup_s, mem = None, {}
    finally:
        if h.errors:
            problems.append(f"{len(h.errors)} agent read(s) failed, e.g. {h.errors[0]}")
        h.close()
    return {"setup_s": setup_s, "failures": rows, "memory": mem, "stats": stats(rows)}, problems


def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kind in ("node loss", "worker exit"):
        lat = sorted(r["decision_latency_s"] for r in rows if r["kind"] == kind and r["ok"])
        if not lat:
            continue
        reqs = [sum(r["etcd_requests"].get(m, 0) for m in ("Range", "Put", "Txn", "DeleteRange"))
                for r in rows if r["kind"] == kind and r["ok"]]
        out[kind] = {"n": len(lat), "p50_s": statistics.median(lat),
                     "p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
                     "controller_cpu_s": statistics.median(r["controller_cpu_s"] for r in rows if r["kind"] == kind),
                     "etcd_requests": statistics.median(reqs),
                     "commit_p50_s": statistics.median(r["detect_to_commit_s"] for r in rows
                                                       if r["kind"] == kind and r["ok"])}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_sim"]:
        return sim_main(argv[1:])
    if argv[:1] == ["--_pump"]:
        return pump_main(argv[1:])
    if "--model" in argv:  # the recovery model at 512 / 1,024 GPUs from results already measured
        from scale_model import main as model_main

        return model_main([x for x in argv if x != "--model"])
    p = base_parser(__doc__, "scale.json", "unused (see --failures)")
    p.add_argument("--nodes", type=int, default=100, help="active nodes (simulated agents holding ranks)")
    p.add_argument("--spares", type=int, default=4, help="spare nodes at the start")
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--failures", type=int, default=20, help="failures, alternately a node loss and a worker exit")
    p.add_argument("--lease-ttl", type=int, default=5)
    p.add_argument("--procs", type=int, default=2, help="processes the simulated agents share")
    p.add_argument("--readers", type=int, default=4, help="threads per process reading the job for its agents")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each decision")
    p.add_argument("--pause", type=float, default=1.0, help="seconds between failures")
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--model", action="store_true", help="start nothing: the recovery model at 512 / 1,024 GPUs "
                   "from measured results (--from PATH ..., --plot PATH, --json PATH; see scale_model.py)")
    p.add_argument("--agent-read", choices=("keys", "world", "prefix"), default="keys",
                   help="keys: what agents watch and read now (JobStore.agent_keys, the world patched "
                   "from its WorldChange); world: the same keys but the whole world read at every wake "
                   "and the ring buddies' records at every new world, as before 2026-12-05; prefix: the whole "
                   "job prefix on every event, as agents did before issue 15 (for comparison)")
    a = parse_args_smoke(p, argv, {"nodes": 50, "failures": 4, "lease_ttl": 3, "timeout": 120.0, "pause": 0.2})
    result, problems = run(a)
    rows = [(k, v["n"], f"{v['p50_s']:.3f}", f"{v['p99_s']:.3f}", f"{v['commit_p50_s']:.3f}",
             f"{v['controller_cpu_s']:.3f}", f"{v['etcd_requests']:.0f}") for k, v in result["stats"].items()]
    print(f"N = {a.nodes} nodes x {a.ranks_per_node} rank(s), {a.spares} spares, lease TTL {a.lease_ttl}s; "
          f"set-up (all registered, first world read by every agent) {result['setup_s']}")
    print(table(["failure", "n", "latency p50 s", "p99 s", "to commit p50 s", "controller CPU s", "etcd reqs"], rows))
    print(f"memory: {result['memory']}")
    write_json(a.json, {"benchmark": "scale", "smoke": a.smoke, "machine": machine_info(),
                        "args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
                        "result": result, "ok": not problems, "problems": problems})
    return finish("scale", problems)


if __name__ == "__main__":
    sys.exit(main())
