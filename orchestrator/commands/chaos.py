"""``hotspare chaos``: inject one failure, or random ones (punisher mode), into a running job.

Which actions exist, what they target and who carries them out is
:data:`hotspare.orchestrator.chaos.ACTIONS`; this module only delivers them: through etcd to the
node agent or the leader controller, or (restart-etcd) itself, on the embedded etcd.
"""

from __future__ import annotations

import argparse
import random
import time

from .. import chaos, embedded
from ..chaos import Executor, Target
from ..launchers.local import start_agent
from ..spec import JobSpec
from ..store import CONTROLLER, EventKind, JobStore
from .common import CliError, Command, export_for_children, job_spec, jobstore, state_dir

#: Deprecated: ``hotspare.orchestrator.chaos.AGENT_ACTIONS`` / ``CLI_ACTIONS``.
AGENT_ACTIONS = chaos.AGENT_ACTIONS
ALL_ACTIONS = chaos.CLI_ACTIONS
#: What punisher mode injects unless --kinds says otherwise.
DEFAULT_KINDS = "kill-rank,kill-node,hang-rank"
#: Timed actions that punisher mode gives no --seconds: a hung rank stays stopped until the
#: agent's watchdog kills it.
_UNTIMED_AT_RANDOM = ("hang-rank",)

#: ``hotspare chaos --help``: what each action does, as seen from the command line (an action
#: missing here is described by its help in the table).
_DETAIL = {
    "kill-rank": "SIGKILL the rank's worker (its agent reports it within 0.1 s)",
    "kill-node": "SIGKILL the node's agent and workers (noticed when its lease expires)",
    "hang-rank": "SIGSTOP the worker (the agent's watchdog kills it after hang_timeout)",
    "slow-rank": "make the worker sleep --seconds after every step (0 clears it); reported\n"
                 "                  as a straggler by `hotspare status`",
    "partition-node": "the agent stops its keepalive and replica traffic and freezes its workers\n"
                      "                  for --seconds; past the lease TTL it is fenced out and rejoins as a new node",
    "kill-controller": "SIGKILL the leader controller (a standby takes over)",
    "restart-etcd": "stop the embedded etcd for --seconds, then start it again",
}


def _restart_etcd(args: argparse.Namespace, js: JobStore, seconds: float | None) -> str:
    sd = state_dir(args)
    if embedded.load(sd) is None:
        raise CliError(f"restart-etcd works on the embedded etcd only; none is up in {sd}")
    secs = chaos.seconds_or_default("restart-etcd", seconds)
    js.event(EventKind.CHAOS, "cli", f"restart-etcd: etcd down for {secs:.1f}s", action="restart-etcd", seconds=secs)
    embedded.restart_etcd(sd, secs)
    js.event(EventKind.ETCD_RESTARTED, "cli", f"etcd back after {secs:.1f}s", action="restart-etcd")
    return f"etcd was stopped for {secs:.1f}s and is back"


#: Actions this process carries out itself.
_CLI_EXECUTED = {"restart-etcd": _restart_etcd}


def inject(args: argparse.Namespace, js: JobStore, action: str, rank: int | None, node: str | None,
           seconds: float | None) -> str:
    """Deliver one failure; returns a sentence saying what was done."""
    a = chaos.get(action)
    if a.executor is Executor.CLI:
        return _CLI_EXECUTED[action](args, js, seconds)
    if a.executor is Executor.CONTROLLER:
        js.send_chaos(CONTROLLER, {"action": action})
        return f"{action} sent to the leader controller"
    snap = js.snapshot()
    if node is None:
        if rank is None:
            raise CliError(f"{action} needs --rank R or --node NAME")
        if snap.world is None or not 0 <= rank < snap.world.size:
            raise CliError(f"rank {rank} is not in job {js.job}'s current world")
        node = snap.world.seats[rank].node
    elif rank is None and a.target is Target.RANK:
        raise CliError(f"{action} targets a rank: give --rank R")
    if node not in snap.nodes:
        raise CliError(f"node {node!r} is not a live node of {js.job} (live: {', '.join(sorted(snap.nodes))})")
    js.send_chaos(node, {"action": action, "rank": rank, "seconds": seconds})
    return f"{action} sent to {node}" + (f" (rank {rank})" if rank is not None else "")


def cmd_chaos(args: argparse.Namespace) -> int:
    js = jobstore(args)
    if args.mtbf is None:
        if not args.action:
            raise CliError("give --action ACTION (one failure) or --mtbf SECONDS (random failures)")
        print(inject(args, js, args.action, args.rank, args.node, args.seconds))
        return 0
    return _random_chaos(args, js)


def _kinds(args: argparse.Namespace) -> list[str]:
    kinds = [k.strip() for k in (args.kinds or DEFAULT_KINDS).split(",") if k.strip()]
    bad = [k for k in kinds if k not in chaos.CLI_ACTIONS]
    if bad:
        raise CliError(f"--kinds: unknown action(s) {', '.join(bad)} (known: {', '.join(chaos.CLI_ACTIONS)})")
    return kinds


def _random_chaos(args: argparse.Namespace, js: JobStore) -> int:
    """Punisher mode: failures at exponential intervals, seeded, until the job ends."""
    kinds = _kinds(args)
    rng = random.Random(args.seed)
    done = 0
    revive: list[tuple[float, str]] = []
    spec = job_spec(js)
    while args.count is None or done < args.count:
        deadline = time.monotonic() + rng.expovariate(1.0 / args.mtbf)
        while time.monotonic() < deadline:
            _revive_due(args, revive, js, spec)
            if js.state()[0].terminal:
                print(f"job {js.job} ended; {done} failure(s) injected")
                return 0
            time.sleep(0.2)
        snap = js.snapshot()
        if snap.world is None:
            continue
        kind = rng.choice(kinds)
        a = chaos.get(kind)
        rank = rng.randrange(snap.world.size)
        node = snap.world.seats[rank].node if a.target is Target.NODE else None
        seconds = args.seconds if a.timed and kind not in _UNTIMED_AT_RANDOM else None
        try:
            what = inject(args, js, kind, rank if node is None else None, node, seconds)
        except CliError as e:
            print(f"skipped {kind}: {e}")
            continue
        done += 1
        print(f"[{done}] {what}", flush=True)
        if kind == "kill-node" and args.revive is not None:
            revive.append((time.monotonic() + args.revive, node))
    print(f"{done} failure(s) injected")
    return 0


def _revive_due(args: argparse.Namespace, revive: list[tuple[float, str]], js: JobStore, spec: JobSpec) -> None:
    """Local backend: bring killed nodes back as spares (a rebooted machine rejoins)."""
    now = time.monotonic()
    for item in [r for r in revive if r[0] <= now]:
        revive.remove(item)
        export_for_children(args)
        start_agent(js.job, item[1], js.store.endpoints, spec.log_dir, spare=True)
        print(f"revived {item[1]} as a spare", flush=True)


# -- flags ------------------------------------------------------------------------------------
def _description() -> str:
    actions = "\n".join(f"  {n:<15} {_DETAIL.get(n) or chaos.ACTIONS[n].help}" for n in chaos.CLI_ACTIONS)
    return ("Inject one failure (--action) or random failures (--mtbf). Actions:\n" + actions
            + "\nEvery injection is an event (`hotspare events JOB`).")


def _arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job")
    sp.add_argument("--action", choices=chaos.CLI_ACTIONS, help="one failure to inject now")
    sp.add_argument("--rank", type=int, help="target rank (for node actions: the node hosting it)")
    sp.add_argument("--node", help="target node")
    sp.add_argument("--seconds", type=float, help="duration (partition-node, restart-etcd) or delay per step (slow-rank)")
    sp.add_argument("--mtbf", type=float, help="random mode: mean seconds between failures")
    sp.add_argument("--seed", type=int, default=0, help="random mode: seed (same seed, same schedule)")
    sp.add_argument("--kinds", help=f"random mode: comma-separated actions (default {DEFAULT_KINDS})")
    sp.add_argument("--count", type=int, help="random mode: stop after this many failures (default: until the job ends)")
    sp.add_argument("--revive", type=float, help="random mode, local backend: restart a killed node's agent as a spare after this many seconds")


COMMANDS = [
    Command("chaos", cmd_chaos, "inject failures into a running job (delivered through etcd)",
            _description(), _arguments, raw_description=True),
]
