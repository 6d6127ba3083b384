"""``hotspare``: submit, watch and break fault-tolerant training jobs.

The entry point (``hotspare = hotspare.orchestrator.cli:main``, ``python -m hotspare.orchestrator.cli``): the
parser and the mapping of errors to one line and exit code 2. The subcommands live in
:mod:`hotspare.orchestrator.commands`, one module per area.

Where is etcd? ``--etcd URL[,URL]`` or ``$HOTSPARE_ETCD``; otherwise the embedded cluster
recorded under ``--state-dir`` (``$HOTSPARE_STATE_DIR``, default ``~/.hotspare``).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import traceback

from hotspare.recovery.persist import CheckpointError

from .commands import chaos, checkpoint, cluster, jobs, observe
from .commands.chaos import AGENT_ACTIONS, ALL_ACTIONS, inject
from .commands.cluster import register_job
from .commands.common import CliError, Command, EtcdSettings
from .launchers import LaunchError
from .store import StoreError

__all__ = ["AGENT_ACTIONS", "ALL_ACTIONS", "CliError", "build_parser", "inject", "main", "register_job"]

EPILOG = """\
examples:
  hotspare run configs/demo.yaml          submit, watch progress, print the recovery summary
  hotspare status demo                    ranks, nodes, steps, spares, epoch
  hotspare events demo                    the timeline with each recovery's phases
  hotspare chaos demo --action kill-rank --rank 2
"""

#: Every subcommand, in the order ``hotspare --help`` lists them.
COMMANDS: list[Command] = [
    *cluster.EMBEDDED, *jobs.COMMANDS[:2], *observe.COMMANDS, *checkpoint.COMMANDS, *jobs.COMMANDS[2:],
    *chaos.COMMANDS, *cluster.DAEMONS,
]


def _common_flags() -> argparse.ArgumentParser:
    """Where etcd is and how to authenticate: every subcommand takes these."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--etcd", help="etcd endpoint(s), comma-separated (default: $HOTSPARE_ETCD, "
                        "else the embedded cluster)")
    common.add_argument("--state-dir", help="embedded cluster state (default: $HOTSPARE_STATE_DIR or ~/.hotspare)")
    common.add_argument("--etcd-ca", metavar="PEM", help="CA certificate of an https:// etcd "
                        "(default: $HOTSPARE_ETCD_CA, else the spec's etcd.ca_cert)")
    common.add_argument("--etcd-cert", metavar="PEM", help="client certificate for etcd (default: $HOTSPARE_ETCD_CERT)")
    common.add_argument("--etcd-key", metavar="PEM", help="client key for etcd (default: $HOTSPARE_ETCD_KEY)")
    common.add_argument("--etcd-user", help="etcd user (default: $HOTSPARE_ETCD_USER); the password comes "
                        "from $HOTSPARE_ETCD_PASSWORD or --etcd-password-file, never a flag")
    common.add_argument("--etcd-password-file", metavar="FILE", help="file whose first line is the etcd "
                        "password (default: $HOTSPARE_ETCD_PASSWORD_FILE)")
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common_flags()
    p = argparse.ArgumentParser(
        prog="hotspare", description="Fault-tolerant elastic training for PyTorch: a failed rank is "
        "replaced by a warm hot spare while every other process keeps running.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for c in COMMANDS:
        sp = sub.add_parser(c.name, parents=[common], help=c.help, description=c.description or c.help)
        if c.raw_description:
            sp.formatter_class = argparse.RawDescriptionHelpFormatter
        sp.set_defaults(fn=c.run)
        if c.arguments is not None:
            c.arguments(sp)
    return p


#: Commands that run unattended, their output a log: an unexpected error also prints its traceback.
DAEMONS = frozenset({"agent", "controller"})


def _error_line(e: BaseException) -> str:
    """What follows ``hotspare CMD: error: ``."""
    if isinstance(e, (CliError, LaunchError, CheckpointError)):  # LaunchError: a scheduler tool
        return str(e)  # missing or refusing (cancel, status, ...); CheckpointError names the file
    if isinstance(e, StoreError):
        return f"etcd: {e}"
    if isinstance(e, subprocess.TimeoutExpired):
        cmd = " ".join(map(str, e.cmd)) if isinstance(e.cmd, (list, tuple)) else str(e.cmd)
        return f"`{cmd}` did not answer within {e.timeout:.0f}s; is the scheduler reachable from here?"
    if isinstance(e, OSError):  # a file we were asked to write or read (output_dir, a spec, ...)
        return (f"{e.filename}: " if e.filename else "") + f"{e.strerror or e}"
    return str(e)


def _reader_gone() -> int:
    """stdout was closed early (``hotspare events JOB | head``): the reader has what it wanted.
    Exit quietly, with stdout pointed at /dev/null so that the interpreter's last flush does
    not complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # gRPC's core logs TLS handshake failures to stderr on its own; ours say what they mean
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    args.etcd_settings = EtcdSettings.from_flags(args)
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is caught below
        return rc
    except BrokenPipeError:
        return _reader_gone()
    except (CliError, StoreError, LaunchError, CheckpointError, subprocess.TimeoutExpired, OSError) as e:
        if args.cmd in DAEMONS and not isinstance(e, CliError) and not getattr(e, "hotspare_logged", False):
            traceback.print_exc()  # its log is the evidence: where it failed
        print(f"hotspare {args.cmd}: error: {_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
