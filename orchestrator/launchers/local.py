"""Local backend: one agent process per simulated node on this machine.

Each agent is its own process group (like a separate machine: killing a "node" kills
that agent and its workers, nothing else). The agents are started through one zygote for
the machine (:mod:`hotspare.agents.zygote`: torch is imported once, and each agent's workers
are forked into its group), or, without one, each in a session of its own. Nodes
``node0..`` are active, ``spare0..`` are spares. Every launch is recorded under the state dir (``local/<job>-<run>.json``: the
agents' pids, each the id of a process group that holds its workers), so that ``hotspare
down`` can stop every process of the embedded cluster (:func:`stop_agents`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from hotspare.agents.zygote import Zygote, pidfd_supported, spawn_server

from ..embedded import default_state_dir
from ..spec import JobSpec
from ..util import atomic_write, pid_alive


def agent_command(job: str, node: str, endpoints: list[str], *, spare: bool = False,
                  slots: int | None = None, run_id: str = "", zygote: str = "", spec_sha256: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "hotspare.orchestrator.cli", "agent", "--job", job, "--node", node,
           "--etcd", ",".join(endpoints)]
    if run_id:
        cmd += ["--run-id", run_id]
    if spec_sha256:  # the agent refuses a spec in etcd that is not this one
        cmd += ["--spec-sha256", spec_sha256]
    if zygote:
        cmd += ["--zygote", zygote]
    if spare:
        cmd.append("--spare")
    if slots:
        cmd += ["--slots", str(slots)]
    return cmd


def start_agent(
    job: str, node: str, endpoints: list[str], log_dir: Path, *, spare: bool = False,
    slots: int | None = None, extra_env: dict[str, str] | None = None, run_id: str = "", zygote: str = "",
    spec_sha256: str = "",
) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(extra_env or {})
    with open(log_dir / f"agent-{node}.log", "ab") as log:
        return subprocess.Popen(agent_command(job, node, endpoints, spare=spare, slots=slots, run_id=run_id,
                                              zygote=zygote, spec_sha256=spec_sha256),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


def start_agents_in_zygote(spec: JobSpec, endpoints: list[str], log_dir: Path) -> dict[str, int] | None:
    """Start the job's agents through one zygote for this machine (:mod:`hotspare.agents.zygote`):
    torch is imported once, not once per simulated node, and each agent's workers are forked
    into its process group. The zygote is $HOTSPARE_ZYGOTE's, or a new one in a session of its
    own that leaves after the last of its agents. {node: pid}, or None when no zygote can be
    had (``HOTSPARE_ZYGOTE=off``, no pidfd support, it failed): start them the plain way."""
    path = os.environ.get("HOTSPARE_ZYGOTE", "")
    if path == "off" or not pidfd_supported():
        return None
    started = None
    try:
        if not path:
            env = dict(os.environ)
            env.update({k: str(v) for k, v in spec.env.items()})
            started, path = spawn_server(env, log_dir / "zygote.log", new_session=True)
        z = Zygote.connect(path, timeout=60, starting=started)
    except OSError as e:
        print(f"hotspare: no zygote ({e}); every worker imports torch itself", file=sys.stderr)
        return None
    agents: dict[str, int] = {}
    try:
        for node, spare in _nodes(spec):
            with open(log_dir / f"agent-{node}.log", "ab") as log:
                cmd = agent_command(spec.name, node, endpoints, spare=spare, run_id=spec.run_id, zygote=path,
                                    spec_sha256=spec.digest())
                agents[node] = z.run(cmd, dict(os.environ), os.getcwd(), log.fileno()).pid
        return agents
    except OSError as e:
        print(f"hotspare: the zygote failed ({e}); starting the agents without it", file=sys.stderr)
        for pid in agents.values():
            _signal_group(pid, signal.SIGKILL)
        return None
    finally:
        z.close()


def _nodes(spec: JobSpec) -> list[tuple[str, bool]]:
    return [(f"node{i}", False) for i in range(spec.nodes)] + [(f"spare{i}", True) for i in range(spec.spares)]


class LocalLauncher:
    brings_etcd = False

    def render(self, spec: JobSpec, endpoints: list[str]) -> str:
        eps = endpoints or ["<embedded etcd>"]
        return "\n".join(shlex.join(agent_command(spec.name, n, eps, spare=s, run_id=spec.run_id,
                                                  spec_sha256=spec.digest())) + " &"
                         for n, s in _nodes(spec))

    def launch(self, spec: JobSpec, endpoints: list[str]) -> dict:
        log_dir = spec.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        agents = start_agents_in_zygote(spec, endpoints, log_dir) or {
            n: start_agent(spec.name, n, endpoints, log_dir, spare=s, run_id=spec.run_id,
                           spec_sha256=spec.digest()).pid for n, s in _nodes(spec)}
        (Path(spec.output_dir) / "agents.json").write_text(json.dumps(agents, indent=1))
        _record(default_state_dir(), {"job": spec.name, "run_id": spec.run_id, "endpoints": endpoints,
                                      "agents": agents, "time": time.time()})
        return {"agents": agents, "log_dir": str(log_dir)}

    def describe(self, info: dict) -> str | None:
        alive = [n for n, pid in info.get("agents", {}).items() if pid_alive(pid)]
        return f"{len(alive)} local agent process(es) alive"

    def ended(self, info: dict) -> bool:
        return not any(pid_alive(pid) for pid in info.get("agents", {}).values())

    def cancel(self, info: dict) -> str | None:
        return None  # agents stop on the etcd cancel key

    def exited(self, info: dict) -> dict[str, str]:
        """The nodes whose agent process has exited, each with the last line of its log
        (what the agent said last: its error, if it failed)."""
        log_dir = Path(info.get("log_dir", "."))
        return {node: _last_line(log_dir / f"agent-{node}.log")
                for node, pid in info.get("agents", {}).items() if not pid_alive(pid)}


def _last_line(path: Path, most: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - most))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


# -- the processes a local launch started, for `hotspare down` ----------------------------------
def _records_dir(state_dir: Path) -> Path:
    return state_dir / "local"


def _record(state_dir: Path, rec: dict) -> None:
    """Keep what this launch started; drop the records whose processes are all gone."""
    d = _records_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    for old in recorded(state_dir):
        if not any(group_members(pid) for pid in old["agents"].values()):
            Path(old["file"]).unlink(missing_ok=True)
    name = f"{rec['job']}-{rec['run_id'] or os.getpid()}.json"
    atomic_write(d / name, json.dumps(rec, indent=1, sort_keys=True), fsync=False, mode=0o666)


def recorded(state_dir: Path) -> list[dict]:
    """Every recorded local launch under ``state_dir`` (each with its ``file``)."""
    out = []
    for f in sorted(_records_dir(state_dir).glob("*.json")):
        try:
            out.append({**json.loads(f.read_text()), "file": str(f)})
        except (OSError, ValueError):
            continue
    return out


def group_members(pgid: int) -> list[int]:
    """The live hotspare processes (an agent and its workers; zombies are gone) of process
    group ``pgid``. A group id is never reused while any member lives, and the command line
    check skips a pid the system gave to someone else since."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp
            if fields[0] != "Z" and int(fields[2]) == pgid and b"hotspare" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_agents(state_dir: Path, grace: float = 10.0) -> list[str]:
    """Stop every recorded agent with its workers: wait ``grace`` seconds for them to leave
    by themselves (their job was cancelled), then SIGTERM their process groups, then
    SIGKILL. Returns one line per launch that still had processes, saying what was stopped."""
    found = []
    for rec in recorded(state_dir):
        groups = {pid: group_members(pid) for pid in rec["agents"].values()}
        procs = sum(len(m) for m in groups.values())
        if procs:
            agents = sum(1 for pid, m in groups.items() if pid in m)
            found.append((rec, groups, f"job {rec['job']} (run {rec['run_id'] or '?'}): {agents} agent(s) "
                                       f"and {procs - agents} worker(s)"))
        Path(rec["file"]).unlink(missing_ok=True)
    pgids = [pid for _, groups, _ in found for pid, m in groups.items() if m]
    for sig, wait in ((None, grace), (signal.SIGTERM, 8.0), (signal.SIGKILL, 2.0)):
        if sig is not None:
            for pgid in pgids:
                _signal_group(pgid, sig)
        deadline = time.monotonic() + wait
        while (pgids := [p for p in pgids if group_members(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pgids:
            break
    left = ", ".join(map(str, pgids))
    return [f"stopped {what}" for _, _, what in found] + ([f"could not stop process group(s) {left}"] if pgids else [])
