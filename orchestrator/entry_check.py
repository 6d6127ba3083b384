"""Check a job's entrypoint before anything starts: does it import, is the function there, does
it accept ``session`` plus the spec's ``args``?

Without this check a misspelled function or a syntax error is found by every warm worker, after
etcd, the controller and the agents are up. The check runs in a subprocess (importing the user's
module runs arbitrary code and usually torch, which the CLI never imports) that is started the
way an agent starts a worker: the same interpreter and boot code
(:func:`hotspare.agents.worker_link.worker_command`, which drops the current directory from
``sys.path``), the environment plus the spec's ``env``, the same current directory, torch
imported before the user's module, and the worker's own
:func:`hotspare.agents.worker.load_entrypoint`. The subprocess writes one JSON line, on a copy of
its stdout made before the user's module can print anything (prints go to stderr).

What the check costs is the time to import the user's module (with torch); it runs no
``warmup`` and no training code.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotspare.agents.worker_link import worker_command

__all__ = ["CODE_KINDS", "EntryError", "EntryProblem", "check_entrypoint", "require"]

#: Where the subprocess finds what to check (popped before the user's module is imported).
_INPUT_ENV = "HOTSPARE_ENTRY_CHECK"
#: Problems in the code itself, the same on any machine: refused on every backend. The others
#: (a module or dependency not importable here, an error raised at import time, a timeout)
#: may be this machine's environment rather than the cluster's.
CODE_KINDS = frozenset({"syntax", "missing", "args"})
SKIP_HINT = "--no-check skips this check"


class EntryError(Exception):
    """The entrypoint cannot run: one sentence, for the CLI to print."""


@dataclass(frozen=True)
class EntryProblem:
    """Why the entrypoint would not run: ``kind`` (``syntax``, ``import``, ``raised``,
    ``missing``, ``args``, ``timeout``) and one sentence naming what is wrong and the fix."""

    kind: str
    message: str

    @property
    def about_code(self) -> bool:
        return self.kind in CODE_KINDS


def check_entrypoint(entrypoint: str, args: Mapping[str, Any], env: Mapping[str, str] | None = None, *,
                     cwd: str | os.PathLike[str] | None = None, timeout: float = 60.0,
                     python: str | None = None) -> EntryProblem | None:
    """Import ``entrypoint`` in a worker-like subprocess and bind ``(session, **args)`` to it;
    None if a worker would get as far as calling it. ``env`` is the spec's ``env`` (on top of
    this process's environment); ``cwd`` the directory the workers start in (a module
    entrypoint is imported from there)."""
    full = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
            _INPUT_ENV: json.dumps({"entrypoint": entrypoint, "args": dict(args)})}
    cmd = worker_command(python, module=__name__)
    try:
        r = subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return EntryProblem("timeout", f"importing entrypoint {entrypoint} took longer than {timeout:.0f}s, "
                                       "so it was not checked; move slow work out of import time (into "
                                       f"train or warmup) or use {SKIP_HINT.replace(' skips', ' to skip')}")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return EntryProblem("raised", f"checking entrypoint {entrypoint} failed: the check process exited "
                                      f"{r.returncode} ({tail}); {SKIP_HINT}")
    result = json.loads(lines[-1])
    return None if result.get("ok") else EntryProblem(result["kind"], result["message"])


def require(entrypoint: str, args: Mapping[str, Any], env: Mapping[str, str], backend: str,
            warn: Callable[[str], None]) -> None:
    """The CLI's policy. Backend ``local``: the workers run here, with this environment, so any
    problem is refused (:class:`EntryError`). Other backends run the job elsewhere (another
    image, another Python): a problem in the code itself (syntax, missing function, arguments)
    is still refused, one that may be this machine's environment only warned about."""
    problem = check_entrypoint(entrypoint, args, env)
    if problem is None:
        return
    if backend == "local" or problem.about_code:
        raise EntryError(f"{problem.message} ({SKIP_HINT})" if problem.kind != "timeout" else problem.message)
    warn(f"warning: {problem.message} -- submitting anyway: the job runs on {backend}, whose "
         f"environment may differ from this machine's ({SKIP_HINT})")


# -- the subprocess ---------------------------------------------------------------------------
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.add(str(Path(__file__).resolve().parents[1]))  # hotspare's own checkout or install
    return tuple(os.path.join(d, "") for d in dirs)


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame in the user's code (else the innermost one)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    if not frames:
        return "?"
    libs = _library_dirs()
    mine = [f for f in frames if not os.path.abspath(f.filename).startswith(libs)]
    f = (mine or frames)[-1]
    return f"{f.filename}:{f.lineno}"


def _import_problem(entrypoint: str, exc: BaseException) -> tuple[str, str]:
    target = entrypoint.rpartition(":")[0]
    if isinstance(exc, SyntaxError):
        what = "indentation error" if isinstance(exc, IndentationError) else "syntax error"
        return "syntax", (f"entrypoint {entrypoint} does not import: {what} at {exc.filename}:{exc.lineno}: "
                          f"{exc.msg}; fix that line")
    if isinstance(exc, ModuleNotFoundError) and exc.name and (target == exc.name
                                                              or target.startswith(exc.name + ".")):
        return "import", (f"entrypoint {entrypoint}: no module named {exc.name!r} under {os.getcwd()}, the "
                          "directory the workers start in (a module entrypoint is imported from there, "
                          "as `python -m` does); run hotspare from the package's parent directory, "
                          "install it, or name a file (path/to/file.py:function)")
    if isinstance(exc, ImportError):
        return "import", (f"entrypoint {entrypoint} does not import: {type(exc).__name__}: {exc} at "
                          f"{_where(exc)}; install the missing module or set PYTHONPATH in the spec's env")
    return "raised", (f"entrypoint {entrypoint} raised while importing: {type(exc).__name__}: {exc} at "
                      f"{_where(exc)}; fix the module's top-level code")


def _missing_function(entrypoint: str, module: Any) -> str:
    target, _, func = entrypoint.rpartition(":")
    found = getattr(module, func, None)
    if found is not None:
        return (f"entrypoint {entrypoint}: {func!r} in {target} is a {type(found).__name__}, not a function; "
                f"point the spec's entrypoint at the training function")
    defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__)
    close = difflib.get_close_matches(func, defined, n=1)
    there = f"it defines {', '.join(defined)}" if defined else "it defines no public functions"
    fix = f"did you mean {close[0]!r}?" if close else "name the training function in the spec's entrypoint"
    return f"entrypoint {entrypoint}: no function {func!r} in {target} ({there}); {fix}"


def _args_problem(label: str, fn: Callable, args: Mapping[str, Any], *, session: bool = True) -> str | None:
    """Why ``fn(session, **args)`` (``fn(**args)`` without ``session``) would raise TypeError
    before running; None if it would not."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C function: nothing to check
    try:
        sig.bind(*([object()] if session else []), **args)
        return None
    except TypeError as e:
        reason = str(e)
    params = list(sig.parameters.values())
    shown = f"{getattr(fn, '__name__', 'the function')}({', '.join(str(p) for p in params)})"
    rest = {p.name: p for p in params}
    if session:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        if not positional:
            return f"entrypoint {label}: {shown} takes no session; make the session its first parameter"
        first = positional[0]
        if first.name in args and first.kind != first.VAR_POSITIONAL:
            return (f"entrypoint {label}: args.{first.name} collides with {shown}'s session parameter; "
                    "rename that argument")
        rest.pop(first.name)
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        unknown = [k for k in args if k not in rest or rest[k].kind in (rest[k].POSITIONAL_ONLY, rest[k].VAR_POSITIONAL)]
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(rest), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return (f"entrypoint {label}: {shown} has no parameter {unknown[0]!r}, which the spec's "
                    f"args give{hint}; fix args in the spec or add the parameter")
    missing = [p.name for p in rest.values() if p.default is p.empty and p.name not in args
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        return (f"entrypoint {label}: {shown} needs argument {missing[0]!r}, which the spec's args do "
                f"not give; add args.{missing[0]} to the spec or give the parameter a default")
    return f"entrypoint {label}: {shown} cannot be called with the spec's args: {reason}"


def _entry_module(entrypoint: str) -> Any:
    """The module load_entrypoint loaded for ``entrypoint`` (None if it did not get that far)."""
    target = entrypoint.rpartition(":")[0]
    name = f"hotspare_entry_{Path(target).stem}" if target.endswith(".py") else target
    return sys.modules.get(name)


def _shadows_an_installed_module(entrypoint: str) -> bool:
    """Whether the directory the worker puts on ``sys.path`` for this entrypoint holds a module
    named like an installed one (a ``numpy.py``, a ``torch/``). Only then does it matter that the
    worker imported torch before the user's module; otherwise the check need not pay for it
    (it is most of the check's time when the module imports torch lazily)."""
    target = entrypoint.rpartition(":")[0]
    folder = Path(target).parent if target.endswith(".py") else Path.cwd()
    try:
        names = {Path(n).stem for n in os.listdir(folder) if n.endswith(".py") or (folder / n).is_dir()}
    except OSError:
        return False
    for name in names:
        if not name.isidentifier():
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _probe(entrypoint: str, args: Mapping[str, Any]) -> dict:
    """What the worker does up to ``fn(session, **args)``, without the session."""
    from hotspare.agents.worker import load_entrypoint

    if _shadows_an_installed_module(entrypoint):
        try:  # the worker has torch (and its dependencies) loaded before the user's module
            import torch  # noqa: F401
        except ImportError:
            pass
    try:
        fn = load_entrypoint(entrypoint)
    except BaseException as e:  # noqa: BLE001 - the user's module may raise anything, even SystemExit
        module = _entry_module(entrypoint)
        if isinstance(e, ImportError) and module is not None and str(e).startswith(f"entrypoint {entrypoint!r}"):
            return {"kind": "missing", "message": _missing_function(entrypoint, module)}
        kind, message = _import_problem(entrypoint, e)
        return {"kind": kind, "message": message}
    problem = _args_problem(entrypoint, fn, args)
    warm = getattr(sys.modules.get(fn.__module__), "warmup", None)
    if problem is None and callable(warm):  # the worker calls warmup(**args) before any rank
        problem = _args_problem(entrypoint, warm, args, session=False)
    return {"ok": True} if problem is None else {"kind": "args", "message": problem}


def _main() -> None:
    request = json.loads(os.environ.pop(_INPUT_ENV))
    out = os.fdopen(os.dup(1), "w")  # the answer's channel; the user's prints go to stderr
    os.dup2(2, 1)
    result = _probe(request["entrypoint"], request["args"])
    out.write(json.dumps(result) + "\n")
    out.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads the user's module started must not keep the check alive


if __name__ == "__main__":
    _main()
