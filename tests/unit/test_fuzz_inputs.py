"""Untrusted input never crashes us: the spec parser and the replica wire protocol, fuzzed.

Every rejection must be the one documented error type with a message, never an
arbitrary exception from deep inside.
"""

from __future__ import annotations

import socket
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotspare.orchestrator.spec import SpecError, parse_spec
from hotspare.recovery.wire import Channel, WireError, validate_snapshot

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["name", "entrypoint", "ranks", "steps", "spares", "ranks_per_node", "args", "etcd", "lease_ttl",
          "hang_timeout", "on_no_spare", "min_ranks", "replicas", "replicate_every", "output_dir",
          "backend", "env", "chaos", "straggler_threshold", "on_straggler"]
BASE = {"name": "fuzz", "entrypoint": "pkg.mod:train", "ranks": 2, "steps": 10}


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=6))
def test_any_spec_is_accepted_or_rejected_with_a_spec_error(fields):
    data = dict(BASE)
    data.update(fields)
    try:
        spec = parse_spec(data, base_dir="/tmp", source="fuzz.yaml")
    except SpecError as e:
        assert str(e).startswith("fuzz.yaml: ") and len(str(e)) > 12
        return
    assert spec.ranks >= 1 and spec.steps >= 1 and spec.min_ranks <= spec.ranks


@settings(max_examples=2000, deadline=None)
@given(json_values, st.binary(max_size=64))
def test_any_snapshot_header_is_validated_or_rejected_with_a_wire_error(header, body):
    try:
        validate_snapshot(header if isinstance(header, dict) else {"tensors": header}, body)
    except WireError as e:
        assert str(e)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_a_stranger_writing_bytes_never_gets_a_frame_accepted(garbage):
    a, b = socket.socketpair()
    a.settimeout(2)
    b.settimeout(2)
    result: dict = {}

    def serve():
        try:
            ch = Channel.server(a, b"s" * 32, timeout=2)
            result["frame"] = ch.recv()
        except (WireError, OSError) as e:
            result["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        b.recv(20)  # the hello
        b.sendall(garbage)
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    t.join(5)
    a.close()
    b.close()
    assert not t.is_alive()
    assert "frame" not in result, "unauthenticated bytes were accepted as a frame"
