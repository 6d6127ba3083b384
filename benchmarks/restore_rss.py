"""Peak memory of a restore: the serving agent and the restoring spare's worker, each a process of
its own, while the spare fetches one snapshot over the real replica path (issue 14 item 4).

Per trial and *source*, in fresh processes, all state in ``/dev/shm``:

1. a *writer* process builds a model of ``--size-mb`` MiB of float32 parameters (``--tensors``
   of them), snapshots it with a real :class:`~hotspare.recovery.snapshot.SnapshotEngine` at step
   10, and leaves it where the serving agent finds it: as a *replica* file its buddy pushed
   (``ReplicaStore.save``; source ``replica``), or as the *slot* of a worker that died
   (source ``slot``); then it exits;
2. a *server* process runs the agent's :class:`~hotspare.agents.replica.ReplicaServer` over that
   directory (the agent's other threads are idle during a restore);
3. a *worker* process builds the same model (its parameters written, so they are resident as in
   a real job), a SnapshotEngine of its own, and restores step 10 with
   :meth:`PeerReplicas.load <hotspare.recovery.restore.PeerReplicas.load>` -- fetch, checks,
   restore, and the restored step in its own snapshot slot -- timed; it hashes the restored
   parameters against the writer's. The engine's background preparation of its *other* slots
   (done after any first snapshot, restore or not) is switched off, so the number is the
   restore's.

Just before the restore, the parent resets both processes' peak RSS (``/proc/PID/clear_refs``,
``5``); right after it, it reads ``VmHWM`` (peak resident set: anonymous memory plus mapped
shared memory such as a snapshot slot) and reports the peak's growth over the resident set just
before. Which hotspare the processes run is the one Python imports: set ``PYTHONPATH`` to another
tree's package (``--label`` names it in the output). Sources alternate between trials.

    .venv/bin/python benchmarks/restore_rss.py                          # 1 GiB, 3 trials per source
    PYTHONPATH=/tmp/before-pkg .venv/bin/python benchmarks/restore_rss.py --label before
    .venv/bin/python benchmarks/restore_rss.py --smoke                  # 16 MiB, 1 trial: does it work?
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    REPO,
    base_parser,
    finish,
    fmt,
    machine_info,
    parse_args_smoke,
    shm_base,
    summarize,
    table,
    write_json,
)

SOURCES = ("replica", "slot")
SMOKE = {"size_mb": 16, "tensors": 4}  # > 2 receive pieces of 4 MiB
SID, STEP = 3, 10
FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssShmem")


def parse_args(argv: list[str] | None):
    p = base_parser(__doc__, "restore_rss.json", "trials per source")
    p.set_defaults(trials=3)
    p.add_argument("--size-mb", type=int, default=1024, help="snapshot size in MiB")
    p.add_argument("--tensors", type=int, default=16, help="float32 parameters in the model, of equal size")
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated subset of " + ", ".join(SOURCES))
    p.add_argument("--label", default="this tree", help="what the hotspare under test is called in the output")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds one trial may take")
    p.add_argument("--_role", choices=("writer", "server", "worker"), help=_hidden())
    p.add_argument("--_dir", help=_hidden())
    p.add_argument("--_port", type=int, default=0, help=_hidden())
    p.add_argument("--_source", default="replica", help=_hidden())
    a = parse_args_smoke(p, argv, SMOKE)
    a.sources = [s.strip() for s in a.sources.split(",") if s.strip()]
    if not a.sources or any(s not in SOURCES for s in a.sources):
        p.error(f"--sources: choose from {', '.join(SOURCES)}")
    return a


def _hidden() -> str:
    import argparse

    return argparse.SUPPRESS


# -- the child processes -----------------------------------------------------------------------------
def make_model(size_mb: int, tensors: int, seeded: bool):
    """``tensors`` float32 parameters, ``size_mb`` MiB in all: a deterministic pattern (the
    writer's), or all ones (the spare's own, resident, about to be overwritten)."""
    import torch

    n = (size_mb << 20) // 4 // tensors
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(n)) for _ in range(tensors)])
    with torch.no_grad():
        for i, p in enumerate(model.ps):
            if seeded:
                torch.arange(n, out=p.data).mul_(1.0 + i / 7).add_(i)
            else:
                p.data.fill_(1.0)
    return model


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(memoryview(p.detach().numpy()).cast("B"))
    return h.hexdigest()


def writer(a) -> int:
    """Leave step 10 of the seeded model where the server finds it; print its digest."""
    from hotspare.agents.replica import ReplicaStore
    from hotspare.recovery.slotfile import read_slot
    from hotspare.recovery.snapshot import SnapshotEngine
    from hotspare.recovery.state import provider_for
    from hotspare.recovery.wire import checksums

    model = make_model(a.size_mb, a.tensors, seeded=True)
    holder = Path(a._dir)
    where = holder if a._source == "slot" else Path(tempfile.mkdtemp(prefix="hotspare-bench-rss-w-", dir=shm_base()))
    eng = SnapshotEngine(where, sid=SID, replicate_every=0)
    eng.providers = provider_for("model", model)
    eng.capture(STEP)
    eng.wait()
    if a._source == "replica":  # what the dead worker's buddy kept: a replica file
        header, data, _ = read_slot(eng.path(eng._steps.index(STEP)))
        ReplicaStore(holder).save(dict(header, crc=checksums(header["tensors"], data), rank=SID), data)
        del data
    eng.close()
    if where != holder:
        shutil.rmtree(where, ignore_errors=True)
    print("RESULT " + json.dumps({"sha256": digest(model)}), flush=True)
    return 0


def server(a) -> int:
    from hotspare.agents.replica import ReplicaServer, ReplicaStore

    secret = bytes.fromhex(sys.stdin.readline().strip())
    srv = ReplicaServer(ReplicaStore(Path(a._dir)), secret).start()
    print(srv.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    srv.stop()
    return 0


def worker(a) -> int:
    """Restore step 10 from the server when told to; report time, bytes and the digest."""
    import hotspare.recovery.wire as wire
    from hotspare.recovery.restore import PeerReplicas
    from hotspare.recovery.snapshot import SnapshotEngine
    from hotspare.recovery.state import provider_for

    secret = bytes.fromhex(sys.stdin.readline().strip())
    model = make_model(a.size_mb, a.tensors, seeded=False)
    eng = SnapshotEngine(Path(a._dir), sid=SID, replicate_every=10)
    eng.providers = provider_for("model", model)
    eng._preparer.prepare_others = lambda *args, **kw: None  # the next steps' slots: not the restore's
    peers = PeerReplicas(None, SID, eng)  # type: ignore[arg-type] - no etcd: the holder is given
    peers._secret = secret
    peers._holders = {STEP: [("holder", "127.0.0.1", a._port)]}
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return 1
    t0 = time.perf_counter()
    got = peers.load(STEP)
    seconds = time.perf_counter() - t0
    print("RESULT " + json.dumps({"seconds": seconds, "bytes": got.nbytes, "restored_from": got.source,
                                  "sha256": digest(model), "wire": wire.__file__}), flush=True)
    sys.stdin.readline()  # "EXIT": the parent has read our peak
    eng.close()
    return 0


# -- the parent ------------------------------------------------------------------------------------------
def status(pid: int) -> dict[str, int]:
    """The memory fields of /proc/PID/status, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(a, role: str, directory: Path, **extra: Any) -> list[str]:
    cmd = [sys.executable, __file__, "--_role", role, "--_dir", str(directory), "--size-mb", str(a.size_mb),
           "--tensors", str(a.tensors)]
    for k, v in extra.items():
        cmd += [f"--_{k}", str(v)]
    return cmd


def result_line(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError("no RESULT line")
    return json.loads(lines[-1][len("RESULT "):])


def trial(a, source: str) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="hotspare-bench-rss-", dir=shm_base()))
    holder, spare = d / "holder", d / "spare"
    holder.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        w = subprocess.run(child(a, "writer", holder, source=source), capture_output=True, text=True,
                           timeout=a.run_timeout, cwd=REPO)
        if w.returncode:
            return {"source": source, "ok": False, "error": f"writer exit {w.returncode}: {w.stderr.strip()[-1500:]}"}
        want = result_line(w.stdout)["sha256"]
        secret = secrets.token_bytes(32).hex()
        srv = subprocess.Popen(child(a, "server", holder), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=REPO)
        procs.append(srv)
        srv.stdin.write(secret + "\n")
        srv.stdin.flush()
        port = int(srv.stdout.readline())
        wk = subprocess.Popen(child(a, "worker", spare, port=port), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
        procs.append(wk)
        wk.stdin.write(secret + "\n")
        wk.stdin.flush()
        if wk.stdout.readline().strip() != "READY":
            return {"source": source, "ok": False, "error": f"worker not ready: {wk.stderr.read()[-1500:]}"}
        before = {"server": status(srv.pid), "worker": status(wk.pid)}
        reset = reset_peak(srv.pid) and reset_peak(wk.pid)
        wk.stdin.write("GO\n")
        wk.stdin.flush()
        line = wk.stdout.readline()
        after = {"server": status(srv.pid), "worker": status(wk.pid)}
        if not line.startswith("RESULT "):
            return {"source": source, "ok": False, "error": f"worker failed: {wk.stderr.read()[-1500:]}"}
        res = json.loads(line[len("RESULT "):])
        wk.stdin.write("EXIT\n")
        wk.stdin.flush()
        out: dict[str, Any] = {"source": source, "ok": res["sha256"] == want, "peak_reset": reset, **res}
        if not out["ok"]:
            out["error"] = "the restored parameters differ from the writer's"
        for side in ("server", "worker"):
            out[side] = {"before": before[side], "after": after[side],
                         "peak_growth": after[side]["VmHWM"] - before[side]["VmRSS"]}
        return out
    except (subprocess.TimeoutExpired, RuntimeError, ValueError, OSError) as e:
        return {"source": source, "ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a._role:
        return {"writer": writer, "server": server, "worker": worker}[a._role](a)
    size = (a.size_mb << 20) // 4 // a.tensors * 4 * a.tensors
    print(f"restore_rss ({a.label}): {a.size_mb} MiB in {a.tensors} tensors, {a.trials} trial(s) per source, "
          f"sources {', '.join(a.sources)}", flush=True)
    machine = machine_info()
    trials, problems = [], []
    for t in range(a.trials):
        for source in (a.sources if t % 2 == 0 else a.sources[::-1]):
            r = dict(trial(a, source), trial=t)
            trials.append(r)
            if r["ok"]:
                print(f"  trial {t} {source:7s}  {r['seconds']:.2f} s  worker peak +{r['worker']['peak_growth'] / 2**20:.0f}"
                      f" MiB  server peak +{r['server']['peak_growth'] / 2**20:.0f} MiB", flush=True)
            else:
                problems.append(f"trial {t} {source}: {r['error']}")
                print(f"  trial {t} {source:7s}  FAILED: {r['error']}", flush=True)
    stats: dict[str, Any] = {}
    for source in a.sources:
        ok = [r for r in trials if r["source"] == source and r["ok"]]
        stats[source] = {"n": len(ok), "seconds": summarize(r["seconds"] for r in ok),
                         **{f"{side}_peak_growth": summarize(r[side]["peak_growth"] for r in ok)
                            for side in ("worker", "server")}}
    mib = 2**20

    def cell(st: dict) -> str:
        return "-" if st["median"] is None else f"{st['median'] / mib:.0f} ({st['max'] / mib:.0f})"

    rows = [[s, st["n"], f"{fmt(st['seconds']['median'], 2)} ({fmt(st['seconds']['min'], 2)})",
             cell(st["worker_peak_growth"]), cell(st["server_peak_growth"]),
             "-" if st["worker_peak_growth"]["median"] is None else f"{st['worker_peak_growth']['median'] / size:.2f}",
             "-" if st["server_peak_growth"]["median"] is None else f"{st['server_peak_growth']['median'] / size:.2f}"]
            for s, st in stats.items()]
    print()
    print(table(["source", "n", "restore s, median (best)", "worker peak +MiB, median (max)",
                 "server peak +MiB, median (max)", "worker x size", "server x size"], rows))
    data = {"benchmark": "restore_rss", "smoke": a.smoke, "ok": not problems, "problems": problems,
            "config": {"label": a.label, "size_mb": a.size_mb, "bytes": size, "tensors": a.tensors, "trials": a.trials,
                       "sources": a.sources, "store": str(shm_base()),
                       "pythonpath": os.environ.get("PYTHONPATH", "")},
            "stats": stats, "trials": trials, "machine": machine, "argv": sys.argv[1:] if argv is None else argv}
    print(f"wrote {write_json(a.json, data)}")
    return finish("restore_rss", problems)


if __name__ == "__main__":
    sys.exit(main())
