"""A worker process: warm first, then one rank of the job until it finishes or dies.

Started by its agent (``python -m hotspare.agents.worker``) before any rank is known, with the
environment of :class:`hotspare.agents.worker_link.WorkerEnv`. It connects to etcd, imports torch and
the job's entrypoint, marks itself warm, and blocks on one line on stdin: the
:class:`~hotspare.agents.worker_link.Assignment` ``{"rank", "epoch", "sid", "incarnation"}`` (the
agent's registration at the time of the assignment, which may be newer than the worker).
That warm start is what makes a swap fast: the spare's interpreter, torch and the user's
module are already loaded.

Exit codes (:mod:`hotspare.agents.worker_link`): 0 finished (or left before an assignment), 1 the
training function raised, 2 the job has no spec in etcd, 3 fenced (its rank moved on
without it), 4 unrecoverable (its state is gone everywhere; the reason is left in
:func:`~hotspare.agents.worker_link.fatal_path` for the agent to report).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hotspare.orchestrator.store import JobStore, Store

from .worker_link import (
    EXIT_ERROR,
    EXIT_FENCED,
    EXIT_NO_SPEC,
    EXIT_OK,
    EXIT_UNRECOVERABLE,
    FINISHED,
    RUNNING,
    WARM,
    Assignment,
    Heartbeat,
    WorkerEnv,
    fatal_path,
)

if TYPE_CHECKING:
    from hotspare.orchestrator.spec import JobSpec
    from hotspare.recovery.session import Session

__all__ = ["EXIT_FENCED", "EXIT_UNRECOVERABLE", "fatal_path", "load_entrypoint", "main", "prewarm_torch"]


def die_with_parent() -> None:
    """Linux: SIGKILL this worker if its agent dies (a lost node loses its workers)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def load_entrypoint(entrypoint: str) -> Callable:
    """``pkg.module:function`` or ``/abs/path/file.py:function``."""
    target, _, func = entrypoint.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(f"hotspare_entry_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    else:
        # like `python -m`: the user's package is found from the current directory (the
        # worker was started without it on the path, see worker_link.worker_command)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        mod = importlib.import_module(target)
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise ImportError(f"entrypoint {entrypoint!r}: {func!r} is not a function in {target}")
    return fn


def prewarm_torch() -> None:
    """Pay torch's lazy imports now, not after the assignment: the first optimizer built
    imports torch._dynamo (~1.5 s on a small CPU), the first backward the autograd engine."""
    import torch

    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    (p * 2).sum().backward()
    opt.step()
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def warm_up(env: WorkerEnv, hb: Heartbeat) -> tuple[Store, JobSpec, Callable] | None:
    """Pay every cost a swap would otherwise pay after the failure: torch, etcd, the job's
    module and its own ``warmup``. None if the job has no spec (deleted under us)."""
    import torch  # the expensive part of warming up

    import hotspare.recovery.session  # noqa: F401 - the training library too, loaded before the assignment

    torch.set_num_threads(env.threads)
    store = Store.from_env()
    spec = JobStore(store, env.job).spec()
    if spec is None:
        print(f"job {env.job} has no spec in etcd", file=sys.stderr)
        return None
    fn = load_entrypoint(spec.entrypoint)
    prewarm_torch()
    warm = getattr(sys.modules.get(fn.__module__), "warmup", None)
    if callable(warm):  # the job's own warm-up (load data, build caches) before any rank
        warm(**spec.args)
    hb.beat(-1, WARM)
    return store, spec, fn


def wait_for_assignment() -> Assignment | None:
    """Block until the agent gives us a seat; None if it went away or asked us to leave."""
    line = sys.stdin.readline()
    return Assignment.from_line(line) if line.strip() else None


def redirect_output(log_dir: Path, rank: int, node: str) -> None:
    """From here on everything the rank prints goes to its own log, ``rank<r>.log``."""
    out = open(log_dir / f"rank{rank}.log", "ab", buffering=0)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    logging.getLogger().handlers[0].setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s [rank{rank} {node} pid{os.getpid()}] %(message)s")
    )


def run(fn: Callable, session: Session, spec: JobSpec, hb: Heartbeat) -> int:
    """Run the training function; map how it ended to the exit code the agent reads."""
    from hotspare.recovery.session import Fenced, Unrecoverable

    try:
        fn(session, **spec.args)
    except Fenced as f:
        logging.warning("fenced: %s; exiting", f.why)
        return EXIT_FENCED
    except Unrecoverable as e:
        logging.error("unrecoverable: %s", e)
        try:  # the agent reports it, with this text, as a fatal loss: the job fails with it
            fatal_path(hb.path).write_text(str(e))
        except OSError:
            pass
        return EXIT_UNRECOVERABLE
    except Exception:
        traceback.print_exc()
        return EXIT_ERROR
    hb.beat(session.committed, FINISHED)
    logging.info("finished")
    return EXIT_OK


def main() -> int:
    die_with_parent()
    env = WorkerEnv.from_env(os.environ)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [{env.job} {env.node} pid{os.getpid()}] %(name)s: %(message)s",
    )
    hb = Heartbeat(env.hb)
    warm = warm_up(env, hb)
    if warm is None:
        return EXIT_NO_SPEC
    store, spec, fn = warm
    a = wait_for_assignment()
    if a is None:
        return EXIT_OK
    redirect_output(Path(env.log_dir), a.rank, env.node)
    logging.info("assigned rank %d at epoch %d", a.rank, a.epoch)
    hb.beat(-1, RUNNING)
    from hotspare.recovery.session import Session

    session = Session(
        store=store,
        job=env.job,
        spec=spec,
        rank=a.rank,
        sid=a.sid,
        epoch=a.epoch,
        node=env.node,
        incarnation=a.incarnation or env.incarnation,
        beat=lambda step: hb.beat(step),
        agent_pid=env.agent_pid,
        delay=hb.delay,
        snap_dir=Path(env.snap_dir) if env.snap_dir else None,
        snapshot_delay=float(os.environ.get("HOTSPARE_TEST_SNAPSHOT_DELAY") or 0),  # tests widen a window
    )
    return run(fn, session, spec, hb)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: abandoned gloo work must not block exit
