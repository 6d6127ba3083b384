"""Local backend: one agent process per simulated node on this machine.

Each agent is its own process session (like a separate machine: killing a "node" kills
that agent and its workers, nothing else). Nodes ``node0..`` are active, ``spare0..``
are spares.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..spec import JobSpec
from ..util import pid_alive


def agent_command(job: str, node: str, endpoints: list[str], *, spare: bool = False,
                  slots: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "hotspare.orchestrator.cli", "agent", "--job", job, "--node", node,
           "--etcd", ",".join(endpoints)]
    if spare:
        cmd.append("--spare")
    if slots:
        cmd += ["--slots", str(slots)]
    return cmd


def start_agent(
    job: str, node: str, endpoints: list[str], log_dir: Path, *, spare: bool = False,
    slots: int | None = None, extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(extra_env or {})
    with open(log_dir / f"agent-{node}.log", "ab") as log:
        return subprocess.Popen(agent_command(job, node, endpoints, spare=spare, slots=slots),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


def _nodes(spec: JobSpec) -> list[tuple[str, bool]]:
    return [(f"node{i}", False) for i in range(spec.nodes)] + [(f"spare{i}", True) for i in range(spec.spares)]


class LocalLauncher:
    brings_etcd = False

    def render(self, spec: JobSpec, endpoints: list[str]) -> str:
        eps = endpoints or ["<embedded etcd>"]
        return "\n".join(shlex.join(agent_command(spec.name, n, eps, spare=s)) + " &"
                         for n, s in _nodes(spec))

    def launch(self, spec: JobSpec, endpoints: list[str]) -> dict:
        log_dir = spec.log_dir
        agents = {n: start_agent(spec.name, n, endpoints, log_dir, spare=s).pid for n, s in _nodes(spec)}
        (Path(spec.output_dir) / "agents.json").write_text(json.dumps(agents, indent=1))
        return {"agents": agents, "log_dir": str(log_dir)}

    def describe(self, info: dict) -> str | None:
        alive = [n for n, pid in info.get("agents", {}).items() if pid_alive(pid)]
        return f"{len(alive)} local agent process(es) alive"

    def ended(self, info: dict) -> bool:
        return not any(pid_alive(pid) for pid in info.get("agents", {}).values())

    def cancel(self, info: dict) -> str | None:
        return None  # agents stop on the etcd cancel key
