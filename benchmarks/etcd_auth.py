"""What the embedded etcd's password costs: `up`, a login, and put/get round trips.

Security review F2's second half: `hotspare up` now enables etcd authentication (a generated
password for etcd's root user, ``orchestrator/embedded_auth.py``). Three variants of the
embedded cluster, each started afresh in a new state dir, alternating within every trial so
that a busy machine slows them alike:

* ``plain`` -- what `up` did before: etcd and a controller, no authentication;
* ``auth`` -- `up` as it is (``embedded.up``): authentication on, the password hashed with
  ``--bcrypt-cost 4``;
* ``auth_cost10`` -- the same with etcd's default bcrypt cost (10): why the embedded etcd
  lowers it.

Per (trial, variant): ``up_s``, the wall time of bringing the cluster up (etcd started and
healthy, authentication set up, the controller started); ``login_s``, the median time of
``--logins`` new connections (``Store(...)``; with a user, the first request logs in: what
every CLI command, agent and worker pays once); ``pairs_per_s``, ``--ops`` put + get round
trips of a 64-byte value under ``/hotspare/`` on one connection, per second.

    .venv/bin/python benchmarks/etcd_auth.py --trials 5
    .venv/bin/python benchmarks/etcd_auth.py --smoke
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    base_parser,
    finish,
    fmt,
    machine_info,
    parse_args_smoke,
    summarize,
    table,
    write_json,
)

from hotspare.orchestrator import embedded, embedded_auth
from hotspare.orchestrator.etcd_server import start_etcd, stop_pid

VARIANTS = ("plain", "auth", "auth_cost10")
SMOKE = {"ops": 50, "logins": 2}


def parse_args(argv: list[str] | None):
    p = base_parser(__doc__, "etcd_auth.json", "trials (each: every variant once)")
    p.add_argument("--ops", type=int, default=2000, help="put + get round trips per (trial, variant)")
    p.add_argument("--logins", type=int, default=7, help="new connections timed per (trial, variant)")
    return parse_args_smoke(p, argv, SMOKE)


def start(variant: str, sd: Path) -> embedded.Cluster:
    """The embedded cluster of ``sd`` as ``variant`` starts it."""
    if variant != "plain":
        embedded_auth.ETCD_ARGS[:] = ["--bcrypt-cost", "10" if variant == "auth_cost10" else "4"]
        return embedded.up(sd, log=lambda _: None)
    embedded_auth.private_dir(sd)
    srv = start_etcd(sd / "etcd", sd / "etcd.log", detach=True)
    c = embedded.Cluster(srv.endpoint, srv.pid, 0, str(sd), srv.peer_port)
    c.controller_pid = embedded.start_controller(c, sd)
    return c


def measure(variant: str, ops: int, logins: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"hotspare-auth-{variant}-") as d:
        sd = Path(d) / "state"
        t0 = time.perf_counter()
        c = start(variant, sd)
        up_s = time.perf_counter() - t0
        try:
            times = []
            for _ in range(logins):
                t = time.perf_counter()
                st = c.store()
                st.get("/hotspare/bench/k")  # the first request (with a user: after the login)
                times.append(time.perf_counter() - t)
                st.close()
            st = c.store()
            t = time.perf_counter()
            for i in range(ops):
                st.put(f"/hotspare/bench/k{i % 16}", b"v" * 64)
                st.get(f"/hotspare/bench/k{i % 16}")
            pairs = ops / (time.perf_counter() - t)
            st.close()
        finally:
            stop_pid(c.controller_pid)
            stop_pid(c.etcd_pid)
    return {"variant": variant, "up_s": up_s, "login_s": statistics.median(times), "pairs_per_s": pairs}


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    runs, problems = [], []
    for trial in range(a.trials):
        order = VARIANTS if trial % 2 == 0 else VARIANTS[::-1]
        for v in order:
            try:
                runs.append({"trial": trial, **measure(v, a.ops, a.logins)})
            except Exception as e:  # noqa: BLE001 - reported as the run's problem
                problems.append(f"trial {trial} {v}: {type(e).__name__}: {e}")
    stats = {v: {k: summarize(r[k] for r in runs if r["variant"] == v) for k in ("up_s", "login_s", "pairs_per_s")}
             for v in VARIANTS}
    print(table(["variant", "up s", "best", "login ms", "best", "put+get pairs/s", "best"],
                [[v, fmt(s["up_s"]["median"]), fmt(s["up_s"]["min"]), fmt(_ms(s["login_s"]["median"]), 1),
                  fmt(_ms(s["login_s"]["min"]), 1), fmt(s["pairs_per_s"]["median"], 0),
                  fmt(s["pairs_per_s"]["max"], 0)] for v, s in stats.items()]))
    print(f"(medians and best of {a.trials} trial(s); {a.ops} pairs and {a.logins} logins per run)")
    write_json(a.json, {"benchmark": "etcd_auth", "smoke": a.smoke, "ok": not problems, "problems": problems,
                        "machine": machine_info(), "args": {"trials": a.trials, "ops": a.ops, "logins": a.logins},
                        "stats": stats, "runs": runs})
    return finish("etcd_auth", problems)


if __name__ == "__main__":
    sys.exit(main())
