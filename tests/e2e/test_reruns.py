"""A job name can be run again: each submission is a run of its own (its run id), the
long-lived embedded controller serves it, its checkpoints live apart from every other run's
(never read, pruned or mixed), `--resume` starts from the previous run's newest complete
checkpoint and ends bit-identical; `hotspare down` leaves no process of the embedded cluster,
and an agent whose etcd is gone leaves after its bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hotspare.orchestrator import embedded
from hotspare.orchestrator.launchers.local import group_members
from hotspare.orchestrator.spec import load_spec
from hotspare.orchestrator.store import JobStore
from hotspare.orchestrator.util import pid_alive
from hotspare.recovery import load_final, persist

from ..conftest import EXAMPLES, remove_dead_run_dirs, wait_until, write_spec

pytestmark = pytest.mark.timeout(400)


def _cli(tmp: Path):
    """`hotspare ...` against the embedded cluster of a private state dir."""
    env = dict(os.environ, HOTSPARE_STATE_DIR=str(tmp / "state"), PYTHONUNBUFFERED="1")
    env.pop("HOTSPARE_ETCD", None)

    def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", *args], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=timeout)
    return cli


def _run(cli, *args: str) -> dict:
    r = cli("run", *args, "--json")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout + r.stderr[-3000:]
    return json.loads(lines[-1])


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root: (size, mtime_ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _restored(js: JobStore, epoch: int = 1) -> dict[int, dict]:
    return {e.data["rank"]: e.data for e in js.events() if e.kind == "restored" and e.data["epoch"] == epoch}


def _same_final(a, b) -> None:
    for r, tensors in a.ranks.items():
        diff = [k for k, t in tensors.items() if not torch.equal(t, b.ranks[r][k])]
        assert not diff, f"rank {r}: {len(diff)} tensors differ, e.g. {diff[:4]}"
        assert a.meta[r] == b.meta[r], f"rank {r}: JSON state differs"


def test_a_job_name_runs_again_apart_from_its_earlier_run_and_resumes_from_it(tmp_path):
    cli = _cli(tmp_path)
    out = tmp_path / "out" / "again"
    spec = write_spec(tmp_path, name="again", entrypoint=str(EXAMPLES / "gpt.py") + ":train", ranks=2, spares=0,
                      steps=20, replicate_every=5, persist_every=10, persist_keep=1, hang_timeout=10,
                      output_dir=str(out),
                      args={"n_layer": 1, "n_embd": 32, "block_size": 32})
    base = out / "checkpoints"
    try:
        assert _run(cli, str(spec))["state"] == "succeeded"
        c = embedded.load(tmp_path / "state")
        js = JobStore(c.store(), "again")
        first = js.snapshot().run_id
        first_tree = _tree(base / first)
        assert first_tree and persist.complete_steps(base / first), "the first run persisted nothing"
        final_first = load_final(out)

        # the same spec again, on the same long-lived controller: served, and a run of its own
        assert _run(cli, str(spec))["state"] == "succeeded"
        second = js.snapshot().run_id
        assert second != first and embedded.load(tmp_path / "state").controller_pid == c.controller_pid
        assert _tree(base / first) == first_tree, "the second run touched the first run's checkpoints"
        assert {d["source"] for d in _restored(js).values()} == {"fresh start"}
        second_steps = persist.complete_steps(base / second)
        assert second_steps, "the second run persisted nothing of its own"
        for s in second_steps:
            assert persist.read_manifest(base / second, s)["run_id"] == second
        final_second = load_final(out)
        _same_final(final_first, final_second)

        # --resume: every rank starts at the second run's newest complete checkpoint
        summary = _run(cli, str(spec), "--resume")
        assert summary["state"] == "succeeded"
        third = js.snapshot().run_id
        assert third not in (first, second) and js.snapshot().spec.resume_from == second
        restored = _restored(js)
        assert set(restored) == {0, 1}, restored
        for r, d in restored.items():
            assert d["restore_step"] == second_steps[-1], (r, d)
            assert d["source"].startswith(f"persisted checkpoint {base / second}"), (r, d)
        _same_final(final_second, load_final(out))  # bit-identical to the undisturbed run
        assert _tree(base / first) == first_tree
    finally:
        cli("down")


def _gpt_spec(tmp: Path, name: str, steps: int) -> Path:
    return write_spec(tmp, name=name, entrypoint=str(EXAMPLES / "gpt.py") + ":train", ranks=2, spares=0,
                      steps=steps, replicate_every=5, persist_every=10, persist_keep=2, hang_timeout=10,
                      output_dir=str(tmp / "out" / name), args={"n_layer": 1, "n_embd": 32, "block_size": 32})


def _kill_everything(tmp: Path, out: Path, job: str) -> list[int]:
    """A reboot: SIGKILL every process of the job (agents and workers: each agent's process
    group) and of the embedded cluster (controller, etcd), and wipe the job's /dev/shm. The
    agents are frozen first, so the job cannot finish between the check and the kill."""
    c = embedded.load(tmp / "state")
    groups = list(json.loads((out / "agents.json").read_text()).values())
    for pgid in groups:
        os.killpg(pgid, signal.SIGSTOP)
    js = JobStore(c.store(), job)
    assert not js.state()[0].terminal, "the job ended before it could be killed: give it more steps"
    js.store.close()
    pids = [c.etcd_pid, c.controller_pid] + [p for pgid in groups for p in group_members(pgid)]
    for pgid in groups:
        os.killpg(pgid, signal.SIGKILL)
    for pid in (c.controller_pid, c.etcd_pid):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not [p for p in pids if pid_alive(p)], "every killed process to be gone", timeout=30)
    remove_dead_run_dirs(job)
    return pids


def test_a_run_that_lost_every_process_resumes_bit_identical_after_the_embedded_cluster_comes_back(tmp_path):
    """Issue 14 item 3 (local): every process of a running job and of the embedded cluster,
    etcd included, is SIGKILLed after a complete checkpoint (a reboot). `hotspare run --resume
    SPEC` on the same state dir brings etcd back on its data, records the lost run as failed
    (it no longer blocks the name), restores every rank from that run's newest complete
    checkpoint and ends bit-identical to an undisturbed run of the same spec."""
    cli = _cli(tmp_path)
    spec, out = _gpt_spec(tmp_path, "reboot", steps=300), tmp_path / "out" / "reboot"
    base = out / "checkpoints"
    try:
        assert _run(cli, str(spec))["state"] == "succeeded"
        undisturbed = load_final(out)
        r = cli("submit", str(spec))
        assert r.returncode == 0, r.stdout + r.stderr
        c = embedded.load(tmp_path / "state")
        st = c.store()
        lost = JobStore(st, "reboot").snapshot().run_id
        st.close()
        wait_until(lambda: persist.complete_steps(base / lost), "a complete checkpoint of the run", timeout=180)
        killed = _kill_everything(tmp_path, out, "reboot")
        newest = persist.complete_steps(base / lost)[-1]
        assert newest < 300, newest

        r = cli("run", str(spec), "--resume", "--json")
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        assert f"run {lost} of job reboot lost every process" in r.stderr, r.stderr
        c2 = embedded.load(tmp_path / "state")
        assert c2.etcd_pid not in killed and c2.controller_pid not in killed
        js = JobStore(c2.store(), "reboot")
        assert js.state()[0].value == "succeeded" and js.spec().resume_from == lost
        restored = _restored(js)
        assert set(restored) == {0, 1}, restored
        for rank, d in restored.items():
            assert d["restore_step"] == newest, (rank, d)
            assert d["source"].startswith(f"persisted checkpoint {base / lost}"), (rank, d)
        _same_final(undisturbed, load_final(out))
    finally:
        cli("down")


def test_resume_with_nothing_to_resume_says_so_and_starts_nothing(tmp_path):
    cli = _cli(tmp_path)
    spec = write_spec(tmp_path, name="fresh", output_dir=str(tmp_path / "out" / "fresh"))
    try:
        r = cli("run", str(spec), "--resume")
        assert r.returncode == 2 and "nothing to resume" in r.stderr and "without --resume" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        cli("down")


def _pids_of_cluster(tmp: Path, out: Path) -> list[int]:
    c = embedded.load(tmp / "state")
    agents = json.loads((out / "agents.json").read_text()).values()
    return [c.etcd_pid, c.controller_pid] + [p for a in agents for p in group_members(a)]


def test_down_stops_every_process_of_the_embedded_cluster_running_jobs_included(tmp_path):
    cli = _cli(tmp_path)
    out = tmp_path / "out" / "long"
    spec = write_spec(tmp_path, name="long", ranks=2, steps=1_000_000, spares=1, output_dir=str(out))
    r = cli("submit", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr
    c = embedded.load(tmp_path / "state")
    js = JobStore(c.store(), "long")
    try:
        wait_until(lambda: len(js.snapshot().progress) == 2, "every rank training")
        # etcd, controller, 3 agents, 2 training workers, a warm one (the spare's may still be starting)
        wait_until(lambda: len(_pids_of_cluster(tmp_path, out)) >= 2 + 3 + 3, "every process of the cluster")
        pids = _pids_of_cluster(tmp_path, out)
    finally:
        r = cli("down")
    assert r.returncode == 0, r.stdout + r.stderr
    left = [p for p in pids if pid_alive(p)]  # a zombie waiting for init to reap it is gone
    assert not left, f"still running after down: {left}\n{r.stdout}"
    assert "job long" in r.stdout and "3 agent(s)" in r.stdout and "etcd pid" in r.stdout, r.stdout
    assert embedded.load(tmp_path / "state") is None


def test_an_agent_whose_etcd_is_gone_leaves_after_its_bound_with_its_workers(etcd, cluster):
    spec = load_spec(write_spec(cluster.tmp, name="orphan", spares=0, ranks=1))
    cluster.job("orphan").submit(spec, b"s" * 32)
    agent = cluster.spawn("agent", "--job", "orphan", "--node", "node0", "--etcd-outage-limit", "3",
                          log="agent-orphan.log")
    js = cluster.job("orphan")
    wait_until(lambda: any(n.warm for n in js.snapshot().nodes.values()), "a warm worker")
    members = group_members(agent.pid)
    assert len(members) >= 2, members  # the agent and its warm worker
    etcd.stop()
    assert agent.wait(timeout=90) == 1
    wait_until(lambda: not group_members(agent.pid), "its workers to leave", timeout=30)
    log = (cluster.tmp / "agent-orphan.log").read_text()
    assert "etcd unreachable for" in log and "limit 3s" in log, log[-2000:]


def _checkpoint(root: Path, step: int, world_size: int) -> None:
    d = root / persist.step_name(step)
    d.mkdir(parents=True)
    files = {str(r): {"file": f"rank{r}.safetensors", "bytes": 0, "crc32": 0} for r in range(world_size)}
    (d / "manifest.json").write_text(json.dumps({"step": step, "world_size": world_size, "files": files}))


def test_resume_picks_the_newest_run_with_a_checkpoint_of_this_size_and_refuses_the_old_layout(tmp_path):
    _checkpoint(tmp_path / "20261201-000000-aaaa", 20, 2)
    _checkpoint(tmp_path / "20261202-000000-bbbb", 30, 3)  # another world size
    (tmp_path / "20261203-000000-cccc").mkdir()  # a run that persisted nothing
    assert persist.resumable(tmp_path, 2) == ("20261201-000000-aaaa", 20)
    assert persist.resumable(tmp_path, 3) == ("20261202-000000-bbbb", 30)
    assert persist.resumable(tmp_path, 4) is None
    assert str(persist.resolve_root(tmp_path)).endswith("20261202-000000-bbbb")  # load_checkpoint(base)
    old = tmp_path / "old"
    _checkpoint(old, 10, 2)  # step directories right under the base: before run ids
    assert persist.resolve_root(old) == old
    with pytest.raises(persist.CheckpointError, match="before run ids.*mv"):
        persist.resumable(old, 2)
