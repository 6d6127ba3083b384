"""``hotspare checkpoint``: persist a job's state now, out of the persist_every schedule.

The request names a replication point every rank has yet to reach (ranks only flush the
snapshot of a point); the agents persist it as their ranks pass it. If some rank passed it
before its agent saw the request, the request is repeated further ahead.
"""

from __future__ import annotations

import argparse
import time

from hotspare.recovery import persist

from ..spec import JobSpec
from ..status import next_point
from ..store import EventKind, JobStore
from .common import CliError, Command, jobstore

#: Seconds first allowed for the request to reach every agent (doubled on each retry).
MARGIN_S = 2.0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Persist the job's state at an upcoming replication point, out of schedule."""
    js = jobstore(args)
    snap = js.snapshot()
    if snap.spec is None:
        raise CliError(f"no job {args.job!r} in this etcd")
    spec = snap.spec
    if snap.state.terminal:
        raise CliError(f"job {args.job} is {snap.state.value}; its final state is in {spec.output_dir}/final")
    if not spec.replication_enabled:
        raise CliError("persisting needs replication points: this job runs with replicas: 0")
    margin = MARGIN_S
    start = time.monotonic()
    while True:
        step = next_point(snap, spec.replicate_every, margin)
        if step >= spec.steps:
            newest = max((p.step for p in snap.progress.values()), default=-1)
            raise CliError(f"job {args.job} is at step {newest} of {spec.steps}: no replication point "
                           f"(every {spec.replicate_every} steps) is left before the end; the final state "
                           "will be written")
        js.request_checkpoint(step)
        print(f"checkpoint requested at step {step} (a replication point); it goes to "
              f"{persist.checkpoint_path(spec.persist_root, step)}", flush=True)
        if args.no_wait:
            return 0
        if _persisted(args, js, spec, step, start):
            print(f"persisted: {persist.checkpoint_path(spec.persist_root, step)} (manifest written)")
            return 0
        margin *= 2
        print(f"step {step} passed before every agent saw the request; asking again further ahead", flush=True)
        snap = js.snapshot()


def _persisted(args: argparse.Namespace, js: JobStore, spec: JobSpec, step: int, start: float) -> bool:
    """Wait until ``step``'s checkpoint is complete (True), or every rank is two points past
    it without it (False: the request came too late for some agent). CliError if it failed,
    the job ended, or --timeout passed."""
    every = spec.replicate_every
    while step not in persist.complete_steps(spec.persist_root):
        failed = [e for e in js.events() if e.kind == EventKind.PERSIST_FAILED and e.data.get("step") == step]
        if failed:
            raise CliError(failed[0].message)
        snap = js.snapshot()
        if snap.state.terminal:
            raise CliError(f"job {args.job} ended before step {step} was persisted")
        if args.timeout and time.monotonic() - start > args.timeout:
            raise CliError(f"step {step} not persisted after --timeout {args.timeout:.0f}s")
        if snap.progress and min(p.step for p in snap.progress.values()) >= step + 3 * every:
            return False
        time.sleep(0.2)
    return True


def _arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job")
    sp.add_argument("--no-wait", action="store_true", help="return once requested")
    sp.add_argument("--timeout", type=float, default=300, help="seconds to wait (default 300)")


COMMANDS = [
    Command("checkpoint", cmd_checkpoint, "persist a job's state now (at its next replication point)",
            "Ask every rank to flush its snapshot of the next replication point to the persistent "
            "tier (persist_path, default <output_dir>/checkpoints), then wait until the checkpoint "
            "is complete (its manifest is written).", _arguments),
]
