"""Helpers shared by the benchmarks: machine info, statistics, tables, JSON output, and a
private etcd + controller to run real hotspare jobs against (like tests/conftest.Cluster,
which the benchmarks deliberately do not import)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
OUT = REPO / "benchmarks" / "out"


def base_parser(doc: str, json_name: str, trials_help: str) -> argparse.ArgumentParser:
    """The flags every benchmark shares: --trials N, --json PATH and --smoke."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trials", type=int, default=5, help=trials_help)
    p.add_argument("--json", default=str(OUT / json_name),
                   help="where to write the results (with --smoke: a temp file unless given)")
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds of work that still exercises every run of the benchmark (tiny sizes, "
                   "one trial; `make test` runs it): checks the benchmark works, its numbers mean nothing. "
                   "Flags given with it still win")
    p.set_defaults(_json_name=json_name)
    return p


def parse_args_smoke(p: argparse.ArgumentParser, argv: list[str] | None,
                     smoke: dict[str, Any]) -> argparse.Namespace:
    """Parse ``argv`` with ``p`` (made by :func:`base_parser`); with ``--smoke``, ``smoke``
    replaces the defaults (flags given explicitly still win) and ``--json`` defaults to a new
    temp file, so that a smoke run never overwrites a result in benchmarks/out/."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--smoke", action="store_true")
    known, _ = pre.parse_known_args(argv)
    if known.smoke:
        p.set_defaults(trials=1, json=None, **smoke)
    a = p.parse_args(argv)
    if a.smoke and a.json is None:
        fd, path = tempfile.mkstemp(prefix="hotspare-smoke-", suffix="-" + a._json_name)
        os.close(fd)
        a.json = path
    return a


def finish(benchmark: str, problems: Sequence[str]) -> int:
    """The exit code of a benchmark: 0 when nothing went wrong, else 1 after one line per problem
    (each names the run and what went wrong) on stderr."""
    for pr in problems:
        print(f"{benchmark}: FAILED: {pr}", file=sys.stderr, flush=True)
    if problems:
        print(f"{benchmark}: {len(problems)} problem(s); exit code 1", file=sys.stderr, flush=True)
    return 1 if problems else 0


def import_gpt():
    """``examples/gpt.py`` (the demo workload) as the module ``gpt``."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import gpt

    return gpt



# -- machine and statistics -------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
    """median/min/max/n of the values that are not None (None: a phase the timeline lacked)."""
    vs = [float(v) for v in values if v is not None]
    if not vs:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(vs), "median": statistics.median(vs), "min": min(vs), "max": max(vs)}


def fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns left-aligned, the rest right-aligned."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    head = line(header)
    return "\n".join([head, "-" * len(head), *(line(r) for r in rows)])


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return p


def shm_base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


# -- torchrun ----------------------------------------------------------------------------------
def run_torchrun_cmd(cmd: Sequence[str], d: Path, fields: dict[str, Any], *, ranks: int, fail: bool,
                     fail_step: int, run_timeout: float, keep_ckpt: bool) -> dict[str, Any]:
    """Run one torchrun command ``cmd`` (built by the caller) in a fresh run directory ``d``
    (log: ``d/torchrun.log``) and read its span from the workers' attempt records in
    ``d/records`` (``a<attempt>-r<rank>-{start,end,kill}.json``; ``cmd`` must point the workers
    there). The record starts with ``fields`` (run name and the like), then wall_s, rc, attempts,
    span_s, final_loss and, with ``fail`` (one rank killed at ``fail_step``, one restart
    expected), kill_to_resume_s / resumed_after_step / recomputed_steps; ``ok``, ``problems``
    and ``log_tail`` say what went wrong. ``d/ckpt`` is removed afterwards unless ``keep_ckpt``."""
    out = d / "records"
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    d.mkdir(parents=True, exist_ok=True)
    log = d / "torchrun.log"
    rec: dict[str, Any] = dict(fields)
    problems = []
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(list(cmd), env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=d)
        try:
            rc = p.wait(run_timeout)
        except subprocess.TimeoutExpired:
            rc = None
            problems.append(f"torchrun did not finish within {run_timeout:.0f}s (hang?); killed it")
        rec["wall_s"] = round(time.monotonic() - t0, 3)
        try:  # the whole group we started: torchrun and any worker it left behind
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()
    rec["rc"] = rc
    if rc not in (0, None):
        problems.append(f"torchrun exited with {rc}")

    def load(pattern: str) -> dict[str, dict[str, Any]]:
        got = {}
        for fp in sorted(out.glob(pattern)):
            try:
                got[fp.name] = json.loads(fp.read_text())
            except (OSError, ValueError):
                pass
        return got

    starts, ends, kills = load("a*-r*-start.json"), load("a*-r*-end.json"), load("a*-r*-kill.json")
    attempts = sorted({int(n[1:].split("-")[0]) for n in starts})
    rec["attempts"] = len(attempts)
    first = [v for n, v in starts.items() if n.startswith("a0-")]
    last = attempts[-1] if attempts else 0
    last_ends = [v for n, v in ends.items() if n.startswith(f"a{last}-")]
    if len(first) < ranks or len(last_ends) < ranks:
        problems.append(f"records: {len(first)} first-attempt starts, {len(last_ends)} ends of attempt {last} "
                        f"(expected {ranks} each)")
    else:
        rec["span_s"] = round(max(e["t"] for e in last_ends) - max(s["t"] for s in first), 3)
        rec["final_loss"] = next(e["final_loss"] for n, e in sorted(ends.items()) if n.startswith(f"a{last}-r0-"))
    if fail:
        if attempts != [0, 1]:
            problems.append(f"attempts {attempts} (expected [0, 1]: one restart)")
        if kills and len(attempts) > 1:
            t_kill = min(k["t"] for k in kills.values())
            again = [v for n, v in starts.items() if n.startswith("a1-")]
            if again:
                rec["kill_to_resume_s"] = round(max(s["t"] for s in again) - t_kill, 3)
                rec["resumed_after_step"] = min(s["start_step"] for s in again) - 1
                rec["recomputed_steps"] = fail_step - min(s["start_step"] for s in again)
        elif not kills:
            problems.append("no kill record: the failure was not injected")
    elif len(attempts) != 1:
        problems.append(f"{len(attempts)} attempts in a no-failure run")
    rec["ok"] = not problems
    if problems:
        rec["problems"] = problems
        try:
            rec["log_tail"] = log.read_text(errors="replace")[-3000:]
        except OSError:
            pass
    rec["final_dir"] = str(d / "final")
    if not keep_ckpt:
        shutil.rmtree(d / "ckpt", ignore_errors=True)
    return rec


# -- a private cluster ------------------------------------------------------------------------
def gpt_job_spec(a: argparse.Namespace, name: str, args: dict[str, Any], *, entrypoint: str | None = None,
                 chaos: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A hotspare spec of the GPT example for ``a.ranks`` one-rank nodes plus one spare, the
    benchmarks' common shape (``a`` has ranks, steps, lease_ttl and hang_timeout)."""
    spec: dict[str, Any] = {
        "name": name,
        "entrypoint": entrypoint or str(EXAMPLES / "gpt.py") + ":train",
        "ranks": a.ranks,
        "spares": 1,
        "ranks_per_node": 1,
        "steps": a.steps,
        "lease_ttl": a.lease_ttl,
        "hang_timeout": a.hang_timeout,
        "on_no_spare": "wait",
        "args": args,
    }
    if chaos:
        spec["chaos"] = chaos
    return spec


def etcd_requests(endpoint: str) -> dict[str, float]:
    """gRPC requests etcd has handled since it started, per method (``Range``, ``Put``, ``Txn``,
    ``LeaseKeepAlive`` streams' messages are not counted: only unary calls and stream opens),
    from its Prometheus ``/metrics`` page on the client URL."""
    import re
    import urllib.request

    with urllib.request.urlopen(endpoint.rstrip("/") + "/metrics", timeout=10) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{"):
            m = re.search(r'grpc_method="([^"]+)"', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("grpc_server_msg_received_total{") and 'grpc_method="LeaseKeepAlive"' in line:
            out["LeaseKeepAlive msgs"] = out.get("LeaseKeepAlive msgs", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("grpc_server_msg_received_total{") and 'grpc_method="Watch"' in line:
            out["Watch msgs"] = out.get("Watch msgs", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class BenchCluster:
    """A private etcd on a free loopback port plus one controller; runs jobs with
    ``python -m hotspare.orchestrator.cli run SPEC --json`` and cleans up after each one (leftover
    agents killed, their /dev/shm run directories removed)."""

    def __init__(self, workdir: Path | None = None, controller_ttl: float = 2.0, keep: bool = False,
                 heartbeat_ms: int | None = None) -> None:
        from hotspare.orchestrator.etcd_server import QUICK_HEARTBEAT_MS, start_etcd

        self.keep = keep
        self.tmp = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hotspare-bench-"))
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.etcd = start_etcd(self.tmp / "etcd", log_path=self.tmp / "etcd.log",
                               heartbeat_ms=heartbeat_ms or QUICK_HEARTBEAT_MS)
        self.endpoint = self.etcd.endpoint
        self.env = dict(os.environ, HOTSPARE_ETCD=self.endpoint, HOTSPARE_STATE_DIR=str(self.tmp / "state"),
                        PYTHONUNBUFFERED="1")
        self.procs: list[subprocess.Popen] = []
        self.jobs: list[str] = []
        self.controller = self._spawn("controller", "--leader-ttl", str(controller_ttl), log="controller.log")

    def _spawn(self, *args: str, log: str) -> subprocess.Popen:
        with open(self.tmp / log, "ab") as f:
            p = subprocess.Popen([sys.executable, "-m", "hotspare.orchestrator.cli", *args], env=self.env, stdout=f,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                 cwd=self.tmp)
        self.procs.append(p)
        return p

    def output_dir(self, name: str) -> Path:
        return self.tmp / "out" / name

    def run_job(self, spec: dict[str, Any], timeout: float = 600) -> tuple[dict[str, Any] | None, str]:
        """Submit ``spec`` (a dict, ``name`` required), wait for it; (JSON summary or None, log tail)."""
        r = self.run_timed(spec, timeout, with_events=False)
        return r["summary"], r["log_tail"]

    def run_timed(self, spec: dict[str, Any], timeout: float = 600, with_events: bool = True) -> dict[str, Any]:
        """Run ``spec`` with ``hotspare run --json``: its summary, the command's wall time,
        the job's events (if asked) and the log tail."""
        import yaml

        name = spec["name"]
        if self.controller.poll() is not None:
            raise RuntimeError(f"the controller exited with {self.controller.returncode}; see {self.tmp}/controller.log")
        spec = dict(spec)
        spec.setdefault("output_dir", str(self.output_dir(name)))
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        self.jobs.append(name)
        t0 = time.monotonic()
        events: list = []
        try:
            # --no-check: the entrypoints are this repository's examples, and the command's wall
            # time stays comparable with results recorded before the entrypoint check existed
            r = subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", "run", str(path), "--json",
                                "--no-check", "--timeout", str(int(timeout))],
                               env=self.env, capture_output=True, text=True, timeout=timeout + 60, cwd=self.tmp)
            out, err = r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        wall = time.monotonic() - t0
        try:
            if with_events:
                events = (self.events(name) or {}).get("events", [])
        finally:
            self._reap_job(name)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        return {"summary": json.loads(lines[-1]) if lines else None, "wall_s": wall, "events": events,
                "log_tail": (out + "\n" + err)[-3000:]}

    def events(self, name: str) -> dict[str, Any] | None:
        """``hotspare events NAME --json`` (every event and the recovery breakdowns), or None."""
        r = subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", "events", name, "--json"], env=self.env,
                           capture_output=True, text=True, timeout=60, cwd=self.tmp)
        try:
            return json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return None

    def _reap_job(self, name: str, grace: float = 8.0) -> None:
        """Give the job's agents ``grace`` seconds to exit on their own, then kill them."""
        agents_file = self.output_dir(name) / "agents.json"
        pids: list[int] = []
        try:
            pids = [int(p) for p in json.loads(agents_file.read_text()).values()]
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        for pid in pids:
            if _alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for d in shm_base().glob(f"hotspare-{name}-*"):
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        from hotspare.orchestrator.etcd_server import stop_pid

        for name in self.jobs:
            self._reap_job(name, grace=0)
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        stop_pid(self.etcd.pid)
        if self.etcd.proc is not None:
            try:
                self.etcd.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> BenchCluster:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _alive(pid: int) -> bool:
    from hotspare.orchestrator.util import pid_alive

    return pid_alive(pid)
