"""A real multi-node Slurm on this host for tests: slurmctld plus one ``slurmd -N nX`` per
node, each on its own port, all state under a temp dir (recipe: shared/notes/slurm.md).

Installs Slurm from apt when it is missing and we are root (the suite installs what it
needs); otherwise fails with the command to run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from hotspare.orchestrator.etcd_server import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "srun")


def ensure_installed() -> None:
    if all(shutil.which(b) for b in BINARIES):
        return
    if os.geteuid() != 0:
        raise RuntimeError("Slurm is not installed and we are not root: run "
                           "`sudo apt-get install -y slurm-wlm` (or `make setup` as root)")
    cmd = ["apt-get", "install", "-y", "slurm-wlm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=600)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not all(shutil.which(b) for b in BINARIES):
        raise RuntimeError(f"could not install Slurm: {' '.join(cmd)} -> {r.returncode}\n{r.stderr[-2000:]}")


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 4, cpus: int = 4) -> None:
        self.root = root
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.cpus = cpus
        self.ctld_port = free_port()
        self.node_ports = [free_port() for _ in self.names]

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} "
            f"RealMemory=4000 State=UNKNOWN" for n, p in zip(self.names, self.node_ports, strict=True))
        self.conf.write_text(f"""\
ClusterName=hotsparetest
SlurmctldHost=localhost
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {r.returncode}: {r.stderr}{r.stdout}")
        return r

    def start(self, timeout: float = 60) -> SlurmCluster:
        ensure_installed()
        self._write_conf()
        self.run("slurmctld", "-i")  # -i: ignore state left by an earlier run
        for n in self.names:
            self.run("slurmd", "-N", n)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run("sinfo", "-h", "-t", "idle", "-o", "%D", check=False)
            if r.returncode == 0 and r.stdout.strip() and int(r.stdout.split()[0]) == len(self.names):
                return self
            time.sleep(0.3)
        log = (self.root / "log" / "slurmctld.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s: {self.run('sinfo', check=False).stdout}\n{log}")

    def slurmd_pid(self, node: str) -> int | None:
        try:
            return int((self.root / f"slurmd-{node}.pid").read_text())
        except (OSError, ValueError):
            return None

    def kill_node(self, node: str, job_id: str) -> list[int]:
        """Lose a node the hard way: SIGKILL its slurmd and every process the job runs on it,
        then mark it down (what slurmctld would do once the node stops answering)."""
        killed = []
        pid = self.slurmd_pid(node)
        if pid:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        for p in _pids_with_env(f"SLURMD_NODENAME={node}", f"SLURM_JOB_ID={job_id}"):
            try:
                os.kill(p, signal.SIGKILL)
                killed.append(p)
            except ProcessLookupError:
                pass
        self.run("scontrol", "update", f"nodename={node}", "state=down", "reason=hotspare-test-node-loss",
                 check=False)
        return killed

    def stop(self) -> None:
        pids = {self.slurmd_pid(n) for n in self.names} - {None}
        self.run("scontrol", "shutdown", check=False)
        time.sleep(0.5)
        # a daemon busy with a stuck step can outlive the shutdown (and remove its pid file):
        # nothing started here may outlive the tests
        for pidfile in self.root.glob("*.pid"):
            try:
                pids.add(int(pidfile.read_text()))
            except (OSError, ValueError):
                pass
        # every process started under this cluster's slurm.conf (daemons and slurmstepds)
        for pid in pids | set(_pids_with_env(f"SLURM_CONF={self.conf}")):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _pids_with_env(*entries: str) -> list[int]:
    """Live processes (not this one) whose environment has every one of ``entries``."""
    want = [e.encode() for e in entries]
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w in env for w in want):
            out.append(int(proc.name))
    return out
