"""Shared fixtures: a real etcd on a free loopback port, real controllers and agents."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hotspare.orchestrator.etcd_server import start_etcd, stop_pid
from hotspare.orchestrator.store import JobStore, Store

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="session", autouse=True)
def quick_etcd():
    """Every etcd the suite starts elects itself in 0.1 s, not `hotspare up`'s 2.5 s (its slow
    heartbeat saves a long-lived etcd CPU; the suite starts dozens): hotspare.orchestrator.etcd_server."""
    from hotspare.orchestrator.etcd_server import HEARTBEAT_ENV, QUICK_HEARTBEAT_MS

    old = os.environ.get(HEARTBEAT_ENV)
    os.environ[HEARTBEAT_ENV] = str(QUICK_HEARTBEAT_MS)
    yield
    if old is None:
        del os.environ[HEARTBEAT_ENV]
    else:
        os.environ[HEARTBEAT_ENV] = old


@pytest.fixture(scope="session", autouse=True)
def zygote(tmp_path_factory):
    """One zygote for the whole session (hotspare.agents.zygote): every agent a test starts
    runs in its session and forks its workers from it, so torch is imported once for the suite
    instead of once per worker. Exported as $HOTSPARE_ZYGOTE to every hotspare process (the
    local launcher starts its agents through it). Tests of the zygote itself start their own."""
    from hotspare.agents.zygote import pidfd_supported, spawn_server

    if os.environ.get("HOTSPARE_ZYGOTE") or not pidfd_supported():
        yield os.environ.get("HOTSPARE_ZYGOTE")
        return
    log = tmp_path_factory.mktemp("zygote") / "zygote.log"
    proc, path = spawn_server(dict(os.environ), log, owner=os.getpid(), linger=True, new_session=True)
    os.environ["HOTSPARE_ZYGOTE"] = path
    try:
        yield path
    finally:
        del os.environ["HOTSPARE_ZYGOTE"]
        proc.kill()
        proc.wait()


@pytest.fixture
def etcd(tmp_path):
    srv = start_etcd(tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    yield srv
    srv.resume() if srv.proc and srv.proc.poll() is None else None
    srv.stop()


def remove_dead_run_dirs(job: str, node: str = "") -> None:
    """Remove the /dev/shm run directories of ``job`` (of its ``node``) that no live agent
    owns: those of agents a test killed. Never another test's: tests run in parallel
    (pytest-xdist), and a job name may be in use by two of them."""
    from hotspare.agents.node_services import _owner_gone

    for d in Path("/dev/shm").glob(f"hotspare-{job}-{node + '-' if node else ''}*"):
        if d.is_dir() and not d.is_symlink() and _owner_gone(d):
            shutil.rmtree(d, ignore_errors=True)


def wait_until(pred, what: str = "condition", timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def write_spec(tmp: Path, **fields) -> Path:
    """A job spec YAML under ``tmp`` (defaults: the allreduce example, 3 ranks + 1 spare)."""
    spec = {
        "entrypoint": str(EXAMPLES / "allreduce.py") + ":train",
        "ranks": 3,
        "spares": 1,
        "steps": 120,
        "lease_ttl": 2,
        "hang_timeout": 4,
        "output_dir": str(tmp / "out" / fields.get("name", "job")),
        "args": {"step_sleep": 0.03},
    }
    spec.update(fields)
    path = tmp / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class Cluster:
    """A real etcd plus the processes a test starts against it; all killed at teardown."""

    def __init__(self, etcd, tmp_path: Path, **store_options) -> None:
        self.etcd = etcd
        self.endpoint = etcd.endpoint
        self.tmp = tmp_path
        self.store = Store([self.endpoint], **store_options)  # TLS/auth: Store's keyword arguments
        self.procs: list = []  # subprocess.Popen, or ForkedProc for agents the zygote started
        self._zygote = None
        self.env = dict(os.environ, HOTSPARE_ETCD=self.endpoint, HOTSPARE_STATE_DIR=str(tmp_path / "state"),
                        PYTHONUNBUFFERED="1")
        #: `run`/`submit` check the entrypoint in a subprocess that imports it (and so torch:
        #: ~2.5 s of CPU). Its own tests (tests/*/test_entry_check*.py) turn it on; the others
        #: submit known-good examples and skip it (--no-check), which keeps the suite short.
        self.entry_check = False

    def hotspare(self, *args: str, timeout: float = 240, check: bool = False) -> subprocess.CompletedProcess:
        if args and args[0] in ("run", "submit") and not self.entry_check and "--no-check" not in args:
            args = (args[0], "--no-check", *args[1:])
        r = subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", *args], env=self.env,
                           capture_output=True, text=True, timeout=timeout, cwd=self.tmp)
        if check and r.returncode != 0:
            raise AssertionError(f"hotspare {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def spawn(self, *args: str, log: str):
        """A hotspare process of its own (a process group leader), logging to ``log``. An agent
        starts through the session's zygote (so its workers are forked, not started)."""
        cmd = [sys.executable, "-m", "hotspare.orchestrator.cli", *args]
        with open(self.tmp / log, "ab") as f:
            zygote = self.env.get("HOTSPARE_ZYGOTE")
            if args[0] == "agent" and zygote and zygote != "off":
                from hotspare.agents.zygote import Zygote

                self._zygote = self._zygote or Zygote.connect(zygote)
                p = self._zygote.run(cmd, self.env, str(self.tmp), f.fileno())
            else:
                p = subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=self.tmp)
        self.procs.append(p)
        return p

    def controller(self, ttl: float = 2.0) -> subprocess.Popen:
        return self.spawn("controller", "--leader-ttl", str(ttl), log=f"controller-{len(self.procs)}.log")

    def agent(self, job: str, node: str, spare: bool = False) -> subprocess.Popen:
        return self.spawn("agent", "--job", job, "--node", node, *(["--spare"] if spare else []),
                          log=f"agent-{node}.log")

    def spec_file(self, **fields) -> Path:
        return write_spec(self.tmp, **fields)

    def job(self, name: str) -> JobStore:
        return JobStore(self.store, name)

    def wait(self, pred, timeout: float = 120, what: str = "condition") -> None:
        wait_until(pred, what, timeout)

    def run_json(self, *args: str, timeout: float = 240) -> tuple[dict, subprocess.CompletedProcess]:
        r = self.hotspare("run", *args, "--json", timeout=timeout)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert lines, f"no JSON summary; rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
        return json.loads(lines[-1]), r

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        agents = self.tmp / "out"
        for f in agents.glob("*/agents.json"):
            for pid in json.loads(f.read_text()).values():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    stop_pid(pid, 1)
        if self._zygote is not None:
            self._zygote.close()
        self.store.close()


@pytest.fixture
def cluster(etcd, tmp_path):
    c = Cluster(etcd, tmp_path)
    yield c
    c.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The undisturbed GPT run's final state (etcd and controller of its own), shared by
    every test that compares a disturbed run against it."""
    from hotspare.recovery import load_final

    from .e2e.test_exact_recovery import run_ok

    tmp = tmp_path_factory.mktemp("reference")
    srv = start_etcd(tmp / "etcd")
    c = Cluster(srv, tmp)
    try:
        c.controller()
        run_ok(c, "ref")
        yield load_final(tmp / "out" / "ref")
    finally:
        c.close()
        srv.stop()
