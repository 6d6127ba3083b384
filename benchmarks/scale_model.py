"""A recovery model at 512 and 1,024 GPUs (issue 15, item 3): ``benchmarks/scale.py --model``.

No etcd, no processes: this combines what ``benchmarks/scale.py`` measured (decision latency
at N simulated nodes, on this machine) and what ``benchmarks/restore_rss.py`` measured
(hotspare's own restore throughput) with stated assumptions, each with its source, into a
per-phase estimate of one recovery, in hotspare's phases (docs/architecture.md, "Recovery
timeline and measurement"):

* **detect**: the lost node's lease expires (node loss), or its agent reports the dead worker
  (worker exit);
* **decide + observe**: the controller commits the new world and every live agent has read it
  (measured by ``scale.py`` at N nodes; interpolated in log-log space between measured N,
  extrapolated, and flagged so, outside them);
* **rebuild**: the new epoch's NCCL communicator over all ranks (published figures only: not
  measured here);
* **restore**: the spare's workers fetch the lost ranks' state from the replica holder and
  load it onto their GPUs.

Each phase is a range, low to high; a total is the sum of the lows and the sum of the highs.

    .venv/bin/python benchmarks/scale.py --model --plot benchmarks/scale_latency.png \\
        --json benchmarks/out/scale_model.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from common import OUT, REPO, finish, table, write_json

KINDS = ("node loss", "worker exit")
GB = 1e9
SCALE_COMMAND = ".venv/bin/python benchmarks/scale.py --nodes 100 --failures 20 --json benchmarks/out/scale_100.json " \
                "(and --nodes 1000 ... --json benchmarks/out/scale_1000.json)"
RESTORE_JSON = OUT / "restore_rss_after.json"


@dataclasses.dataclass(frozen=True)
class Assumption:
    value: float | str
    unit: str
    kind: str  # measured | sourced | derived | hotspare code | given | assumption, not sourced
    source: str


def _lease_ttl_default() -> float:
    from hotspare.orchestrator.spec import JobSpec

    return float(next(f.default for f in dataclasses.fields(JobSpec) if f.name == "lease_ttl"))


HGX_RA = "https://docs.nvidia.com/reference-architectures/hgx-ai-factory-h100-h200-b200/"

#: Every number the model uses that it does not read from a measured JSON file.
ASSUMPTIONS: dict[str, Assumption] = {
    "gpus_per_node": Assumption(
        8, "GPUs/node", "sourced",
        "NVIDIA HGX AI Factory reference architecture (H100/H200/B200), abstract: '2-8-9-400' "
        "(2 CPUs, 8 GPUs, 9 NICs, 400 Gb/s per GPU) at 32, 64 and 128 nodes: " + HGX_RA + "abstract.md"),
    "params": Assumption(65e9, "parameters", "given", "issue 15, item 3: a 65B model trained with AdamW"),
    "state_bytes_per_param": Assumption(
        14, "B/param", "sourced",
        "ZeRO (Rajbhandari et al., SC'20, arXiv:1910.02054, sec. 3.1): mixed-precision Adam holds 2 B of "
        "16-bit parameters + 2 B of 16-bit gradients + K = 12 B (fp32 parameters, momentum, variance) per "
        "parameter; a restore needs all but the gradients: 2 + 12 = 14 B. (FSDP with fp32 sharded "
        "parameters: 12 B.)"),
    "sharding": Assumption(
        "1/N", "of the state per rank", "assumption, not sourced",
        "the state is fully sharded over all N ranks (ZeRO-3 / FSDP FULL_SHARD; tensor or pipeline "
        "parallelism that replicates no optimizer state gives the same share): per-rank state = "
        "params x 14 B / N"),
    "lease_ttl": Assumption(
        _lease_ttl_default(), "s", "hotspare code", "hotspare's default lease_ttl (orchestrator/spec.py, JobSpec)"),
    "keepalive_fraction": Assumption(
        1 / 3, "of the TTL", "hotspare code",
        "an agent's lease keepalive goes out every TTL/3 (orchestrator/store/lease.py, Lease._period)"),
    "etcd_expiry_sweep": Assumption(
        0.5, "s", "sourced",
        "etcd revokes expired leases in a loop that runs every 500 ms (server/lease/lessor.go, "
        "lessor.runLoop: https://github.com/etcd-io/etcd/blob/main/server/lease/lessor.go)"),
    "worker_exit_detect": Assumption(
        0.105, "s", "measured",
        "benchmarks/RESULTS.md, 'Recovery time (issue 2)': worker kill, detect median of 5 (4 one-rank "
        "nodes on this 2-vCPU machine). The agent watches its own workers, so this does not grow with N"),
    "nccl_init_low": Assumption(
        2.46, "s", "sourced",
        "one node of 8 x H100, NCCL 2.22.3: 'Init timings: ... nranks 8 total 2.46' (NVIDIA/nccl#534, "
        "comment of 2024-07-22: https://github.com/NVIDIA/nccl/issues/534). One node: a floor for 64-128 nodes"),
    "nccl_init_high": Assumption(
        150.0, "s", "sourced",
        "'We are experiencing 2.5-minute init time at large scale (e.g. above certain K GPUs)', default "
        "init path, used on restarts after GPU failures (Meta, NVIDIA/nccl#1156, comment of 2024-01-23: "
        "https://github.com/NVIDIA/nccl/issues/1156). At more GPUs than 1,024: a ceiling here"),
    "ns_bandwidth_per_node": Assumption(
        400, "Gb/s", "sourced",
        "two 200 GbE ports per node on the CPU converged (north/south) network, the TCP network: "
        + HGX_RA + "network-logical-architecture.md. hotspare's replica wire is TCP (agents/replica.py), "
        "so it is this network, not the RDMA compute fabric"),
    "compute_fabric_per_gpu": Assumption(
        400, "Gb/s", "sourced (not used)",
        "RDMA east/west fabric, one 400 Gb/s NIC per GPU (same reference architecture). Not used: "
        "hotspare's replica wire does not use RDMA"),
    "pcie_h2d": Assumption(
        63, "GB/s", "sourced",
        "host-to-GPU copy over PCIe Gen5 x16 (H200 SXM's host interconnect in NVIDIA's MLPerf system "
        "description: https://github.com/mlcommons/inference_results_v4.1/blob/main/closed/NVIDIA/systems/"
        "H200-SXM-141GBx8_TRT_MaxQ.json): 32 GT/s x 16 lanes x 128/130 = 63 GB/s per direction, the "
        "theoretical peak"),
    "ranks_restoring_at_once": Assumption(
        8, "ranks", "assumption, not sourced",
        "after a node loss the spare node's 8 workers fetch their ranks' state at the same time and share "
        "its (and the holder's) north/south link; after a worker exit, one rank alone uses the link"),
    "stream_rate_scales": Assumption(
        1, "x this machine", "assumption, not sourced",
        "one restore stream on a real node runs as fast as the measured one here (it is CPU-bound: TCP, "
        "HMAC-SHA256 over every byte, CRC32s, one copy in Python), no faster and no slower"),
}

#: Published figures quoted for context; the model does not use them.
CONTEXT = [
    "TrainMover (Lao et al., arXiv:2412.12636, OSDI '26): ~20 s of downtime per interruption at 1,024 GPUs "
    "with standby machines and a delta-based communicator set-up (not a full NCCL re-init).",
    "NCCLX (Si et al., Meta, arXiv:2510.20171): stock NCCL start-up of ~265 s at 96k GPUs, as quoted by a "
    "third-party summary (https://rajatbisht.net/paper_summaries/brief_summary/0019_NCCLX.html); not "
    "checked against the paper's text, so not used.",
]


#: What the model cannot see, printed with it.
CAVEATS = [
    "decide+observe was measured with 1 rank per node (a world of N seats); at 8 GPUs per node the world "
    "record each agent reads has 8 seats per node, so its parse is ~8x longer than at the same node count here.",
    "decide+observe was measured with all N agents simulated on this machine's 2 vCPUs, reading one after "
    "another; on a cluster each agent reads on its own machine, in parallel, so the measured fan-out is pessimistic.",
    "rebuild is a published range, not a measurement: no sourced NCCL init time at 512 or 1,024 GPUs was found; "
    "it dominates the total.",
]


def _rel(path: Path | str) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


class MissingMeasurements(Exception):
    """The measured inputs the model needs are not there; the message names the command."""


# -- the measured inputs --------------------------------------------------------------------------
def _pct(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile ``scale.py``'s ``stats`` uses (q in 0..1)."""
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def default_scale_inputs(out: Path = OUT) -> list[Path]:
    """benchmarks/out/scale*.json, less the "before" runs (``--agent-read prefix``, or named
    ``*_before``/``*_prefix`` as in RESULTS.md) and anything that is not a scale run."""
    return [p for p in sorted(out.glob("scale*.json"))
            if not p.stem.endswith(("_before", "_prefix")) and p.stem != "scale_model"]


def load_scale(paths: Iterable[Path | str]) -> dict[str, list[dict[str, float]]]:
    """Per failure kind, one point per measured node count: nodes, latency p50/p99 (until
    every agent read the new world) and commit p50/p99 (until the controller's transaction),
    from ``scale.py`` results that were ok, not smoke runs, and used the agents' current
    protocol. Raises :class:`MissingMeasurements` when fewer than two node counts remain."""
    points: dict[str, dict[int, dict[str, float]]] = {k: {} for k in KINDS}
    for path in paths:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise MissingMeasurements(f"cannot read {path} ({e.__class__.__name__}); produce it with "
                                      f"{SCALE_COMMAND}") from None
        args = data.get("args", {})
        if (data.get("benchmark") != "scale" or data.get("smoke") or not data.get("ok")
                or args.get("agent_read", "keys") != "keys"):
            continue
        nodes = int(args["nodes"])
        for kind in KINDS:
            rows = [r for r in data["result"]["failures"] if r["kind"] == kind and r["ok"]]
            if not rows:
                continue
            if nodes in points[kind]:
                raise MissingMeasurements(f"two scale results at {nodes} nodes ({path} and an earlier one); "
                                          "name the ones to use with --from PATH ...")
            lat = [r["decision_latency_s"] for r in rows]
            com = [r["detect_to_commit_s"] for r in rows]
            points[kind][nodes] = {"nodes": nodes, "n": len(rows), "p50": statistics.median(lat),
                                   "p99": _pct(lat, 0.99), "commit_p50": statistics.median(com),
                                   "commit_p99": _pct(com, 0.99), "source": _rel(path)}
    out = {k: [v[n] for n in sorted(v)] for k, v in points.items()}
    for kind, pts in out.items():
        if len(pts) < 2:
            raise MissingMeasurements(
                f"the model needs measured scale results at two node counts or more ({kind}: "
                f"{len(pts)} found); produce them with {SCALE_COMMAND}")
    return out


def load_restore(path: Path | str = RESTORE_JSON) -> dict[str, Any] | None:
    """hotspare's restore throughput measured by ``benchmarks/restore_rss.py`` (the
    ``replica`` trials: fetch from a holder's replica file, MAC and CRC32 checks, load into the
    worker's model): median bytes per second. None when the file is absent."""
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    trials = [t for t in data.get("trials", []) if t.get("source") == "replica" and t.get("ok")]
    if not trials:
        return None
    rates = [t["bytes"] / t["seconds"] for t in trials]
    return {"bytes_per_s": statistics.median(rates), "n": len(rates), "bytes": trials[0]["bytes"],
            "seconds_median": statistics.median(t["seconds"] for t in trials), "source": _rel(path)}


# -- the model ------------------------------------------------------------------------------------
def interp_loglog(points: Sequence[tuple[float, float]], x: float) -> tuple[float, str]:
    """y at ``x`` on the straight line in log-log space through the measured ``points``
    ((x, y), two at least, all positive): between the two measured x around it
    ("interpolated"), through the nearest two outside them ("extrapolated"), or the measured y
    itself ("measured")."""
    pts = sorted(points)
    if len(pts) < 2:
        raise ValueError("two measured points at least")
    for px, py in pts:
        if px == x:
            return py, "measured"
    if x < pts[0][0]:
        (xa, ya), (xb, yb), how = pts[0], pts[1], "extrapolated"
    elif x > pts[-1][0]:
        (xa, ya), (xb, yb), how = pts[-2], pts[-1], "extrapolated"
    else:
        i = next(i for i in range(len(pts) - 1) if pts[i][0] < x < pts[i + 1][0])
        (xa, ya), (xb, yb), how = pts[i], pts[i + 1], "interpolated"
    t = (math.log(x) - math.log(xa)) / (math.log(xb) - math.log(xa))
    return math.exp(math.log(ya) + t * (math.log(yb) - math.log(ya))), how


def state_bytes_per_rank(n_gpus: int, a: dict[str, Assumption] = ASSUMPTIONS) -> float:
    return a["params"].value * a["state_bytes_per_param"].value / n_gpus


def restore_seconds(nbytes: float, bytes_per_s: float, a: dict[str, Assumption] = ASSUMPTIONS) -> float:
    """Fetch ``nbytes`` at ``bytes_per_s``, then copy them to the GPU over PCIe."""
    return nbytes / bytes_per_s + nbytes / (a["pcie_h2d"].value * GB)


def model(n_gpus: int, measured: dict[str, Any], a: dict[str, Assumption] = ASSUMPTIONS) -> dict[str, Any]:
    """Per-phase estimates of one recovery at ``n_gpus`` GPUs, for a node loss and a worker
    exit: each phase ``{"low", "high", "basis"}`` in seconds, and the total. ``measured`` is
    ``{"scale": load_scale(...), "restore": load_restore(...)}``."""
    gpn = int(a["gpus_per_node"].value)
    if n_gpus % gpn:
        raise ValueError(f"{n_gpus} GPUs is not a whole number of {gpn}-GPU nodes")
    nodes = n_gpus // gpn
    ttl = a["lease_ttl"].value
    per_rank = state_bytes_per_rank(n_gpus, a)
    restore = measured.get("restore")
    ns = a["ns_bandwidth_per_node"].value * 1e9 / 8  # bytes/s
    out: dict[str, Any] = {"n_gpus": n_gpus, "nodes": nodes, "state_bytes_per_rank": per_rank, "scenarios": {}}
    for kind in KINDS:
        pts = measured["scale"][kind]
        p50, how = interp_loglog([(p["nodes"], p["p50"]) for p in pts], nodes)
        p99, _ = interp_loglog([(p["nodes"], p["p99"]) for p in pts], nodes)
        c50, _ = interp_loglog([(p["nodes"], p["commit_p50"]) for p in pts], nodes)
        c99, _ = interp_loglog([(p["nodes"], p["commit_p99"]) for p in pts], nodes)
        span = f"{pts[0]['nodes']}-{pts[-1]['nodes']} nodes"
        if kind == "node loss":
            detect = {"low": ttl - ttl * a["keepalive_fraction"].value, "high": ttl + a["etcd_expiry_sweep"].value,
                      "basis": "derived: lease TTL less one keepalive period .. TTL + etcd's expiry sweep"}
            streams = int(a["ranks_restoring_at_once"].value)
        else:
            x = a["worker_exit_detect"].value
            detect = {"low": x, "high": x, "basis": "measured (small job, this machine)"}
            streams = 1
        link = ns / streams
        fast = restore_seconds(per_rank, link, a)
        slow = restore_seconds(per_rank, min(link, restore["bytes_per_s"]), a) if restore else fast
        phases = {
            "detect": detect,
            "decide+observe": {"low": p50, "high": p99, "basis": f"{how} from measured {span} (p50..p99)",
                               "decide_low": c50, "decide_high": c99, "how": how},
            "rebuild": {"low": a["nccl_init_low"].value, "high": a["nccl_init_high"].value,
                        "basis": "sourced range (NCCL init, not measured here)"},
            "restore": {"low": fast, "high": slow,
                        "basis": f"{per_rank / GB:.2f} GB/rank at the north/south link's share ({link / GB:.2f} GB/s)"
                                 + (f" .. at hotspare's measured {restore['bytes_per_s'] / GB:.2f} GB/s"
                                    if restore else " (hotspare's own rate not measured)")},
        }
        total = {"low": sum(p["low"] for p in phases.values()), "high": sum(p["high"] for p in phases.values())}
        out["scenarios"][kind] = {"phases": phases, "total": total, "decide_observe": how}
    return out


def run_model(measured: dict[str, Any], gpus: Sequence[int] = (512, 1024),
              a: dict[str, Assumption] = ASSUMPTIONS) -> dict[str, Any]:
    """The model at each of ``gpus``, with its inputs: what ``--model`` prints, plots and writes."""
    return {"benchmark": "scale_model", "measured": measured, "estimates": [model(n, measured, a) for n in gpus],
            "assumptions": {k: dataclasses.asdict(v) for k, v in a.items()}, "caveats": CAVEATS,
            "context": CONTEXT}


# -- output -------------------------------------------------------------------------------------
def _num(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _rng(p: dict[str, float]) -> str:
    lo, hi = p["low"], p["high"]
    return _num(lo) if math.isclose(lo, hi, rel_tol=0.005) else f"{_num(lo)}-{_num(hi)}"


def estimate_table(results: dict[str, Any]) -> str:
    rows = []
    for e in results["estimates"]:
        for kind, sc in e["scenarios"].items():
            ph = sc["phases"]
            flag = "" if sc["decide_observe"] == "measured" else f" ({sc['decide_observe'][:6]}.)"
            rows.append((f"{e['n_gpus']:,} GPUs ({e['nodes']} nodes)", kind, _rng(ph["detect"]),
                         _rng(ph["decide+observe"]) + flag, _rng(ph["rebuild"]), _rng(ph["restore"]),
                         _rng(sc["total"])))
    return table(["size", "failure", "detect s", "decide+observe s", "rebuild s", "restore s", "total s"],
                 rows, left=2)


def assumption_table(results: dict[str, Any]) -> str:
    rows = [(k, v["value"] if isinstance(v["value"], str) else f"{v['value']:.4g}", v["unit"], v["kind"], v["source"])
            for k, v in results["assumptions"].items()]
    m = results["measured"]
    for kind, pts in m["scale"].items():
        for p in pts:
            rows.append((f"decision latency, {kind}", f"{p['p50']:.3f} / {p['p99']:.3f}", f"s p50/p99 at {p['nodes']} nodes",
                         "measured", f"{p['source']} ({p['n']} failures, this 2-vCPU machine, 1 rank per node)"))
    if m.get("restore"):
        r = m["restore"]
        rows.append(("hotspare restore rate", f"{r['bytes_per_s'] / GB:.3f}", "GB/s", "measured",
                     f"{r['source']} ({r['n']} restores of {r['bytes'] / 2**30:.0f} GiB from a replica file, "
                     f"median {r['seconds_median']:.2f} s; loopback, this 2-vCPU machine)"))
    return table(["input", "value", "unit", "kind", "source"], rows, left=5)


def plot(results: dict[str, Any], path: Path | str) -> Path:
    """A PNG of decision latency (p50 and p99, until every agent read the new world) against
    the node count, log-log: the measured points joined, the model's points hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"node loss": "tab:blue", "worker exit": "tab:orange"}
    for kind, pts in results["measured"]["scale"].items():
        xs = [p["nodes"] for p in pts]
        for q, key, style in (("p50", "low", "-"), ("p99", "high", "--")):
            ax.plot(xs, [p[q] for p in pts], style, marker="o", color=colors[kind], label=f"{kind} {q}, measured")
            model_pts = [(e["nodes"], e["scenarios"][kind]["phases"]["decide+observe"][key])
                         for e in results["estimates"]]
            line = sorted(model_pts + [(p["nodes"], p[q]) for p in pts])
            ax.plot(*zip(*line, strict=True), ":", color=colors[kind], linewidth=0.8)  # the model's line
            ax.plot(*zip(*model_pts, strict=True), "o", mfc="none", color=colors[kind])
        for e in results["estimates"]:
            d = e["scenarios"][kind]["phases"]["decide+observe"]
            above = kind == "worker exit"
            ax.annotate(f"{e['n_gpus']} GPUs ({d['how']})", (e["nodes"], d["high"] if above else d["low"]),
                        textcoords="offset points", xytext=(-10, 8) if above else (6, -12), fontsize=7,
                        color=colors[kind])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nodes (simulated agents, 1 rank each when measured)")
    ax.set_ylabel("decision latency, s (until every agent read the new world)")
    ax.set_title("hotspare decision latency: measured on a 2-vCPU machine (filled), model for 8-GPU nodes "
                 "(hollow, dotted: log-log)", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scale.py --model", description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="inputs", nargs="+", metavar="PATH",
                   help="scale.py result files (default: benchmarks/out/scale*.json, less *_before/*_prefix)")
    p.add_argument("--restore-from", default=str(RESTORE_JSON), metavar="PATH",
                   help="restore_rss.py result with hotspare's own restore rate (optional)")
    p.add_argument("--gpus", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--plot", metavar="PATH", help="write the decision-latency plot (PNG) here")
    p.add_argument("--json", default=str(OUT / "scale_model.json"), help="where to write the model")
    a = p.parse_args(argv)
    inputs = a.inputs or default_scale_inputs()
    try:
        if not inputs:
            raise MissingMeasurements(f"no measured scale results in {OUT} (scale*.json); produce them with "
                                      f"{SCALE_COMMAND}")
        measured = {"scale": load_scale(inputs), "restore": load_restore(a.restore_from)}
        results = run_model(measured, a.gpus)
    except (MissingMeasurements, ValueError) as e:
        return finish("scale --model", [str(e)])
    print(estimate_table(results))
    print("\nlow-high: detect from the lease TTL (node loss); decide+observe p50-p99 of the measured latency "
          "at that node count (interp./extrap. = between / outside the measured node counts); rebuild the "
          "sourced NCCL init range; restore from the link's share up to hotspare's measured rate.\n")
    for line in CAVEATS:
        print(f"caveat: {line}")
    if measured["restore"] is None:  # the restore column is then the link's share only: say so
        print(f"caveat: hotspare's own restore rate is not measured here ({a.restore_from} is missing): the "
              "restore column is the link's share alone, a floor; run .venv/bin/python benchmarks/restore_rss.py "
              f"--label after --trials 5 --json {RESTORE_JSON}")
    print()
    print(assumption_table(results))
    for line in CONTEXT:
        print(f"context (not used): {line}")
    if a.plot:
        print(f"plot: {plot(results, a.plot)}")
    write_json(a.json, results)
    print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
