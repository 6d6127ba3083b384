"""The zygote (hotspare.agents.zygote): warm workers forked from a process that imported
torch once, with everything a started worker had -- its stdin, its log, its environment, its
agent's process group, its exit code, death with its agent -- and refused, never wrong, when
it cannot be that worker. Real processes, a real etcd, the real worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hotspare.agents.worker_link import WARM, Heartbeat, WorkerEnv, pin_spec
from hotspare.agents.zygote import (
    EXIT_FORK_SETUP,
    EXIT_STATUS_UNKNOWN,
    Zygote,
    ZygoteRefused,
    env_mismatch,
    pidfd_supported,
    spawn_server,
)
from hotspare.orchestrator.spec import load_spec
from hotspare.orchestrator.store import JobStore, Store

from ..conftest import wait_until, write_spec

# one worker runs this module (pytest-xdist --dist loadgroup): its module-scoped fixture is made once
pytestmark = [pytest.mark.xdist_group("zygote"), pytest.mark.timeout(180),
              pytest.mark.skipif(not pidfd_supported(), reason="the zygote needs pidfd_open (Linux >= 5.3)")]
WORKER = "hotspare.agents.worker:main"


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A zygote of this test process's own (in its session, as an agent's own zygote is)."""
    tmp = tmp_path_factory.mktemp("zygote")
    env = {k: v for k, v in os.environ.items() if k != "HOTSPARE_ZYGOTE"}
    z = Zygote.start(env, tmp / "zygote.log", owner=os.getpid())
    yield z
    z.close()


@pytest.fixture
def job(etcd, tmp_path):
    """A submitted job a real worker can warm up for."""
    spec = load_spec(write_spec(tmp_path, name="zjob", ranks=1, spares=0))
    store = Store([etcd.endpoint])
    JobStore(store, "zjob").submit(spec, b"s" * 32)
    pin_spec(tmp_path, JobStore(store, "zjob").spec())  # what the agent does: its workers read this
    yield tmp_path
    store.close()


def worker_env(tmp: Path, etcd, agent_pid: int, slot: int = 0) -> dict[str, str]:
    link = WorkerEnv(job="zjob", node="n0", incarnation="i", hb=str(tmp / f"slot{slot}.hb"), log_dir=str(tmp),
                     snap_dir=str(tmp), agent_pid=agent_pid, prewarm=False)
    Heartbeat(link.hb).close()
    env = {k: v for k, v in os.environ.items() if k != "HOTSPARE_ZYGOTE"}
    return {**env, **link.to_env(), "HOTSPARE_ETCD": etcd.endpoint, "PYTHONUNBUFFERED": "1"}


def fork(z: Zygote, env: dict[str, str], log: Path):
    with open(log, "ab") as f:
        return z.spawn(WORKER, env, str(log.parent), f.fileno())


def warm(hb: Path) -> bool:
    return Heartbeat(hb).read()[0] == WARM


def test_a_forked_worker_warms_up_in_our_group_takes_stdin_and_exits_with_its_code(own, etcd, job):
    env = worker_env(job, etcd, os.getpid())
    p = fork(own, env, job / "w.log")
    assert os.getpgid(p.pid) == os.getpgid(0)  # the requester's process group: killpg reaches it
    wait_until(lambda: warm(job / "slot0.hb") or p.poll() is not None, "the forked worker to warm up", timeout=60)
    assert p.poll() is None, (job / "w.log").read_text()
    assert "worker starting" in (job / "w.log").read_text()  # its stdout/stderr are the log we passed
    p.stdin.close()  # a warm worker leaves on EOF on its stdin: exit code 0
    assert p.wait(30) == 0


def test_kill_reads_as_a_signal_and_a_worker_dies_with_its_agent(own, etcd, job):
    p = fork(own, worker_env(job, etcd, os.getpid()), job / "a.log")
    p.kill()
    assert p.wait(30) == -signal.SIGKILL
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        q = fork(own, worker_env(job, etcd, agent.pid, slot=1), job / "b.log")
        wait_until(lambda: warm(job / "slot1.hb"), "the worker to warm up", timeout=60)
        agent.kill()  # its agent is gone: the worker follows (it is the zygote's child, not the agent's)
        assert q.wait(30) == -signal.SIGKILL
    finally:
        agent.kill()
        agent.wait()


def test_a_worker_that_cannot_set_up_exits_with_its_own_code_and_says_why(own, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSPARE_")}
    p = fork(own, env, tmp_path / "bad.log")
    assert p.wait(30) == EXIT_FORK_SETUP
    assert "not started by a hotspare agent" in (tmp_path / "bad.log").read_text()


def test_an_environment_that_differs_at_import_time_is_refused_not_forked(own, tmp_path):
    env = {**own.env, "OMP_NUM_THREADS": "7", "CUDA_VISIBLE_DEVICES": "1", "HOTSPARE_NODE": "x"}
    assert env_mismatch(own.env, env) == ["OMP_NUM_THREADS"]  # CUDA is initialised lazily: may differ
    assert "OMP_NUM_THREADS" in own.usable(env)
    with pytest.raises(ZygoteRefused, match="OMP_NUM_THREADS"):
        fork(own, env, tmp_path / "x.log")
    assert own.usable(own.env) == ""
    assert not own.lost  # a refusal is per request: the zygote serves on


def test_an_agent_in_another_session_is_told_to_use_a_zygote_of_its_own(own):
    code = (f"from hotspare.agents.zygote import Zygote; import os\n"
            f"z = Zygote.connect({own.path!r}); print(z.usable(dict(os.environ)))")
    r = subprocess.run([sys.executable, "-c", code], env=own.env, capture_output=True, text=True, timeout=60,
                       start_new_session=True)
    assert "not in this zygote's session" in r.stdout, r.stdout + r.stderr


def test_run_starts_a_program_in_a_group_of_its_own_and_reports_its_exit(own, tmp_path):
    with open(tmp_path / "prog.log", "ab") as f:
        p = own.run(["sh", "-c", "echo hello from $PWD; exit 3"], {"PATH": os.environ["PATH"]}, str(tmp_path),
                    f.fileno())
    assert p.wait(30) == 3
    assert f"hello from {tmp_path}" in (tmp_path / "prog.log").read_text()
    with open(tmp_path / "sleep.log", "ab") as f:
        q = own.run(["sleep", "60"], {"PATH": os.environ["PATH"]}, str(tmp_path), f.fileno())
    try:
        assert os.getpgid(q.pid) == q.pid  # a process group leader: killpg(pid) is the node's kill
    finally:
        os.killpg(q.pid, signal.SIGKILL)
    assert q.wait(30) == -signal.SIGKILL


def test_workers_outlive_their_zygote_and_are_still_watched(etcd, job):
    env = {k: v for k, v in os.environ.items() if k != "HOTSPARE_ZYGOTE"}
    z = Zygote.start(env, job / "z2.log", owner=os.getpid())
    try:
        p = fork(z, worker_env(job, etcd, os.getpid()), job / "w2.log")
        wait_until(lambda: warm(job / "slot0.hb"), "the worker to warm up", timeout=60)
        z.proc.kill()
        wait_until(lambda: z.lost is not None, "the agent to notice its zygote is gone")
        assert p.poll() is None  # the worker trains on
        p.kill()  # through its pidfd: never a pid that may have been reused
        assert p.wait(30) == EXIT_STATUS_UNKNOWN  # nobody is left to tell its real status
    finally:
        z.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_the_zygote(own):
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            f"try:\n    s.connect({own.path!r})\nexcept PermissionError:\n    print('refused')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "refused", r.stdout + r.stderr
    assert oct(os.stat(os.path.dirname(own.path)).st_mode & 0o777) == "0o700"


def test_a_lingering_zygote_leaves_with_its_owner(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    proc, path = spawn_server({k: v for k, v in os.environ.items()}, tmp_path / "z.log", owner=owner.pid,
                              linger=True, new_session=True)
    try:
        Zygote.connect(path, timeout=30, starting=proc).close()
        owner.kill()
        owner.wait()
        assert proc.wait(30) == 0
        assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    finally:
        owner.kill()
        proc.kill()


def test_a_local_run_without_a_given_zygote_starts_one_for_its_agents(tmp_path):
    """`hotspare run` on the local backend with no $HOTSPARE_ZYGOTE (what a user gets): one
    zygote for the job's agents, which fork their workers from it instead of starting their own."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOTSPARE_ZYGOTE", "HOTSPARE_ETCD")}
    env["HOTSPARE_STATE_DIR"] = str(tmp_path / "state")
    spec = write_spec(tmp_path, name="ownz", ranks=2, spares=1, steps=30,
                      chaos=[{"at_step": 15, "action": "kill-rank", "rank": 1}])
    cli = [sys.executable, "-m", "hotspare.orchestrator.cli"]
    try:
        r = subprocess.run([*cli, "run", "--no-check", str(spec)], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and "succeeded" in r.stdout, r.stdout + r.stderr
    finally:
        subprocess.run([*cli, "down"], env=env, cwd=tmp_path, capture_output=True, timeout=120)
    logs = tmp_path / "out" / "ownz" / "logs"
    assert "ready on" in (logs / "zygote.log").read_text()
    assert not list(logs.glob("zygote-*.log"))  # no agent needed a zygote of its own
    agents = "".join(f.read_text() for f in logs.glob("agent-*.log"))
    assert "not using the zygote" not in agents and "starts as its own process" not in agents, agents
