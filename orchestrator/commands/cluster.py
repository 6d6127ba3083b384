"""The processes a cluster runs: the embedded etcd and controller on this machine (up, down),
and, in the foreground, one node agent, a controller, or a single-member etcd (what Slurm
steps, pods and Ray actors run).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

from .. import embedded
from ..etcd_server import EtcdServer, free_port
from ..spec import JobSpec, SpecError
from ..store import Conflict, EventKind, JobStore, Store, StoreUnavailable
from ..util import atomic_write
from .common import (
    CliError,
    Command,
    connect,
    endpoints,
    export_for_children,
    start_embedded,
    state_dir,
)


def cmd_up(args: argparse.Namespace) -> int:
    export_for_children(args)
    c = start_embedded(args, log=print)
    auth = f"user root, password in {c.password_file}" if c.password_file else "no authentication"
    print(f"etcd {c.endpoint} (pid {c.etcd_pid}; {auth}), controller pid {c.controller_pid}, state {c.state_dir}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    sd = state_dir(args)
    said = embedded.down(sd)
    for line in said:
        print(line)
    print(f"state kept in {sd}" if said else f"no embedded cluster was running ({sd})")
    return 0


def _default_node() -> str:
    return (os.environ.get("HOTSPARE_NODE") or os.environ.get("SLURMD_NODENAME")
            or socket.gethostname().split(".")[0])


def cmd_agent(args: argparse.Namespace) -> int:
    # loaded here, not at the top: the agent's modules are not needed by any other command
    from hotspare.agents.agent import Agent

    eps = endpoints(args)
    # the workers the agent starts connect as it does (Store.from_env)
    export_for_children(args, HOTSPARE_ETCD=",".join(eps))
    node = args.node or _default_node()
    agent = Agent(connect_patiently(args, eps, args.wait), args.job, node, role="spare" if args.spare else "active",
                  slots=args.slots, wait_for_job=args.wait, host=args.host, run_id=args.run_id,
                  etcd_outage_limit=args.etcd_outage_limit, zygote=args.zygote, spec_digest=args.spec_sha256)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    return agent.run()


#: seconds a starting controller waits for an etcd that does not answer (`hotspare up` and
#: `hotspare run` start it right after etcd reported healthy; a loaded machine can still be slow)
CONTROLLER_PATIENCE = 60.0


def connect_patiently(args: argparse.Namespace, eps: list[str], patience: float) -> Store:
    """:func:`connect`, retried while etcd is unreachable for up to ``patience`` seconds: a
    node agent or a controller may start before its etcd does (pods in any order) or while it
    is too busy to answer one ping. A wrong password or certificate fails at once."""
    deadline = time.monotonic() + patience
    said = 0.0
    while True:
        try:
            return connect(args, eps)
        except CliError as e:
            left = deadline - time.monotonic()
            if not isinstance(e.__cause__, StoreUnavailable) or left <= 0:
                raise
            if time.monotonic() - said >= 10:
                print(f"hotspare {args.cmd}: {e}; retrying for up to {left:.0f}s more", file=sys.stderr, flush=True)
                said = time.monotonic()
            time.sleep(min(1.0, left))


def _job_secret() -> bytes | None:
    """The job's HMAC secret as hex text: $HOTSPARE_JOB_SECRET_FILE (Slurm writes one) or
    $HOTSPARE_JOB_SECRET (a Kubernetes Secret); None: none given."""
    if os.environ.get("HOTSPARE_JOB_SECRET_FILE"):
        return Path(os.environ["HOTSPARE_JOB_SECRET_FILE"]).read_bytes().strip()
    if os.environ.get("HOTSPARE_JOB_SECRET"):
        return os.environ["HOTSPARE_JOB_SECRET"].encode()
    return None


def register_job(store: Store, spec_path: str) -> str:
    """Register a job from inside its cluster (backends that bring their own etcd).

    Idempotent: a restarted controller finds the job already there and leaves it alone, even
    if it has finished (re-registering would run it again). The job's secret comes from
    $HOTSPARE_JOB_SECRET_FILE or $HOTSPARE_JOB_SECRET (hex), else a fresh random one."""
    try:
        spec = JobSpec.from_dict(json.loads(Path(spec_path).read_text()))
    except (OSError, ValueError, TypeError, SpecError) as e:
        raise CliError(f"--register {spec_path}: not a resolved job spec ({e}); "
                       "write it with `hotspare submit --dry-run` or the launcher") from e
    js = JobStore(store, spec.name)
    if js.exists():
        return f"job {spec.name} already registered; leaving it as it is"
    secret = _job_secret()
    try:
        js.submit(spec, bytes.fromhex(secret.decode()) if secret else secrets.token_bytes(32))
    except ValueError as e:
        raise CliError(f"the job secret must be hex ({e})") from e
    except Conflict:
        return f"job {spec.name} registered concurrently by another controller"
    js.event(EventKind.SUBMITTED, "controller", f"job {spec.name}: {spec.ranks} ranks + {spec.spares} spare "
             f"node(s), {spec.steps} steps on {spec.backend}")
    return f"registered job {spec.name}"


def cmd_controller(args: argparse.Namespace) -> int:
    # loaded here, not at the top: the controller's modules are not needed by any other command
    from ..controller import Controller

    # a controller that gave up on a busy etcd at start left its jobs unplaced, with nobody to say so
    st = connect_patiently(args, endpoints(args), CONTROLLER_PATIENCE)
    if args.register:
        print(register_job(st, args.register), flush=True)
    c = Controller(st, ttl=args.leader_ttl, job=args.job)
    signal.signal(signal.SIGTERM, lambda *_: c.stop())
    c.run()
    return 0


def _host_address() -> str:
    """This machine's address as peers see it: $HOTSPARE_HOST, else the hostname's address."""
    if os.environ.get("HOTSPARE_HOST"):
        return os.environ["HOTSPARE_HOST"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def cmd_etcd(args: argparse.Namespace) -> int:
    """A single-member etcd in the foreground (inside a Slurm allocation, a container, ...)."""
    host = args.host or _host_address()
    tls = None
    if args.tls_dir:  # TLS with client certificates, made for this job (hotspare.orchestrator.etcd_tls)
        from ..etcd_tls import PkiError, make

        try:
            tls = make(args.tls_dir, host)
        except (PkiError, OSError) as e:
            raise CliError(f"etcd's certificates: {e}") from e
    srv = EtcdServer(Path(args.data_dir), args.port or free_port(), free_port(), host=host, tls=tls)
    srv.start(log_path=Path(args.log) if args.log else None)
    try:
        srv.wait_ready()
    except (RuntimeError, TimeoutError) as e:
        srv.stop()
        raise CliError(f"etcd did not start: {e}" + (f" (log: {args.log})" if args.log else "")) from e
    if args.endpoints_file:  # whole or absent: the Slurm script polls for it
        atomic_write(args.endpoints_file, srv.endpoint + "\n", fsync=False, mode=0o666)
    print(f"etcd ready at {srv.endpoint} (pid {srv.pid})", flush=True)
    stop = lambda *_: srv.stop()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rc = srv.proc.wait()
    return 0 if rc in (0, -signal.SIGTERM) else rc


# -- flags ------------------------------------------------------------------------------------
class _Renamed(argparse.Action):
    """A flag's old name: still accepted (hidden from --help), with a warning naming the new one."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: object) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"hotspare: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _agent_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--job", required=True)
    sp.add_argument("--node", help="this node's name, unique in the job (default: $HOTSPARE_NODE, "
                    "$SLURMD_NODENAME, else the short hostname)")
    sp.add_argument("--host", default=os.environ.get("HOTSPARE_HOST", "127.0.0.1"),
                    help="address peers reach this node's replica server at (default: $HOTSPARE_HOST "
                    "or 127.0.0.1; on a real cluster, the node's IP)")
    sp.add_argument("--spare", action="store_true", help="register as a hot spare")
    sp.add_argument("--slots", type=int, help="worker slots (default: the spec's ranks_per_node)")
    sp.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the job to be submitted")
    sp.add_argument("--run-id", help="serve only this submission of the job (launchers pass it; default: "
                    "whichever the job's spec names); the agent leaves when the job is submitted again")
    sp.add_argument("--spec-sha256", metavar="HEX", default=os.environ.get("HOTSPARE_SPEC_SHA256") or None,
                    help="the digest of the spec as submitted (launchers pass it; default: $HOTSPARE_SPEC_SHA256): "
                    "the agent refuses a spec in etcd that differs, i.e. one changed by someone who can write etcd")
    sp.add_argument("--etcd-outage-limit", type=float, metavar="SECONDS",
                    help="leave (stopping the workers) once etcd has been unreachable this long "
                    "(default: max(60, 10 x the spec's lease_ttl))")
    sp.add_argument("--zygote", metavar="PATH|off", default=os.environ.get("HOTSPARE_ZYGOTE") or None,
                    help="fork warm workers from the zygote listening at PATH (one shared by this "
                    "machine's agents: the local backend starts one); 'off': start every worker as "
                    "its own process. Default: $HOTSPARE_ZYGOTE, else a zygote of the agent's own, "
                    "which imports torch once instead of once per worker")


def _controller_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--job", help="only this job (default: every job in this etcd)")
    sp.add_argument("--leader-ttl", type=float, default=embedded.LEADER_TTL,
                    help="leader lease TTL in seconds: how long a standby waits to take over a dead "
                    "leader's jobs (not the spec's lease_ttl)")
    sp.add_argument("--ttl", action=_Renamed, new="--leader-ttl", dest="leader_ttl", type=float)
    sp.add_argument("--register", metavar="SPEC_JSON", help="first register this job (a resolved spec "
                    "as JSON) unless it exists: for backends whose etcd starts inside the cluster")


def _etcd_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--data-dir", required=True)
    sp.add_argument("--endpoints-file", help="write the client URL here when ready (atomically)")
    sp.add_argument("--host", help="address to advertise (default: $HOTSPARE_HOST, else this host's address)")
    sp.add_argument("--port", type=int, help="client port (default: a free one)")
    sp.add_argument("--log", help="etcd's log file")
    sp.add_argument("--tls-dir", metavar="DIR",
                    help="serve TLS and require client certificates, all made for this etcd in DIR (0700): "
                    "clients use DIR/ca.crt, DIR/client.crt, DIR/client.key (the Slurm backend does this)")


EMBEDDED = [
    Command("up", cmd_up, "start the embedded etcd and controller on this machine",
            "Start a private etcd on a free loopback port and a controller, as daemons. Idempotent. "
            "The etcd requires a password, generated at the first `up` into STATE_DIR/etcd-password "
            "(0600; the state dir is 0700): every hotspare process of this user finds it there."),
    Command("down", cmd_down, "stop the embedded etcd and controller (the state dir is kept)"),
]
DAEMONS = [
    Command("agent", cmd_agent, "run one node agent (what each node of a cluster runs)",
            "Run one node agent in the foreground: it registers NODE under a lease, keeps warm "
            "workers and runs the ranks the controller assigns to it.", _agent_arguments),
    Command("controller", cmd_controller, "run a controller (leader-elected; a second one is a standby)",
            arguments=_controller_arguments),
    Command("etcd", cmd_etcd, "run a single-member etcd in the foreground (used inside Slurm allocations)",
            "Run etcd on this machine, listening on all interfaces, advertising --host; writes its "
            "endpoint to --endpoints-file once it is healthy. Stops on SIGTERM.", _etcd_arguments),
]
COMMANDS = EMBEDDED + DAEMONS
