"""State providers and the snapshot engine, without any server.

Covers the nested-state codec (``split_state``/``join_state``), the RNG/module/optimizer
providers, the slot ring and replication points of :class:`SnapshotEngine`, and the
torch-free slot reader the agents use (``read_slot``)."""

from __future__ import annotations

import json
import logging
import random
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from hotspare.agents.replica import ReplicaStore
from hotspare.recovery.slotfile import (
    COMPLETE,
    CTRL_SIZE,
    WRITING,
    read_confirmation,
    read_slot,
    slot_steps,
)
from hotspare.recovery.snapshot import Slot, SnapshotEngine
from hotspare.recovery.state import (
    ModuleState,
    OptimizerState,
    RNGState,
    ValueState,
    join_state,
    provider_for,
    split_state,
)

pytestmark = pytest.mark.timeout(60)


def _equal(a, b) -> bool:
    """Structural equality that understands tensors and numpy arrays."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


# -- split_state / join_state -----------------------------------------------------------------
def _nested() -> dict:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "by_index": {0: torch.ones(2), 1: {"inner": torch.zeros(3, dtype=torch.int64)}, 7: "seven"},
        "groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "fused": None, "amsgrad": False}],
        "pair": (torch.tensor(3.0), [True, None, "x"]),
        "arr": np.arange(5, dtype=np.int32),
        "matrix": np.ones((2, 2), dtype=np.float64),
        "count": 12,
        "flag": True,
        "nothing": None,
        "empty": {},
        "empty_list": [],
    }


def test_split_join_round_trip_through_json():
    state = _nested()
    tensors, skel = split_state(state)
    # the skeleton is what lands in the snapshot header: it must survive JSON unchanged
    skel = json.loads(json.dumps(skel))
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    back = join_state(tensors, skel)
    assert _equal(back, state), back
    assert isinstance(back["by_index"], dict) and set(back["by_index"]) == {0, 1, 7}
    assert isinstance(back["pair"], tuple) and isinstance(back["groups"][0]["betas"], tuple)
    assert back["flag"] is True and back["nothing"] is None and back["pair"][1][0] is True


def test_join_clones_unless_told_not_to():
    t = torch.ones(3)
    tensors, skel = split_state({"t": t, "a": np.zeros(2)})
    cloned = join_state(tensors, skel)
    cloned["t"].add_(1)
    cloned["a"] += 1
    assert torch.equal(t, torch.ones(3)) and np.array_equal(tensors[".a"].numpy(), np.zeros(2))
    shared = join_state(tensors, skel, clone=False)
    assert shared["t"].data_ptr() == tensors[".t"].data_ptr()


def test_numpy_scalars_become_python_numbers():
    _, skel = split_state({"a": np.float32(1.5), "b": np.int64(4)})
    back = join_state({}, json.loads(json.dumps(skel)))
    assert back == {"a": 1.5, "b": 4}


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"a": [1, {"b": object()}]}, ".a.1.b"),
        ({"opt": {"state": {0: {"s": {1, 2}}}}}, ".opt.state.#0.s"),
        ([torch.ones(1), (2, bytearray(b"x"))], ".1.1"),
        (object(), "<root>"),
    ],
)
def test_unsupported_type_raises_type_error_naming_the_path(state, where):
    with pytest.raises(TypeError) as e:
        split_state(state)
    assert f"state at {where} has a" in str(e.value)


def test_unsupported_key_raises_type_error_naming_the_key():
    with pytest.raises(TypeError, match=r"\(1, 2\)"):
        split_state({(1, 2): torch.ones(1), "x": 1})


def test_split_state_keeps_tensors_whose_dotted_paths_collide():
    state = {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}
    tensors, skel = split_state(state)
    assert _equal(join_state(tensors, json.loads(json.dumps(skel))), state)


# -- RNG ----------------------------------------------------------------------------------
def _draw() -> tuple:
    return (torch.rand(4).tolist(), torch.randn(2).tolist(), np.random.rand(3).tolist(),
            np.random.randint(0, 1 << 30, 3).tolist(), random.random(), random.getrandbits(64),
            random.gauss(0, 1))


def test_rng_state_restores_torch_numpy_and_python_streams():
    random.gauss(0, 1)  # leaves a cached gauss value in Python's state
    np.random.standard_normal()  # and possibly one in numpy's
    p = RNGState()
    tensors = {k: t.clone() for k, t in p.tensors().items()}
    meta = json.loads(json.dumps(p.meta()))  # as it travels in a snapshot header
    first = _draw()
    _draw()  # move further along
    p.load(tensors, meta)
    assert _draw() == first


# -- modules and optimizers ------------------------------------------------------------------
def test_module_state_loads_in_place_and_keeps_optimizer_references():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params, bufs = ModuleState(model, True), ModuleState(model, False)
    assert params.async_ok and not bufs.async_ok
    saved_p = {k: t.clone() for k, t in params.tensors().items()}
    saved_b = {k: t.clone() for k, t in bufs.tensors().items()}
    assert "1.running_mean" in saved_b and "0.weight" in saved_p
    ids = [id(p) for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]

    model.train()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()  # changes parameters and the batch-norm running stats
    assert not torch.equal(model[0].weight, saved_p["0.weight"])

    params.load(saved_p, None)
    bufs.load(saved_b, None)
    assert [id(p) for p in model.parameters()] == ids
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(), strict=True))
    for k, t in model.named_parameters():
        assert torch.equal(t, saved_p[k])
    for k, t in model.named_buffers():
        assert torch.equal(t, saved_b[k])
    # the loaded values were copied: changing the source does not reach the model
    saved_p["0.weight"].add_(1)
    assert not torch.equal(model[0].weight, saved_p["0.weight"])


def test_module_state_refuses_a_snapshot_missing_parameters():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(KeyError, match="bias"):
        ModuleState(model, True).load({"weight": torch.zeros(2, 2)}, None)


def _adamw_after_steps(n: int):
    torch.manual_seed(1)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 5)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _opt_state(opt) -> dict:
    return {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}


def test_optimizer_state_restores_through_a_slot_without_aliasing_it(tmp_path):
    model, opt = _adamw_after_steps(3)
    eng = SnapshotEngine(tmp_path, sid=0)
    try:
        eng.providers = provider_for("model", model) + provider_for("opt", opt)
        assert isinstance(eng.providers[-1][1], OptimizerState) and eng.providers[-1][1].async_ok
        eng.capture(3)
        eng.wait()
        expected = _opt_state(opt)
        expected_groups = opt.state_dict()["param_groups"]

        fresh = torch.optim.AdamW(model.parameters(), lr=0.5)  # different lr: must be restored
        eng.providers = provider_for("model", model) + provider_for("opt", fresh)
        eng.load_local(3)
        got = _opt_state(fresh)
        assert _equal(got, expected)
        assert fresh.state_dict()["param_groups"] == expected_groups
        assert list(fresh.state) == list(model.parameters())  # keyed by the live parameters

        # overwrite the slot's data bytes behind the optimizer's back
        path = tmp_path / "rank0.slot0"
        assert slot_steps(path) == (COMPLETE, 3)
        raw = bytearray(path.read_bytes())
        doff = int.from_bytes(raw[40:48], "little", signed=True)
        with open(path, "r+b") as f:
            f.seek(doff)
            f.write(b"\x7f" * (len(raw) - doff))
        assert _equal(_opt_state(fresh), expected), "optimizer state aliases snapshot memory"

        fresh.step()  # the restored state is usable
    finally:
        eng.close()


def test_value_state_with_an_array_round_trips_or_is_rejected_at_capture():
    values = {"seen": 3, "hist": np.arange(3)}
    p = ValueState(values)
    try:
        tensors, meta = p.tensors(), json.loads(json.dumps(p.meta()))
    except TypeError:
        return  # rejected up front: acceptable
    values.clear()
    p.load(tensors, meta)
    assert values["seen"] == 3 and np.array_equal(values["hist"], np.arange(3))


def test_value_state_restores_in_place():
    values = {"epoch": 2, "names": ["a", "b"], "best": None}
    same = values
    p = ValueState(values)
    meta = json.loads(json.dumps(p.meta()))
    values["epoch"] = 9
    values["new"] = 1
    p.load({}, meta)
    assert same is values and values == {"epoch": 2, "names": ["a", "b"], "best": None}


# -- SnapshotEngine -----------------------------------------------------------------------------
class _Scalar:
    """A custom provider: one parameter-like tensor (async) plus JSON meta."""

    def __init__(self) -> None:
        self.t = torch.zeros(16)
        self.async_ok = True
        self.note = {"step": None}

    def tensors(self):
        return {"t": self.t}

    def meta(self):
        return dict(self.note)

    def load(self, tensors, meta):
        self.t.copy_(tensors["t"])
        self.note = dict(meta)


def _engine(tmp_path, **kw):
    eng = SnapshotEngine(tmp_path, sid=0, **kw)
    prov = _Scalar()
    extra = {"step": None}
    eng.providers = [("s", prov)] + provider_for("extra", extra)
    return eng, prov, extra


def _set(prov, extra, step):
    prov.t.fill_(float(step))
    prov.note = {"step": step}
    extra["step"] = step


def test_ring_keeps_newest_two_and_restores_an_older_step(tmp_path):
    eng, prov, extra = _engine(tmp_path, slots=2)
    try:
        for step in range(6):
            _set(prov, extra, step)
            eng.capture(step)
            eng.wait()  # the engine's optimizer hook does this before state changes again
            assert eng.available()[-1] == step
        assert eng.available() == [4, 5]
        assert sorted(slot_steps(tmp_path / f"rank0.slot{k}")[1] for k in range(2)) == [4, 5]
        assert not list(tmp_path.glob("rank0.point*"))

        _set(prov, extra, 99)
        eng.load_local(4)
        assert torch.equal(prov.t, torch.full((16,), 4.0))
        assert prov.note == {"step": 4} and extra == {"step": 4}

        eng.invalidate_after(4)
        assert eng.available() == [4]
        assert sorted(slot_steps(tmp_path / f"rank0.slot{k}")[1] for k in range(2)) == [-2, 4]
        with pytest.raises(ValueError):
            eng.load_local(5)

        # training goes on from 4: the new step 5 never displaces the kept step 4
        _set(prov, extra, 5)
        eng.capture(5)
        eng.wait()
        assert eng.available() == [4, 5]
        eng.load_local(4)
        assert extra == {"step": 4}
    finally:
        eng.close()


def test_files_are_named_by_sid_and_rank_is_a_deprecated_keyword_for_it(tmp_path):
    eng = SnapshotEngine(tmp_path, sid=3, replicate_every=2)
    try:
        assert eng.sid == eng.rank == 3
        eng.providers = [("s", _Scalar())]
        eng.capture(-1)
        eng.capture(1)
        eng.wait()
        assert {p.name for p in tmp_path.glob("rank3.*")} == {"rank3.point0", "rank3.slot0"}
        assert read_slot(tmp_path / "rank3.point0")[0]["rank"] == 3  # the header keeps its field
    finally:
        eng.close()
    with pytest.raises(TypeError, match="sid"):
        SnapshotEngine(tmp_path)


def test_capture_returns_before_the_lazy_copy_and_wait_completes_it(tmp_path):
    release = threading.Event()

    class Held(_Scalar):
        def meta(self):  # an async provider's meta runs on the engine's thread: hold it there
            release.wait(10)
            return super().meta()

    eng = SnapshotEngine(tmp_path, sid=0)
    prov = Held()
    eng.providers = [("s", prov)]
    try:
        prov.t.fill_(1.0)
        eng.capture(0)  # returns although the big part has not even started
        assert not release.is_set()
        assert read_slot(tmp_path / "rank0.slot0") is None
        release.set()
        eng.wait()
        assert slot_steps(tmp_path / "rank0.slot0") == (COMPLETE, 0)
        assert eng.available() == [0]
    finally:
        release.set()
        eng.close()


def test_a_lazy_copy_copies_the_tensors_of_the_captured_step_not_what_the_module_holds_later(tmp_path):
    """FSDP2 swaps a module's registered parameters for unsharded ones during the next forward
    (and frees their storage after it): the engine must copy the parameters as they were at
    capture, never walk the module from its own thread while the next step runs."""
    model = torch.nn.Linear(4, 3)
    release = threading.Event()

    class Late(_Scalar):
        def meta(self):  # holds the engine's write until the module has been "swapped"
            release.wait(10)
            return super().meta()

    eng = SnapshotEngine(tmp_path, sid=0)
    eng.providers = [("hold", Late()), *provider_for("model", model)]
    try:
        with torch.no_grad():
            model.weight.fill_(1.0)
        eng.capture(0)
        # the next step's forward, FSDP2-style: another, bigger parameter registered in its place
        model.weight = torch.nn.Parameter(torch.full((8, 8), 7.0))
        release.set()
        eng.wait()
        header, data, _ = read_slot(tmp_path / "rank0.slot0")
        [w] = [t for t in header["tensors"] if t["name"] == "model.params/weight"]
        assert w["shape"] == [3, 4]
        values = torch.frombuffer(bytearray(data[w["offset"]: w["offset"] + w["nbytes"]]), dtype=torch.float32)
        assert torch.equal(values, torch.ones(12))
    finally:
        release.set()
        eng.close()


def _where(tmp_path, step):
    return {p.name for p in tmp_path.glob("rank0.*") if (slot_steps(p) or (0, -9))[1] == step}


def test_points_go_to_point_files_and_are_served_as_points(tmp_path):
    eng, prov, extra = _engine(tmp_path, slots=2, replicate_every=2, replication_timeout=30)
    store = ReplicaStore(tmp_path)
    try:
        last_point = None
        for step in [-1, 0, 1, 2, 3, 4]:
            if eng.is_candidate(step) and last_point is not None:
                store.confirm(0, last_point)  # the agent replicated the previous point
            _set(prov, extra, step)
            eng.capture(step)
            eng.wait()
            files = _where(tmp_path, step)
            assert len(files) == 1, files
            (name,) = files
            if step in (-1, 0, 2, 4):
                assert name.startswith("rank0.point"), (step, name)
                last_point = step
            else:
                assert name.startswith("rank0.slot"), (step, name)
        assert eng.available() == [1, 2, 3, 4]
        assert store.steps(0) == {1: "slot", 3: "slot", 2: "point", 4: "point"}
        eng.load_local(2)
        assert extra == {"step": 2}
    finally:
        eng.close()


def test_slots_are_prepared_in_the_background_and_used_on_first_write(tmp_path):
    """The first write creates its slot; every other slot is then created (its pages faulted
    in) by a background thread and put in place when it is first written; a prepared slot
    that is never used leaves no file behind."""
    eng, prov, extra = _engine(tmp_path, slots=2, replicate_every=5, replication_timeout=30)
    store = ReplicaStore(tmp_path)
    try:
        _set(prov, extra, -1)
        eng.capture(-1)  # point0
        eng.wait()
        eng._preparer.thread.join()
        ready = dict(eng._preparer.ready)
        assert sorted(ready) == [0, 1, 3]  # slot0, slot1, point1 (point0 is in use)
        assert sorted(p.name.split(".")[1:3] for p in tmp_path.glob(".rank0.*.ready")) == sorted(
            eng.path(k).name.split(".") for k in ready)
        assert not (tmp_path / "rank0.slot0").exists()  # not in place before its first write
        for step in (1, 2):
            _set(prov, extra, step)
            eng.capture(step)
            eng.wait()
        assert eng._slots[0] is ready[0] and eng._slots[1] is ready[1]
        assert read_slot(tmp_path / "rank0.slot0")[0]["step"] == 1
        assert store.steps(0) == {-1: "point", 1: "slot", 2: "slot"}
        assert len(list(tmp_path.glob(".rank0.*"))) == 1  # point1's, still unused
    finally:
        eng.close()
    assert not list(tmp_path.glob(".rank0.*")), "an unused prepared slot must not outlive the engine"


def test_a_slot_taken_while_others_are_being_prepared_is_prepared_once(tmp_path, monkeypatch):
    """The engine takes prepared slots while the preparer is still working on the others
    (both slowed down here to widen the window): every slot is prepared at most once, and
    every write lands (a second preparation of a slot being put in place once broke it)."""
    made: list[str] = []
    init, install = Slot.__init__, Slot.install

    def slow_init(self, path, *a, staged=False, **kw):
        if staged:
            made.append(path.name)
            time.sleep(0.05)
        init(self, path, *a, staged=staged, **kw)

    def slow_install(self):
        time.sleep(0.1)
        install(self)

    monkeypatch.setattr(Slot, "__init__", slow_init)
    monkeypatch.setattr(Slot, "install", slow_install)
    eng, prov, extra = _engine(tmp_path, slots=3, replicate_every=3, replication_timeout=30)
    store = ReplicaStore(tmp_path)
    try:
        for step in (-1, 1, 2, 3, 4, 5, 6, 7):
            if eng.is_candidate(step):
                store.confirm(0, eng.confirmed()[0] if eng._last_point is None else eng._last_point[0])
            _set(prov, extra, step)
            eng.capture(step)
            eng.wait()
            assert read_slot(next(p for p in tmp_path.glob("rank0.*")
                                  if (slot_steps(p) or (0, -9))[1] == step))[0]["step"] == step
    finally:
        eng.close()
    assert len(made) == len(set(made)), f"a slot was prepared twice: {made}"
    assert not list(tmp_path.glob(".rank0.*"))


def test_new_point_waits_for_the_previous_one_to_be_replicated(tmp_path):
    eng, prov, extra = _engine(tmp_path, replicate_every=2, replication_timeout=30)
    store = ReplicaStore(tmp_path)
    beats = []
    eng._beat = lambda: beats.append(1)
    try:
        (tmp_path / "rank0.replicated").write_text("7 1")  # stale marker of an earlier worker
        eng2, _, _ = _engine(tmp_path, replicate_every=2)  # a new worker of sid 0 removes it
        eng2.close()
        assert not (tmp_path / "rank0.replicated").exists()

        eng.capture(-1)  # first point: nothing to wait for
        eng.wait()
        eng.capture(1)  # ring steps never wait
        eng.wait()

        returned = threading.Event()
        observed = {}

        def agent():
            time.sleep(0.7)
            observed["returned_before_marker"] = returned.is_set()
            store.confirm(0, -1)

        t = threading.Thread(target=agent, daemon=True)
        t.start()
        eng.capture(2)  # returns at once: the replication wait runs on the engine's thread
        eng.wait()  # ... and is felt only here, before the next optimizer step
        returned.set()
        t.join(10)
        assert observed == {"returned_before_marker": False}
        assert read_confirmation(tmp_path / "rank0.replicated")[0] == -1
        assert beats, "the engine should keep beating while it waits"
        assert "rank0.point1" in _where(tmp_path, 2)
    finally:
        eng.close()


def test_point_gives_up_waiting_after_the_replication_timeout(tmp_path, caplog):
    eng, prov, extra = _engine(tmp_path, replicate_every=2, replication_timeout=0.05)
    try:
        eng.capture(-1)
        eng.wait()
        with caplog.at_level(logging.WARNING, logger="hotspare.recovery.snapshot"):
            eng.capture(0)  # nobody ever confirms -1
        eng.wait()
        assert any("not replicated" in r.getMessage() for r in caplog.records)
        assert read_confirmation(tmp_path / "rank0.replicated")[0] == -2
        assert eng.available() == [-1, 0]
        assert any(n.startswith("rank0.point") for n in _where(tmp_path, 0))
    finally:
        eng.close()


def test_a_point_waiting_when_a_new_epoch_begins_is_dropped_and_overwrites_nothing(tmp_path, caplog):
    """Point 2 waits for point 0's replication, which never comes (its buddy is gone); a new
    epoch begins. The point is dropped at once -- not written over point -1, the replicated
    one the new epoch's restore may need -- instead of waiting out the replication timeout."""
    eng, prov, extra = _engine(tmp_path, replicate_every=2, replication_timeout=600)
    store = ReplicaStore(tmp_path)
    new_epoch = threading.Event()
    eng.superseded = new_epoch.is_set
    try:
        for step in (-1, 0, 1):
            if step == 0:
                store.confirm(0, -1)
            _set(prov, extra, step)
            eng.capture(step)
            eng.wait()
        _set(prov, extra, 2)
        with caplog.at_level(logging.WARNING, logger="hotspare.recovery.snapshot"):
            eng.capture(2)  # waits for point 0, never confirmed
            assert not eng._idle.wait(0.3), "point 2 must wait for point 0's replication"
            new_epoch.set()
            eng.wait()
        assert any("dropped" in r.getMessage() for r in caplog.records)
        assert eng.available() == [-1, 0, 1]
        assert sorted(store.steps(0).items()) == [(-1, "point"), (0, "point"), (1, "slot")]
    finally:
        eng.close()


# -- read_slot ------------------------------------------------------------------------------------
def _complete_slot(tmp_path):
    eng, prov, extra = _engine(tmp_path / "eng")
    _set(prov, extra, 3)
    eng.capture(3)
    eng.wait()
    eng.close()
    return tmp_path / "eng" / "rank0.slot0"


def test_read_slot_returns_a_complete_slot(tmp_path):
    path = _complete_slot(tmp_path)
    header, data, seq = read_slot(path)
    assert header["step"] == 3 and seq >= 1
    (info,) = [t for t in header["tensors"] if t["name"] == "s/t"]
    got = torch.frombuffer(bytearray(data[info["offset"] : info["offset"] + info["nbytes"]]),
                           dtype=torch.float32)
    assert torch.equal(got, torch.full((16,), 3.0))


def test_read_slot_ignores_a_slot_being_written(tmp_path):
    slot = Slot(tmp_path / "rank0.slot0", 4096, 64)
    try:
        hb = json.dumps({"step": 4, "tensors": []}).encode()
        slot.mm[CTRL_SIZE : CTRL_SIZE + len(hb)] = hb
        slot.set_ctrl(WRITING, 4, 1, len(hb))
        assert read_slot(slot.path) is None
        slot.set_ctrl(COMPLETE, 4, 1, len(hb))
        assert read_slot(slot.path)[0]["step"] == 4
    finally:
        slot.close()


def test_read_slot_rejects_wrong_magic_and_missing_files(tmp_path):
    path = _complete_slot(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[0:8] = b"NOTSNAP!"
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    assert read_slot(bad) is None
    assert slot_steps(bad) is None
    assert read_slot(tmp_path / "missing") is None


def test_read_slot_never_raises_on_a_truncated_file(tmp_path):
    path = _complete_slot(tmp_path)
    size = path.stat().st_size
    doff = int.from_bytes(path.read_bytes()[40:48], "little", signed=True)
    for n in sorted({0, 1, 8, 63, 64, 65, 200, doff - 1, doff, doff + 1, size // 2, size - 1}):
        cut = tmp_path / f"cut{n}"
        shutil.copyfile(path, cut)
        with open(cut, "r+b") as f:
            f.truncate(n)
        assert read_slot(cut) is None, n


def test_restoring_a_snapshot_of_another_model_is_refused_not_broadcast():
    """Security review F13: ``copy_`` broadcasts and casts, so a [1] tensor "restored" into a
    Linear(4, 3) weight filled it with one value. A shape or dtype mismatch is an error now,
    and the live parameters are untouched."""
    from hotspare.recovery.state import ModuleState

    model = torch.nn.Linear(4, 3)
    before = model.weight.detach().clone()
    p = ModuleState(model, params=True)
    with pytest.raises(ValueError, match=r"snapshot is of another model: .*weight: \(1,\)"):
        p.load({"weight": torch.full((1,), 7.0), "bias": torch.zeros(3)}, None)
    with pytest.raises(ValueError, match="float64"):
        p.load({"weight": torch.zeros(3, 4, dtype=torch.float64), "bias": torch.zeros(3)}, None)
    assert torch.equal(model.weight.detach(), before)
