"""A worker process: warm first, then one rank of the job until it finishes or dies.

Started by its agent (``python -m hotspare.agents.worker``) before any rank is known, with the
environment of :class:`hotspare.agents.worker_link.WorkerEnv`. It connects to etcd, imports torch and
the job's entrypoint, marks itself warm, and blocks on one line on stdin: the
:class:`~hotspare.agents.worker_link.Assignment` ``{"rank", "epoch", "sid", "incarnation"}`` (the
agent's registration at the time of the assignment, which may be newer than the worker).
That warm start is what makes a swap fast: the spare's interpreter, torch and the user's
module are already loaded.

Exit codes (:mod:`hotspare.agents.worker_link`): 0 finished (or left before an assignment), 1 the
training function raised (a code error), 2 the job has no spec in etcd, 3 fenced (its rank
moved on without it), 4 unrecoverable (its state is gone everywhere; the reason is left in
:func:`~hotspare.agents.worker_link.fatal_path` for the agent to report), 5 the job's module
(or its ``warmup``) raised while warming up, 6 the training function raised but not because
of its code (:func:`not_the_code`: its group broke under it, or hotspare's own I/O failed).
For 1, 5 and 6 the traceback's end is left in :func:`~hotspare.agents.worker_link.error_path`.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from hotspare.orchestrator.store import JobStore, Store, StoreError
from hotspare.orchestrator.store.records import traceback_tail
from hotspare.recovery.bell import AGENT_BELL, Ringer

from .worker_link import (
    EXIT_ERROR,
    EXIT_FENCED,
    EXIT_INFRA_ERROR,
    EXIT_NO_SPEC,
    EXIT_OK,
    EXIT_STARTUP_ERROR,
    EXIT_UNRECOVERABLE,
    FINISHED,
    RUNNING,
    WARM,
    WORKER_STARTED,
    Assignment,
    Heartbeat,
    Raised,
    SpecTampered,
    WorkerEnv,
    fatal_path,
    pinned_spec,
)
from .zygote import die_with_agent

if TYPE_CHECKING:
    from hotspare.orchestrator.spec import JobSpec
    from hotspare.recovery.session import Session

__all__ = ["EXIT_FENCED", "EXIT_UNRECOVERABLE", "fatal_path", "load_entrypoint", "main", "prewarm_torch"]


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


T = TypeVar("T")


class StartupError(Exception):
    """The job's module (or its ``warmup``) raised while the worker warmed up."""


def _job_code(hb: Heartbeat, what: str, call: Callable[[], T]) -> T:
    """Run the job's own code while warming up. What it raises (a ``sys.exit()`` at import
    included: an ``argparse`` at module level) is a start-up error: the traceback goes to the
    slot log and, for the agent, next to the heartbeat; :class:`StartupError` says which part."""
    try:
        return call()
    except (Exception, SystemExit):  # noqa: BLE001 - any failure of the user's code
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        Raised(traceback_tail(text)).write(hb.path)
        raise StartupError(what) from None


def warm_up(env: WorkerEnv, hb: Heartbeat) -> tuple[Store, JobSpec, Callable] | None:
    """Pay every cost a swap would otherwise pay after the failure: torch, etcd, the job's
    module and its own ``warmup``. None if the job has no spec (deleted under us);
    :class:`StartupError` if the job's code raised."""
    import torch  # the expensive part of warming up

    import hotspare.recovery.session  # noqa: F401 - the training library too, loaded before the assignment

    torch.set_num_threads(env.threads)
    store = Store.from_env()
    try:  # the spec the agent validated, never re-read from etcd (docs/security.md)
        spec = pinned_spec(env.snap_dir, env.job) if env.snap_dir else JobStore(store, env.job).spec()
    except SpecTampered as e:
        print(f"worker refuses to start: {e}", file=sys.stderr)
        return None
    if spec is None:
        print(f"job {env.job} has no spec in etcd", file=sys.stderr)
        return None
    fn = _job_code(hb, f"loading {spec.entrypoint}", lambda: load_entrypoint(spec.entrypoint))
    if env.prewarm:
        prewarm_torch()
    warm = getattr(sys.modules.get(fn.__module__), "warmup", None)
    if callable(warm):  # the job's own warm-up (load data, build caches) before any rank
        _job_code(hb, "its warmup()", lambda: warm(**spec.args))
    hb.beat(-1, WARM)
    if env.snap_dir:  # the agent publishes its warm count when rung, not by polling
        bell = Ringer(Path(env.snap_dir) / AGENT_BELL)
        bell.ring()
        bell.close()
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


def not_the_code(e: BaseException, session: Session) -> str:
    """Why ``e``, raised by the training function, is not a code error ("" if it is one).

    A code error fails the job by default, so a crash must not pass for one. hotspare's own
    collectives -- every collective on ``session.process_group``, DDP's and FSDP2's included --
    never raise (a failure is recorded and the step rolled back), but one on another group
    (the raw ``session.process_group.backend``, a ``dist.new_group()``) does when a peer dies
    -- gloo raises a plain RuntimeError ("Connection closed by peer") -- and a step computed
    on a broken group may trip over its garbage. So: a c10d, rendezvous or etcd error anywhere
    in the exception's chain, a gloo/NCCL failure, an OSError raised inside hotspare (etcd,
    snapshot files), a group that recorded a failure, or an epoch that moved on."""
    import torch.distributed as dist

    from hotspare.orchestrator.store.c10d import RendezvousAborted
    from hotspare.recovery.process_group import EpochSuperseded, GroupBroken

    for x in _chain(e):
        if isinstance(x, (dist.DistError, EpochSuperseded, GroupBroken, RendezvousAborted, StoreError)):
            return f"a failure of its process group or of etcd ({type(x).__name__})"
        if isinstance(x, RuntimeError) and any(w in str(x) for w in ("gloo", "NCCL", "c10d")):
            return "a collective failed"
        if isinstance(x, OSError) and _through_hotspare(x):
            return "hotspare's own I/O failed"
    pg = session.process_group
    if pg.error is not None:
        return f"its process group failed ({pg.error})"
    if session.epoch > 0 and session.link.check_epoch() > session.epoch:
        return f"epoch {session.epoch} was superseded"
    return ""


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or while handling."""
    seen: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in seen and len(seen) < 16:
        seen.append(x)
        x = x.__cause__ or x.__context__
    return seen


def _through_hotspare(e: BaseException) -> bool:
    """Whether ``e`` was raised by hotspare's own code (called by the training function),
    not the user's: the innermost frame outside the standard library and installed packages
    (torch, ...) is one of hotspare's modules. A user's dataset failing to open a file inside
    a loader hotspare drives is still the user's."""
    libs = tuple({p for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")})
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        name = str(frame.f_globals.get("__name__", ""))
        if name.startswith("hotspare."):
            return True
        if not frame.f_code.co_filename.startswith(libs):
            return False
    return False


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
    except Exception as e:  # noqa: BLE001 - whatever the training function raised
        text = traceback.format_exc()
        traceback.print_exc()
        infra = not_the_code(e, session)
        Raised(traceback_tail(text), session.committed + 1 if session.epoch > 0 else -1).write(hb.path)
        if infra:
            logging.warning("%s: the training function raised after %s, not because of its code",
                            type(e).__name__, infra)
            return EXIT_INFRA_ERROR
        return EXIT_ERROR
    hb.beat(session.committed, FINISHED)
    logging.info("finished")
    return EXIT_OK


def main() -> int:
    """A warm worker's whole life, started by its agent or forked by a zygote
    (:mod:`hotspare.agents.zygote`); the exit code the agent reads."""
    env = WorkerEnv.from_env(os.environ)
    die_with_agent(env.agent_pid)  # a lost node loses its workers
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [{env.job} {env.node} pid{os.getpid()}] %(name)s: %(message)s",
    )
    logging.info(WORKER_STARTED)  # where this worker's part of its slot log begins (hotspare logs --rank)
    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) leaves every thread's stack in the log
    hb = Heartbeat(env.hb)
    try:
        warm = warm_up(env, hb)
    except StartupError as e:
        logging.error("the job's code raised while %s: it cannot start here", e)
        return EXIT_STARTUP_ERROR
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
