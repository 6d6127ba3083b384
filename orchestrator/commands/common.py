"""What every subcommand shares: the user-facing error, the declaration of a subcommand,
where etcd is and how to connect to it, and the launch records of scheduler jobs.

Where is etcd? ``--etcd URL[,URL]`` or ``$HOTSPARE_ETCD``; then (submit/run) the spec's
``etcd.endpoints``; then, for a job sent to a scheduler, its launch record; otherwise the
embedded cluster recorded under ``--state-dir`` (``$HOTSPARE_STATE_DIR``, default
``~/.hotspare``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import embedded
from ..launchers import Launcher, get, left_behind, load_record, record_endpoints
from ..spec import JobSpec
from ..store import (
    ENV_OPTIONS,
    PASSWORD_FILE_ENV,
    JobKeys,
    JobStore,
    Store,
    StoreError,
    connect_error,
    store_options_from_env,
)
from ..store.client import ROOT


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


@dataclass(frozen=True)
class Command:
    """One subcommand as ``hotspare --help`` lists it. ``arguments`` adds the flags of its
    own; the etcd flags every subcommand takes come from the CLI's common parser."""

    name: str
    run: Callable[[argparse.Namespace], int]
    help: str
    description: str | None = None  # default: the help line
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    raw_description: bool = False  # the description keeps its own line breaks


# -- etcd TLS and auth ----------------------------------------------------------------------
#: --etcd-* flags -> the Store option they set (ENV_OPTIONS names its variable).
ETCD_FLAGS = {"etcd_ca": "ca_cert", "etcd_cert": "cert", "etcd_key": "key", "etcd_user": "user"}


@dataclass
class EtcdSettings:
    """This process's etcd TLS/auth settings, in their environment-variable form (ENV_OPTIONS):
    the ``--etcd-*`` flags over the environment over the spec's ``etcd`` section.

    The CLI's own connections take them explicitly (:meth:`options`); the processes it starts
    (agents, their workers, the embedded controller, a scheduler's job) inherit them through
    the environment, written only when they are started (:func:`export_for_children`)."""

    overrides: dict[str, str] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    exported: bool = False  # written into this process's environment (its children's)

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> EtcdSettings:
        s = cls()
        for flag, opt in ETCD_FLAGS.items():
            value = getattr(args, flag, None)
            if value:
                s.overrides[ENV_OPTIONS[opt]] = value if opt == "user" else os.path.abspath(value)
        if getattr(args, "etcd_password_file", None):
            s.overrides[PASSWORD_FILE_ENV] = os.path.abspath(args.etcd_password_file)
            s.dropped.add(ENV_OPTIONS["password"])  # the explicit flag wins
        return s

    def environ(self) -> dict[str, str]:
        """The environment as these settings make it."""
        env = {k: v for k, v in os.environ.items() if k not in self.dropped}
        env.update(self.overrides)
        return env

    def fill_from_spec(self, spec: JobSpec) -> None:
        """The spec's settings, where flags and the environment give none (they win, as
        --etcd wins over etcd.endpoints)."""
        env = self.environ()
        for opt, var in ENV_OPTIONS.items():
            value = getattr(spec.etcd, opt)
            given = env.get(var) or (opt == "password" and env.get(PASSWORD_FILE_ENV))
            if value and not given:
                self.overrides[var] = value
                self.dropped.discard(var)

    def options(self) -> dict[str, str | None]:
        """Keyword arguments for :class:`Store`; ValueError for an unreadable password file."""
        return store_options_from_env(self.environ())

    def use(self, variables: dict[str, str], drop: tuple[str, ...] = ()) -> None:
        """Settings that win over the flags' and the environment's (the embedded etcd's own
        credentials); written at once if the environment was written already."""
        self.dropped.update(drop)
        self.dropped.difference_update(variables)
        self.overrides.update(variables)
        if self.exported:
            self.export()

    def export(self) -> None:
        for var in self.dropped:
            os.environ.pop(var, None)
        os.environ.update(self.overrides)
        self.exported = True


def etcd_settings(args: argparse.Namespace) -> EtcdSettings:
    """The settings ``main`` made from the flags (made here for a namespace built elsewhere)."""
    if getattr(args, "etcd_settings", None) is None:
        args.etcd_settings = EtcdSettings.from_flags(args)
    return args.etcd_settings


def export_for_children(args: argparse.Namespace, **variables: str) -> None:
    """Write the etcd settings and ``variables`` into this process's environment, right
    before it starts processes that connect to etcd: they inherit them."""
    etcd_settings(args).export()
    os.environ.update(variables)


# -- where etcd is ----------------------------------------------------------------------------
def state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir).expanduser() if args.state_dir else embedded.default_state_dir()


def etcd_given(args: argparse.Namespace) -> bool:
    """True if the user named etcd (--etcd or $HOTSPARE_ETCD): it wins over everything else."""
    return bool(getattr(args, "etcd", None) or os.environ.get("HOTSPARE_ETCD"))


def endpoints(args: argparse.Namespace, spec_endpoints: tuple[str, ...] = (), start: bool = False) -> list[str]:
    """--etcd, $HOTSPARE_ETCD, the spec's endpoints, else the embedded cluster (``start``:
    brought up if it is not running). The embedded etcd's credentials come with it, also for
    its endpoint given by hand (unless an etcd user is given too)."""
    given = _given_endpoints(args, spec_endpoints)
    sd = state_dir(args)
    if given:
        c = embedded.load(sd)
        if c is not None and c.endpoint in given and not etcd_settings(args).environ().get(ENV_OPTIONS["user"]):
            _use_embedded(args, c)
        return given
    c = start_embedded(args) if start else embedded.load(sd)
    if c is None:
        raise CliError(
            f"no etcd: the embedded cluster is not up (state dir {sd}). Run `hotspare up`, "
            "or pass --etcd URL / set HOTSPARE_ETCD"
        )
    _use_embedded(args, c)
    return [c.endpoint]


def _given_endpoints(args: argparse.Namespace, spec_endpoints: tuple[str, ...]) -> list[str]:
    if getattr(args, "etcd", None):
        return [e for e in args.etcd.split(",") if e]
    if os.environ.get("HOTSPARE_ETCD"):
        return [e for e in os.environ["HOTSPARE_ETCD"].split(",") if e]
    return list(spec_endpoints)


def start_embedded(args: argparse.Namespace, log: Callable[[str], object] | None = None) -> embedded.Cluster:
    """The embedded cluster of the state dir, brought up if needed (what it did said on
    stderr, or to ``log``); a clear error if it cannot start."""
    try:
        return embedded.up(state_dir(args), log=log or (lambda m: print(m, file=sys.stderr)))
    except (RuntimeError, TimeoutError, ValueError) as e:  # etcd would not start, or its password
        raise CliError(f"the embedded cluster did not start: {e}") from e


def _use_embedded(args: argparse.Namespace, c: embedded.Cluster) -> None:
    """Talk to the embedded etcd with its credentials (the user and the password's file,
    never the password itself), and so will every process this one starts."""
    if c.password_file:
        etcd_settings(args).use(c.child_env(), drop=(ENV_OPTIONS["password"],))


def connect(args: argparse.Namespace, eps: list[str], job: str | None = None) -> Store:
    """A checked connection with this process's TLS/auth settings. A command about one job
    (``job``, else ``args.job``) checks it with a read inside that job's keys, so an etcd role
    limited to the job's prefixes is enough (docs/security.md)."""
    try:
        opts = etcd_settings(args).options()
    except ValueError as e:
        raise CliError(str(e)) from e
    job = job or getattr(args, "job", None)
    rec = launched(args, job)
    if rec is not None and eps == record_endpoints(rec):
        # the etcd a job brought along (Slurm) serves TLS with certificates made for it
        for k, v in (rec.get("info", {}).get("etcd_tls") or {}).items():
            opts[k] = opts.get(k) or v
    st = None
    try:
        st = Store(eps, timeout=5, **opts)
        st.ping(JobKeys(job).spec if job else ROOT)
    except (ValueError, StoreError) as e:
        if st is not None:
            st.close()
        raise CliError(connect_error(eps[0], e, opts)) from e
    return st


# -- jobs sent to a scheduler ---------------------------------------------------------------
def launcher(backend: str) -> Launcher:
    try:
        return get(backend)
    except ImportError as e:
        raise CliError(f"backend {backend!r} needs a package that is not installed: {e} "
                       f"(pip install 'hotspare[{backend}]')") from e


def launched(args: argparse.Namespace, job: str | None) -> dict | None:
    """What `hotspare submit` recorded about a job it sent to a scheduler (None: local/unknown)."""
    if not job or etcd_given(args):
        return None
    rec = load_record(state_dir(args), job)
    return rec if rec and rec.get("backend") != "local" else None


def final_status(rec: dict | None) -> dict | None:
    """What a job that brought its own etcd left behind when its allocation ended."""
    data = left_behind(rec, "final-status.json")
    return data if data and data.get("state") else None


def job_endpoints(args: argparse.Namespace, job: str | None) -> list[str]:
    """Endpoints for a command about one job: flags/env, then the job's launch record, then
    the embedded cluster."""
    rec = launched(args, job)
    if rec is None:
        return endpoints(args)
    eps = record_endpoints(rec)
    if eps:
        return eps
    if rec["info"].get("note"):  # e.g. an etcd inside a Kubernetes cluster: not reachable from here
        raise CliError(f"job {job!r} runs on {rec['backend']} with its own etcd: {rec['info']['note']}")
    where = get(rec["backend"]).describe(rec["info"]) or "no scheduler state"
    raise CliError(f"job {job!r} was submitted to {rec['backend']} and its etcd is not up yet "
                   f"({where}); try again in a moment")


def jobstore(args: argparse.Namespace) -> JobStore:
    """``args.job`` in its etcd; a clear error if that etcd has no such job."""
    js = JobStore(connect(args, job_endpoints(args, args.job)), args.job)
    if not js.exists():
        raise CliError(f"no job named {args.job!r} in this etcd (see `hotspare status` for jobs)")
    return js


def job_spec(js: JobStore) -> JobSpec:
    """The job's stored spec; a clear error if the job is not in this etcd."""
    spec = js.spec()
    if spec is None:
        raise CliError(f"no job {js.job!r} in this etcd (`hotspare status` with no JOB lists the jobs it has)")
    return spec
