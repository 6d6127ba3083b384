"""The recovery model of ``benchmarks/scale.py --model`` (benchmarks/scale_model.py): its
arithmetic, its log-log interpolation (and the flag when it extrapolates), its inputs, and its
plot. No etcd, no timing."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import scale_model as sm  # noqa: E402 - benchmarks/ is not a package


def scale_result(path: Path, nodes: int, lat: dict[str, list[float]], commit: float = 0.05, **extra) -> Path:
    """A result file in ``scale.py``'s format: per kind, one ok failure row per latency."""
    rows = [{"kind": kind, "ok": True, "decision_latency_s": x, "detect_to_commit_s": commit}
            for kind, xs in lat.items() for x in xs]
    data = {"benchmark": "scale", "smoke": False, "ok": True, "args": {"nodes": nodes, **extra.pop("args", {})},
            "result": {"failures": rows}, **extra}
    path.write_text(json.dumps(data))
    return path


def measured(p50_100: float = 1.0, p50_1000: float = 10.0, restore_bps: float | None = 1e9) -> dict:
    pts = [{"nodes": 100, "n": 3, "p50": p50_100, "p99": 2 * p50_100, "commit_p50": 0.01, "commit_p99": 0.02,
            "source": "a"},
           {"nodes": 1000, "n": 3, "p50": p50_1000, "p99": 2 * p50_1000, "commit_p50": 0.1, "commit_p99": 0.2,
            "source": "b"}]
    restore = None if restore_bps is None else {"bytes_per_s": restore_bps, "n": 1, "bytes": 1, "seconds_median": 1,
                                                "source": "c"}
    return {"scale": {"node loss": pts, "worker exit": pts}, "restore": restore}


def test_state_per_rank_of_65b_adamw_at_1024_gpus():
    assert sm.ASSUMPTIONS["params"].value == 65e9
    assert sm.ASSUMPTIONS["state_bytes_per_param"].value == 14
    assert sm.state_bytes_per_rank(1024) == pytest.approx(65e9 * 14 / 1024)  # 0.889 GB
    assert sm.state_bytes_per_rank(512) == pytest.approx(2 * sm.state_bytes_per_rank(1024))


def test_restore_time_is_bytes_over_bandwidth_plus_the_copy_to_the_gpu():
    pcie = sm.ASSUMPTIONS["pcie_h2d"].value * 1e9
    assert sm.restore_seconds(8e9, 2e9) == pytest.approx(4.0 + 8e9 / pcie)


def test_interpolation_in_log_log_space_between_two_measured_points():
    y, how = sm.interp_loglog([(100, 1.0), (1000, 10.0)], 316.2277660168379)  # sqrt(10) decades
    assert how == "interpolated" and y == pytest.approx(10 ** 0.5)
    y, how = sm.interp_loglog([(1000, 9.0), (100, 1.0)], 100)  # order does not matter
    assert (y, how) == (1.0, "measured")


def test_outside_the_measured_node_counts_is_flagged_as_extrapolated():
    pts = [(100, 1.0), (1000, 10.0), (10000, 1000.0)]
    y, how = sm.interp_loglog(pts, 10)
    assert how == "extrapolated" and y == pytest.approx(0.1)  # through the two lowest points
    y, how = sm.interp_loglog(pts, 100000)
    assert how == "extrapolated" and y == pytest.approx(100000.0)  # through the two highest
    with pytest.raises(ValueError):
        sm.interp_loglog([(100, 1.0)], 200)


def test_model_phases_at_1024_and_512_gpus():
    a = dict(sm.ASSUMPTIONS, lease_ttl=dataclasses.replace(sm.ASSUMPTIONS["lease_ttl"], value=6.0))
    e = sm.model(1024, measured(), a)
    assert e["nodes"] == 128
    loss = e["scenarios"]["node loss"]
    ph = loss["phases"]
    assert (ph["detect"]["low"], ph["detect"]["high"]) == pytest.approx((6.0 - 2.0, 6.0 + 0.5))
    assert ph["decide+observe"]["low"] == pytest.approx(1.28)  # 1 s at 100 nodes, 10 s at 1000: y = x / 100
    assert ph["decide+observe"]["high"] == pytest.approx(2.56)
    assert loss["decide_observe"] == "interpolated"
    assert (ph["rebuild"]["low"], ph["rebuild"]["high"]) == (2.46, 150.0)
    per_rank = 65e9 * 14 / 1024
    pcie = 63e9
    link = 400e9 / 8 / 8  # a node's 2 x 200 GbE shared by its 8 restoring ranks
    assert ph["restore"]["low"] == pytest.approx(per_rank / link + per_rank / pcie)
    assert ph["restore"]["high"] == pytest.approx(per_rank / 1e9 + per_rank / pcie)  # the measured 1 GB/s
    assert loss["total"]["low"] == pytest.approx(sum(p["low"] for p in ph.values()))
    assert loss["total"]["high"] == pytest.approx(sum(p["high"] for p in ph.values()))
    exit_ = e["scenarios"]["worker exit"]["phases"]
    assert exit_["detect"]["low"] == exit_["detect"]["high"] == 0.105
    assert exit_["restore"]["low"] == pytest.approx(per_rank / (400e9 / 8) + per_rank / pcie)  # one rank: the link
    small = sm.model(512, measured(), a)
    assert small["nodes"] == 64 and small["scenarios"]["node loss"]["decide_observe"] == "extrapolated"
    assert small["scenarios"]["node loss"]["phases"]["decide+observe"]["low"] == pytest.approx(0.64)
    with pytest.raises(ValueError):
        sm.model(1020, measured())  # not a whole number of 8-GPU nodes


def test_without_a_measured_restore_rate_the_restore_range_is_the_link_alone():
    ph = sm.model(1024, measured(restore_bps=None))["scenarios"]["node loss"]["phases"]["restore"]
    assert ph["low"] == ph["high"]
    assert "not measured" in ph["basis"]


def test_load_scale_keeps_current_protocol_full_runs_and_computes_percentiles(tmp_path):
    lat = {"node loss": [0.1, 0.2, 0.3, 0.4, 5.0], "worker exit": [1.0, 2.0, 3.0]}
    files = [scale_result(tmp_path / "scale_100.json", 100, lat),
             scale_result(tmp_path / "scale_1000.json", 1000, {k: [10 * x for x in v] for k, v in lat.items()}),
             scale_result(tmp_path / "scale_1000_prefix.json", 1000, lat, args={"agent_read": "prefix"}),
             scale_result(tmp_path / "smoke.json", 50, lat, smoke=True)]
    pts = sm.load_scale(files)
    assert [p["nodes"] for p in pts["node loss"]] == [100, 1000]
    p100 = pts["node loss"][0]
    assert (p100["p50"], p100["p99"], p100["commit_p50"]) == (0.3, 5.0, 0.05)
    assert pts["worker exit"][1]["p50"] == 20.0
    assert sm.default_scale_inputs(tmp_path) == [tmp_path / "scale_100.json", tmp_path / "scale_1000.json"]


def test_missing_measurements_fail_with_one_sentence_naming_the_command(tmp_path, capsys):
    only = scale_result(tmp_path / "scale_100.json", 100, {"node loss": [1.0], "worker exit": [1.0]})
    with pytest.raises(sm.MissingMeasurements, match=r"benchmarks/scale\.py --nodes"):
        sm.load_scale([only])
    assert sm.main(["--from", str(tmp_path / "absent.json"), "--json", str(tmp_path / "m.json")]) == 1
    err = capsys.readouterr().err
    assert "benchmarks/scale.py --nodes 100" in err
    assert not (tmp_path / "m.json").exists()


def test_scale_py_model_starts_no_etcd_and_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    from hotspare.orchestrator import etcd_server

    def no_etcd(*_a, **_k):
        raise AssertionError("--model started etcd")

    monkeypatch.setattr(etcd_server, "start_etcd", no_etcd)
    import scale

    lat = {"node loss": [0.4, 0.5], "worker exit": [0.3, 0.7]}
    files = [scale_result(tmp_path / "scale_100.json", 100, lat),
             scale_result(tmp_path / "scale_1000.json", 1000, {k: [25 * x for x in v] for k, v in lat.items()})]
    png, out = tmp_path / "lat.png", tmp_path / "model.json"
    rc = scale.main(["--model", "--from", *map(str, files), "--restore-from", str(tmp_path / "none.json"),
                     "--plot", str(png), "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "1,024 GPUs (128 nodes)" in printed and "(interp.)" in printed and "(extrap.)" in printed
    data = json.loads(out.read_text())
    assert [e["n_gpus"] for e in data["estimates"]] == [512, 1024]
    assert all(v["source"] for v in data["assumptions"].values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_plot_writes_a_png(tmp_path):
    results = sm.run_model(measured())
    path = sm.plot(results, tmp_path / "sub" / "p.png")
    assert path.exists() and path.stat().st_size > 0
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert math.isfinite(results["estimates"][1]["scenarios"]["node loss"]["total"]["high"])
