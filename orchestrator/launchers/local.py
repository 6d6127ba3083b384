"""Local backend: one agent process per simulated node on this machine.

Each agent is its own process session (like a separate machine: killing a "node" kills
that agent and its workers, nothing else). Nodes ``node0..`` are active, ``spare0..``
are spares.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path


def start_agent(
    job: str, node: str, endpoints: list[str], log_dir: Path, *, spare: bool = False,
    slots: int | None = None, extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "orchestrator.cli", "agent", "--job", job, "--node", node,
           "--etcd", ",".join(endpoints)]
    if spare:
        cmd.append("--spare")
    if slots:
        cmd += ["--slots", str(slots)]
    env = dict(os.environ)
    env.update(extra_env or {})
    with open(log_dir / f"agent-{node}.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


class LocalLauncher:
    def launch(self, spec: dict, endpoints: list[str]) -> dict:
        n_active = math.ceil(spec["ranks"] / spec["ranks_per_node"])
        log_dir = Path(spec["output_dir"]) / "logs"
        agents = {}
        for i in range(n_active):
            agents[f"node{i}"] = start_agent(spec["name"], f"node{i}", endpoints, log_dir).pid
        for i in range(spec["spares"]):
            agents[f"spare{i}"] = start_agent(spec["name"], f"spare{i}", endpoints, log_dir, spare=True).pid
        (Path(spec["output_dir"]) / "agents.json").write_text(json.dumps(agents, indent=1))
        return {"agents": agents, "log_dir": str(log_dir)}
