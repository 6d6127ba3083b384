"""A worker process: warm first, then one rank of the job until it finishes or dies.

Started by its agent before any rank is known. It connects to etcd, imports torch and
the job's entrypoint, marks itself warm, and blocks on one JSON line on stdin — the
assignment ``{"rank": r, "epoch": e, "sid": s, "incarnation": i}`` (the agent's registration at the
time of the assignment, which may be newer than the worker). That warm start is what makes a swap fast: the
spare's interpreter, torch and the user's module are already loaded.

Exit codes: 0 finished, 1 the training function raised, 3 fenced (rank taken away).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from .heartbeat import FINISHED, RUNNING, WARM, Heartbeat


def die_with_parent() -> None:
    """Linux: SIGKILL this worker if its agent dies (a lost node loses its workers)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


#: exit codes the agent tells apart: a fenced worker (its rank moved on without it) and one
#: whose rank's state cannot be restored from anywhere (reported as a "fatal" loss: the
#: controller fails the job with the reason instead of trying spare after spare)
EXIT_FENCED = 3
EXIT_UNRECOVERABLE = 4


def fatal_path(hb_path: Path) -> Path:
    """Where a worker leaves the reason it cannot go on, for its agent to report."""
    return hb_path.with_name(hb_path.name + ".fatal")


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


def main() -> int:
    die_with_parent()
    env = os.environ
    job, node = env["HOTSPARE_JOB"], env["HOTSPARE_NODE"]
    log_dir = Path(env["HOTSPARE_LOG_DIR"])
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [{job} {node} pid{os.getpid()}] %(name)s: %(message)s",
    )
    hb = Heartbeat(env["HOTSPARE_HB"])

    import torch  # the expensive part of warming up

    from orchestrator.store import JobStore
    from recovery.session import Fenced, Session, Unrecoverable

    from .agent import store_from_env

    torch.set_num_threads(int(env.get("HOTSPARE_THREADS", "1")))
    store = store_from_env()
    spec = JobStore(store, job).spec()
    if spec is None:
        print(f"job {job} has no spec in etcd", file=sys.stderr)
        return 2
    fn = load_entrypoint(spec.entrypoint)
    prewarm_torch()
    warm = getattr(sys.modules.get(fn.__module__), "warmup", None)
    if callable(warm):  # the job's own warm-up (load data, build caches) before any rank
        warm(**spec.args)
    hb.beat(-1, WARM)

    line = sys.stdin.readline()
    if not line.strip():
        return 0  # agent went away or asked us to leave before an assignment
    assign = json.loads(line)
    rank, epoch = int(assign["rank"]), int(assign["epoch"])
    out = open(log_dir / f"rank{rank}.log", "ab", buffering=0)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    logging.getLogger().handlers[0].setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s [rank{rank} {node} pid{os.getpid()}] %(message)s")
    )
    logging.info("assigned rank %d at epoch %d", rank, epoch)
    hb.beat(-1, RUNNING)
    session = Session(
        store=store,
        job=job,
        spec=spec,
        rank=rank,
        sid=assign.get("sid"),
        epoch=epoch,
        node=node,
        incarnation=assign.get("incarnation") or env["HOTSPARE_INCARNATION"],
        beat=lambda step: hb.beat(step),
        agent_pid=int(env.get("HOTSPARE_AGENT_PID", "0")),
        delay=hb.delay,
    )
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
        return 1
    hb.beat(session.committed, FINISHED)
    logging.info("finished")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: abandoned gloo work must not block exit
