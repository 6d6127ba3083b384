"""What the replica wire's integrity costs: put and get of one snapshot over loopback, two wires.

Finding F3 (security review): the per-frame HMAC covered the header and the body's *length*,
not the body; the fix puts every byte of a frame under HMAC-SHA256. This benchmark measures
replication throughput with the real :class:`hotspare.agents.replica.ReplicaServer` and the real
client (``Channel.client`` + ``put`` as the agent's ``Replicator`` sends it; ``fetch`` as a
restore gets it) for each *variant* of the wire:

* ``after``  -- ``recovery/wire.py`` and ``recovery/replica_client.py`` of this working tree;
* ``before`` -- the same two files and the server's ``agents/replica.py`` from git (``--before
  REV``; by default the newest commit whose ``wire.py`` still has the old frame, magic ``HSF1``),
  or from a directory holding a copy of the three (``--before DIR``). They are loaded as
  ``hotspare.recovery.wire`` / ``hotspare.recovery.replica_client`` / ``hotspare.agents.replica``
  before anything imports those names, so the server and the client both speak the old wire (the
  server of that commit: the working tree's streams replicas through the new wire's interfaces).

Every (trial, variant) runs in fresh processes -- a client, and a ReplicaServer of its own in a
second process (as agent and worker are), its store in ``/dev/shm`` -- and the variants alternate
within each trial (before, after; then after, before), so that a busy machine slows both alike.
Per run: one ``put`` of a ``--size-mb`` snapshot (``--tensors`` float32 tensors, random values,
one CRC32 each computed beforehand, as the agent's ``ReplicaStore.load`` does), timed from the
connection to the server's reply (it has verified and stored the replica); then one ``fetch`` of
it back (connection, request, reply, the client's checks), compared byte for byte with what was
put; then, for where the cost lies, ``frame``: the wire alone, one frame of the same body sent
by a forked process over a socketpair and timed until ``Channel.recv`` returns it (no server, no
store, no CRC32s). Reported per variant: seconds (median over trials, and the best) and GB/s
(1e9 bytes) for each operation, and the CPU seconds that each side's process burnt on it (user
+ system, all threads). The aim (the issue's): ``after`` within 10 % of ``before``'s throughput
at 0.5 GB, for put and for get (medians). On a shared machine the best of the trials says more
about what the code costs than the median does.

    .venv/bin/python benchmarks/replication_mac.py                 # 512 MiB, 5 trials per variant
    .venv/bin/python benchmarks/replication_mac.py --trials 7 --busy 1     # one core kept busy meanwhile
    .venv/bin/python benchmarks/replication_mac.py --before 46c0094          # the old wire from that commit
    .venv/bin/python benchmarks/replication_mac.py --smoke         # 4 MiB, 1 trial: does it work?
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
import zlib
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

VARIANTS = ("before", "after")
MODULES = ("recovery/wire", "recovery/replica_client", "agents/replica")  # of the old variant, in import order
SMOKE = {"size_mb": 9, "tensors": 8}  # > 2 x wire.CHUNK: the threaded paths too
AIM = 0.9  # after's throughput >= 0.9 x before's, per operation
OLD_FRAME = 'MAGIC = b"HSF1"'  # how --before auto recognises the wire from before the fix
OPS = ("put", "get", "frame")
STATS = ("s", "gbps", "client_cpu_s", "server_cpu_s")


def parse_args(argv: list[str] | None):
    p = base_parser(__doc__, "replication_mac.json", "trials per variant (each: one put and one get)")
    p.add_argument("--size-mb", type=int, default=512, help="snapshot size in MiB")
    p.add_argument("--tensors", type=int, default=64, help="float32 tensors in the snapshot, of equal size")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--before", default="auto",
                   help="the pre-fix wire: a git revision, a directory with wire.py and replica_client.py, "
                   "or 'auto' (the newest commit whose recovery/wire.py still has " + OLD_FRAME + ")")
    p.add_argument("--busy", type=int, default=0,
                   help="processes that spin on the CPU throughout (a node whose cores also train): "
                   "what the MAC's extra CPU seconds cost when no core is idle")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one (trial, variant) may take")
    # internal: the processes of one run
    p.add_argument("--_client", action="store_true", help=argparse_hidden())
    p.add_argument("--_server", metavar="STORE_DIR", help=argparse_hidden())
    p.add_argument("--_wire", metavar="DIR", default="", help=argparse_hidden())
    p.add_argument("--_seed", type=int, default=0, help=argparse_hidden())
    a = parse_args_smoke(p, argv, SMOKE)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad or not a.variants:
        p.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    return a


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


# -- the variants' modules --------------------------------------------------------------------------
def resolve_before(spec: str, into: Path) -> tuple[Path, str]:
    """A directory holding the pre-fix wire.py and replica_client.py, and where they came from."""
    if spec != "auto" and Path(spec).is_dir():
        src = Path(spec)
        for m in MODULES:
            if not (src / f"{Path(m).name}.py").is_file():
                raise RuntimeError(f"--before {spec}: no {Path(m).name}.py there")
        return src, f"directory {src}"
    rev = spec
    if spec == "auto":
        # every commit, newest first (not only those that changed wire.py): the last one before the
        # fix, whose agents/replica.py imports the package as today's does
        revs = git("log", "--format=%H").split()
        rev = next((r for r in revs if OLD_FRAME in git("show", f"{r}:recovery/wire.py")), "")
        if not rev:
            raise RuntimeError(f"--before auto: no commit's recovery/wire.py has {OLD_FRAME}")
    commit = git("rev-parse", "--short", f"{rev}^{{commit}}").strip()
    into.mkdir(parents=True, exist_ok=True)
    for m in MODULES:
        (into / f"{Path(m).name}.py").write_text(git("show", f"{commit}:{m}.py"))
    return into, f"git {commit}"


def git(*args: str) -> str:
    r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def use_wire(directory: str) -> None:
    """Load wire.py, replica_client.py and replica.py from ``directory`` as hotspare's own (before
    anything imports them); nothing to do for the working tree's."""
    if not directory:
        return
    import importlib
    import importlib.util

    for m in MODULES:
        package, leaf = f"hotspare.{Path(m).parent}", Path(m).name
        pkg = importlib.import_module(package)
        spec = importlib.util.spec_from_file_location(f"{package}.{leaf}", Path(directory) / f"{leaf}.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"{package}.{leaf}"] = mod
        spec.loader.exec_module(mod)
        setattr(pkg, leaf, mod)


# -- one run: the server process ------------------------------------------------------------------------
def serve(store_dir: str) -> int:
    from hotspare.agents.replica import ReplicaServer, ReplicaStore

    secret = bytes.fromhex(sys.stdin.readline().strip())
    srv = ReplicaServer(ReplicaStore(Path(store_dir)), secret).start()
    print(srv.port, flush=True)
    sys.stdin.read()  # until the client closes our stdin
    srv.stop()
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


# -- one run: the client process -------------------------------------------------------------------------
def client(a) -> int:
    import numpy as np

    from hotspare.recovery.replica_client import fetch
    from hotspare.recovery.wire import Channel, checksums

    size = a.size_mb << 20
    n = max(1, a.tensors)
    per = size // n // 4 * 4
    body = np.random.default_rng(a._seed).random(size // 4, dtype=np.float32).tobytes()
    tensors = [{"name": f"model.params/t{i}", "dtype": "float32", "shape": [per // 4], "offset": i * per,
                "nbytes": per} for i in range(n)]
    t0 = time.perf_counter()
    header = {"step": 7, "rank": 0, "tensors": tensors, "crc": checksums(tensors, body), "meta": {}}
    crc_s = time.perf_counter() - t0

    store = Path(tempfile.mkdtemp(prefix="hotspare-bench-mac-", dir=shm_base()))
    secret = secrets.token_bytes(32)
    srv = subprocess.Popen([sys.executable, __file__, "--_server", str(store), "--_wire", a._wire],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    out: dict[str, Any] = {"bytes": len(body), "sender_crc_s": crc_s}
    try:
        assert srv.stdin and srv.stdout
        srv.stdin.write(secret.hex() + "\n")
        srv.stdin.flush()
        port = int(srv.stdout.readline())

        def timed(fn):
            c0, s0, t0 = time.process_time(), cpu_seconds(srv.pid), time.perf_counter()
            r = fn()
            wall = time.perf_counter() - t0
            return r, {"s": wall, "gbps": len(body) / wall / 1e9, "client_cpu_s": time.process_time() - c0,
                       "server_cpu_s": cpu_seconds(srv.pid) - s0}

        def put():
            ch = Channel.client("127.0.0.1", port, secret, timeout=60)
            try:
                ch.send({"op": "put", "rank": 0, "snapshot": header}, body)
                return ch.recv()[0]
            finally:
                ch.close()

        reply, out["put"] = timed(put)
        if reply != {"ok": True}:
            raise RuntimeError(f"put refused: {reply}")
        (h, got), out["get"] = timed(lambda: fetch("127.0.0.1", port, secret, 0, 7, timeout=60))
        if got != body or h["crc"] != header["crc"]:
            raise RuntimeError("the fetched replica differs from the one put")
        del got
        out["frame"] = one_frame(Channel, body)
    finally:
        if srv.stdin:
            srv.stdin.close()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        shutil.rmtree(store, ignore_errors=True)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def one_frame(channel, body: bytes) -> dict[str, float]:
    """The wire alone: one frame with ``body`` from a forked process over a socketpair, timed
    until ``recv`` returns it (no server, no store, no CRC32s)."""
    import socket

    a, b = socket.socketpair()
    key, secret = os.urandom(32), os.urandom(32)
    c0, t0 = time.process_time(), time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the sender
        a.close()
        try:
            ch = channel(b, secret, key)
            ch.is_server = True
            ch.send({"op": "frame"}, body)
            b.recv(1)
        finally:
            os._exit(0)
    b.close()
    try:
        sender0 = cpu_seconds(pid)
        header, got = channel(a, secret, key).recv()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        sender = cpu_seconds(pid) - sender0
        a.sendall(b"x")
    finally:
        os.waitpid(pid, 0)
        a.close()
    if header != {"op": "frame"} or len(got) != len(body):
        raise RuntimeError("the frame arrived changed")
    return {"s": wall, "gbps": len(body) / wall / 1e9, "client_cpu_s": cpu, "server_cpu_s": sender}


# -- the benchmark ---------------------------------------------------------------------------------------
def primitives(mb: int = 64) -> dict[str, float]:
    """GB/s of this machine's SHA-256, HMAC-SHA256, CRC32 and a memory copy on one buffer."""
    import hmac

    buf = os.urandom(mb << 20)
    fns = {"sha256": lambda: hashlib.sha256(buf).digest(),
           "hmac_sha256": lambda: hmac.new(b"k" * 32, buf, hashlib.sha256).digest(),
           "crc32": lambda: zlib.crc32(buf), "copy": lambda: bytearray(buf)}
    res = {}
    for name, fn in fns.items():
        best = min(_time(fn) for _ in range(3))
        res[name] = len(buf) / best / 1e9
    return res


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_one(a, variant: str, wire_dir: str, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--_client", "--_wire", wire_dir, "--_seed", str(seed),
           "--size-mb", str(a.size_mb), "--tensors", str(a.tensors)]
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.run_timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "ok": False, "error": f"timed out after {a.run_timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        return {"variant": variant, "ok": False,
                "error": f"exit code {r.returncode}: {(r.stderr or r.stdout).strip()[-1500:]}"}
    return {"variant": variant, "ok": True, "loadavg_1m_before": round(load, 2),
            "wall_s": time.monotonic() - t0, **json.loads(lines[-1][len("RESULT "):])}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a._server:
        use_wire(a._wire)
        return serve(a._server)
    if a._client:
        use_wire(a._wire)
        return client(a)

    problems: list[str] = []
    machine = machine_info()  # its load average: before the runs
    tmp = Path(tempfile.mkdtemp(prefix="hotspare-bench-mac-wires-"))
    wires = {"after": ""}
    source = {"after": "working tree"}
    if "before" in a.variants:
        try:
            d, source["before"] = resolve_before(a.before, tmp / "before")
            wires["before"] = str(d)
        except RuntimeError as e:
            problems.append(f"before: {e}")
            a.variants = [v for v in a.variants if v != "before"]
    print(f"replication_mac: {a.size_mb} MiB in {a.tensors} tensors, {a.trials} trial(s), {a.busy} busy process(es); "
          + ", ".join(f"{v}: {source[v]}" for v in a.variants), flush=True)
    trials: list[dict[str, Any]] = []
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        for t in range(a.trials):
            order = a.variants if t % 2 == 0 else a.variants[::-1]
            for v in order:
                res = dict(run_one(a, v, wires[v], seed=t), trial=t)
                trials.append(res)
                if res["ok"]:
                    print(f"  trial {t} {v:6s}  " + "  ".join(f"{op} {res[op]['s']:.3f} s" for op in OPS)
                          + f"  (load {res['loadavg_1m_before']})", flush=True)
                else:
                    problems.append(f"trial {t} {v}: {res['error']}")
                    print(f"  trial {t} {v:6s}  FAILED: {res['error']}", flush=True)
    finally:
        for sp in spinners:
            sp.kill()
            sp.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    stats: dict[str, Any] = {}
    for v in a.variants:
        ok = [r for r in trials if r["variant"] == v and r["ok"]]
        stats[v] = {op: {k: summarize(r[op][k] for r in ok) for k in STATS} for op in OPS}
        stats[v]["n"] = len(ok)
    ratios: dict[str, Any] = {}
    if all(stats.get(v, {}).get("n") for v in VARIANTS):
        for op in OPS:
            after, before = stats["after"][op]["s"], stats["before"][op]["s"]
            per = [rb[op]["s"] / ra[op]["s"] for ra in trials for rb in trials
                   if ra["trial"] == rb["trial"] and ra["variant"] == "after" and rb["variant"] == "before"
                   and ra["ok"] and rb["ok"]]
            ratios[op] = {"median": before["median"] / after["median"], "best": before["min"] / after["min"],
                          "per_trial": per, "aim": AIM}
            ratios[op]["met"] = ratios[op]["median"] >= AIM if op != "frame" else None

    def cell(v: str, op: str, k: str, digits: int = 3, best: bool = False) -> str:
        st = stats[v][op][k]
        return fmt(st["median"], digits) + (f" ({fmt(st['min'], digits)})" if best else "")

    rows = [[v, op, stats[v]["n"], cell(v, op, "s", best=True), cell(v, op, "gbps", 2),
             cell(v, op, "client_cpu_s", 2), cell(v, op, "server_cpu_s", 2)] for op in OPS for v in a.variants]
    print()
    print(table(["wire", "operation", "n", "s, median (best)", "GB/s", "CPU s, client/receiver",
                 "CPU s, server/sender"], rows, left=2))
    for op, r in ratios.items():
        print(f"{op:5s}: after/before throughput, median {r['median']:.3f}, best {r['best']:.3f} "
              f"(per trial {', '.join(f'{x:.2f}' for x in r['per_trial'])})"
              + ("" if r["met"] is None else f"; aim >= {AIM} (median): {'met' if r['met'] else 'NOT met'}"))
    prim_mb = 4 if a.smoke else 64
    prim = primitives(prim_mb)
    print(f"this machine, one thread, {prim_mb} MiB: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in prim.items())
          + " (copy: into a new buffer)")

    data = {"benchmark": "replication_mac", "smoke": a.smoke, "ok": not problems, "problems": problems,
            "config": {"size_mb": a.size_mb, "tensors": a.tensors, "trials": a.trials, "variants": a.variants,
                       "busy": a.busy,
                       "before": source.get("before"), "store": str(shm_base())},
            "stats": stats, "ratios": ratios, "primitives_gbps": prim, "trials": trials,
            "machine": machine, "argv": sys.argv[1:] if argv is None else argv}
    print(f"wrote {write_json(a.json, data)}")
    return finish("replication_mac", problems)


if __name__ == "__main__":
    sys.exit(main())
