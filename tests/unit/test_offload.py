"""OffloadedAdamW: bit-identical to torch.optim.AdamW (parameters, moments, steps compared with
torch.equal after every step), bounded buffers, and the two failures that must stay clear and
harmless: a full disk while writing and a corrupt or truncated state file."""

from __future__ import annotations

import copy
import errno
import json
import os

import pytest
import torch
from torch import nn

from hotspare.recovery import offload_io
from hotspare.recovery.offload import OffloadedAdamW, OffloadError, vertical_step
from hotspare.recovery.state import materialized

D_IN, D, D_OUT = 8, 32, 4


class Res(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


def make_model(blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D), *[Res(D) for _ in range(blocks)], nn.LayerNorm(D), nn.Linear(D, D_OUT))


def batches(n: int, micro: int = 1, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(6, D_IN, generator=g), torch.randn(6, D_OUT, generator=g)) for _ in range(micro)]
            for _ in range(n)]


def loss_fn(out: torch.Tensor, y: torch.Tensor, micro: int = 1) -> torch.Tensor:
    return ((out - y) ** 2).mean() / micro


def assert_same(ref_model: nn.Module, ref: torch.optim.Optimizer, model: nn.Module, opt: OffloadedAdamW,
                where: str = "") -> None:
    opt.finish()
    state = opt.read_state()
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), f"{where}: parameter {name} differs"
        rs = ref.state.get(p, {})
        assert set(rs) == set(state.get(q, {})), f"{where}: state keys of {name}"
        for k, v in rs.items():
            assert torch.equal(v, state[q][k]), f"{where}: {name}.{k} differs"


def train(model: nn.Module, opt: torch.optim.Optimizer, data, micro: int = 1, sched=None,
          compare=None) -> None:
    for i, mbs in enumerate(data):
        for x, y in mbs:
            loss_fn(model(x), y, micro).backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        if compare is not None:
            compare(i)


@pytest.fixture
def pair(tmp_path):
    made = []

    def make(**kw):
        ref_kw = {k: kw[k] for k in ("lr", "weight_decay", "betas", "eps", "amsgrad") if k in kw}
        base = make_model(kw.pop("blocks", 3))
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        groups = kw.pop("groups", None)
        if groups:
            ref = torch.optim.AdamW(groups(m1), **ref_kw)
            kw["param_groups"] = groups(m2)
        else:
            ref = torch.optim.AdamW(m1.parameters(), **ref_kw)
        if kw.pop("blocks_as_layers", False):
            kw["layers"] = list(m2)
        opt = OffloadedAdamW(m2, tmp_path / f"opt{len(made)}", **kw)
        made.append(opt)
        return m1, ref, m2, opt

    yield make
    for o in made:
        o.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_loop_bit_identical(pair, overlap):
    m1, ref, m2, opt = pair(lr=1e-2, weight_decay=0.1, overlap=overlap)
    data = batches(5)
    train(m1, ref, data)
    train(m2, opt, data, compare=None)
    assert_same(m1, ref, m2, opt)
    assert opt.completed_step == 5


def test_every_step_identical_with_overlap(pair):
    m1, ref, m2, opt = pair(lr=3e-2, overlap=True)
    for i, mbs in enumerate(batches(4)):
        for m, o in ((m1, ref), (m2, opt)):
            train(m, o, [mbs])
        assert_same(m1, ref, m2, opt, f"step {i}")


@pytest.mark.parametrize("mode", ["count", "context"])
def test_gradient_accumulation(pair, mode):
    micro = 3
    kw = {"accumulation_steps": micro} if mode == "count" else {}
    m1, ref, m2, opt = pair(lr=1e-2, overlap=True, **kw)
    data = batches(3, micro)
    train(m1, ref, data, micro)
    for mbs in data:
        for j, (x, y) in enumerate(mbs):
            if mode == "count":
                loss_fn(m2(x), y, micro).backward()
            else:
                with opt.accumulating() if j < micro - 1 else opt.final_micro_batch():
                    loss_fn(m2(x), y, micro).backward()
        opt.step()
        opt.zero_grad()
    assert_same(m1, ref, m2, opt)


@pytest.mark.parametrize("overlap", [False, True])
def test_vertical_schedule_matches_horizontal(pair, overlap):
    micro = 4
    m1, ref, m2, opt = pair(lr=1e-2, weight_decay=0.05, overlap=overlap, blocks_as_layers=True)
    data = batches(3, micro)
    train(m1, ref, data, micro)  # horizontal accumulation, torch AdamW
    for mbs in data:
        vertical_step(m2, mbs, lambda o, y: loss_fn(o, y, micro), opt)
        opt.zero_grad()
    assert_same(m1, ref, m2, opt)


def test_vertical_gradients_equal_horizontal():
    micro = 3
    m1, m2 = make_model(), make_model()
    [mbs] = batches(1, micro)
    for x, y in mbs:
        loss_fn(m1(x), y, micro).backward()
    vertical_step(m2, mbs, lambda o, y: loss_fn(o, y, micro))
    for (n, p), q in zip(m1.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_weight_decay_groups_and_lr_scheduler(pair):
    def groups(m):
        decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
        return [{"params": decay, "weight_decay": 0.2}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]

    m1, ref, m2, opt = pair(lr=2e-2, groups=groups, overlap=True)
    s1 = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1 + s))
    s2 = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = batches(5)
    train(m1, ref, data, sched=s1)
    train(m2, opt, data, sched=s2)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    assert_same(m1, ref, m2, opt)


def test_amsgrad_and_no_hooks(pair):
    m1, ref, m2, opt = pair(lr=1e-2, amsgrad=True, step_in_backward=False, overlap=False)
    data = batches(3)
    train(m1, ref, data)
    train(m2, opt, data)
    assert_same(m1, ref, m2, opt)


@pytest.mark.parametrize(("kw", "in_backward"), [({}, True), ({"step_in_backward": False}, False)])
def test_by_default_a_plain_models_layers_start_their_update_during_backward(pair, kw, in_backward):
    """step_in_backward left unset on a model without DDP means yes: each layer's update is
    queued by its gradient hook while backward runs, before step() is called (the results are
    identical either way, so only this shows that the update overlaps backward)."""
    _, _, m2, opt = pair(lr=1e-2, **kw)
    [(x, y)] = batches(1)[0]
    loss_fn(m2(x), y).backward()
    assert [L.queued_it == opt._it for L in opt.layers] == [in_backward] * len(opt.layers)
    opt.step()
    opt.finish()


@pytest.mark.parametrize("overlap", [False, True])
def test_small_budget_streams_layers(pair, overlap):
    m1, ref, m2, opt = pair(lr=1e-2, blocks=6, overlap=overlap)
    opt.close()  # the same model again, with a budget of exactly one layer's buffer
    opt = OffloadedAdamW(m2, opt.root.parent / "tiny", lr=1e-2, ram_budget_bytes=opt.slot_bytes,
                         overlap=overlap, chunk=4096)
    try:
        assert opt.nslots == 1 and len(opt.layers) == 15
        data = batches(4)
        train(m1, ref, data)
        train(m2, opt, data)
        assert_same(m1, ref, m2, opt)
        st = opt.stats()
        assert st["buffers_made"] == 1
        per_step = sum(L.data_len for L in opt.layers)
        assert st["bytes_read"] >= 3 * per_step  # every layer read back in steps 2-4
    finally:
        opt.close()


def test_layer_larger_than_budget_is_refused(tmp_path):
    with pytest.raises(ValueError, match="more than ram_budget_bytes"):
        OffloadedAdamW(make_model(), tmp_path, ram_budget_bytes=4096)


def test_one_directory_one_optimizer(pair, tmp_path):
    _, _, m2, opt = pair()
    with pytest.raises(OffloadError, match="in use"):
        OffloadedAdamW(m2, opt.root)


def snapshots(model, ref, data) -> list[dict]:
    """torch AdamW's state after each step (deep copies)."""
    out = []
    for mbs in data:
        train(model, ref, [mbs])
        out.append({id(p): {k: v.clone() for k, v in ref.state[p].items()} for p in model.parameters()})
    return out


def assert_state(opt: OffloadedAdamW, model: nn.Module, ref_model: nn.Module, expect: dict) -> None:
    state = opt.read_state()
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        for k, v in expect[id(p)].items():
            assert torch.equal(v, state[q][k]), k


def test_disk_full_is_one_clear_error_and_previous_state_survives(pair, monkeypatch):
    m1, ref, m2, opt = pair(lr=1e-2, overlap=False)
    data = batches(4)
    want = snapshots(m1, ref, data)
    writes_per_step = 2 * len(opt.layers)  # one data chunk and one header per layer
    real, calls = os.pwritev, [0]

    def full(fd, bufs, offset, *a):
        calls[0] += 1
        if calls[0] == 2 * writes_per_step + 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset, *a)

    monkeypatch.setattr(offload_io.os, "pwritev", full)
    train(m2, opt, data[:2])
    with pytest.raises(OffloadError) as e:
        train(m2, opt, data[2:3])
    msg = str(e.value)
    assert "ENOSPC" in msg and str(opt.root) in msg and "layer" in msg and "load_from" in msg, msg
    assert opt.completed_step == 2
    with pytest.raises(OffloadError):  # it refuses to go on: the same error again
        opt.step()
    monkeypatch.setattr(offload_io.os, "pwritev", real)
    root = opt.root
    opt.close()
    fresh = OffloadedAdamW(m2, root, lr=1e-2)
    try:
        fresh.load_from(root)
        assert fresh.completed_step == 2
        assert_state(fresh, m2, m1, want[1])
    finally:
        fresh.close()


def test_corrupt_file_is_detected_while_training(pair):
    m1, ref, m2, opt = pair(lr=1e-2, overlap=False)
    data = batches(3)
    train(m2, opt, data[:2])
    first = opt.state_files()["layers"][0]  # the first layer: read last in backward order
    with open(first["path"], "r+b") as f:
        f.seek(first["bytes"] - 100)
        b = f.read(1)
        f.seek(first["bytes"] - 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(OffloadError) as e:
        train(m2, opt, data[2:])
    assert first["path"] in str(e.value) and "corrupt" in str(e.value), str(e.value)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_refused_on_restore(pair, tmp_path, damage):
    m1, ref, m2, opt = pair(lr=1e-2, overlap=False)
    train(m2, opt, batches(2))
    files = opt.state_files()
    victim = files["layers"][2]["path"]
    opt.close()
    with open(victim, "r+b") as f:
        if damage == "flip":
            f.seek(files["layers"][2]["bytes"] - 8)
            f.write(b"\xde\xad\xbe\xef")
        else:
            f.truncate(files["layers"][2]["bytes"] - 4096)
    fresh = OffloadedAdamW(m2, tmp_path / "other", lr=1e-2)
    try:
        with pytest.raises(OffloadError) as e:
            fresh.load_from(files)
        assert victim in str(e.value), str(e.value)
        assert ("corrupt" if damage == "flip" else "truncated") in str(e.value)
        assert fresh.completed_step == 0  # unchanged
    finally:
        fresh.close()


def test_state_files_and_manifest_restore_elsewhere(pair, tmp_path):
    m1, ref, m2, opt = pair(lr=1e-2, overlap=True)
    data = batches(4)
    train(m1, ref, data[:3])
    train(m2, opt, data[:3])
    opt.finish()
    files = opt.state_files()
    assert files["step"] == 3
    assert json.loads((opt.root / "manifest.json").read_text()) == files
    assert {e["version"] for e in files["layers"]} == {"a"}  # steps 1 and 3 in a, 2 in b
    m3 = copy.deepcopy(m2)
    other = OffloadedAdamW(m3, tmp_path / "copy", lr=1e-2, overlap=True)
    try:
        other.load_from(files)  # copied and checked
        train(m1, ref, data[3:])
        train(m3, other, data[3:])
        assert_same(m1, ref, m3, other)
    finally:
        other.close()


def test_torch_state_dict_and_provider_round_trip(pair, tmp_path):
    m1, ref, m2, opt = pair(lr=1e-2, weight_decay=0.1)
    data = batches(4)
    train(m1, ref, data[:2])
    m2.load_state_dict(m1.state_dict())
    opt.load_state_dict(ref.state_dict())  # torch format in
    assert opt.completed_step == 2
    train(m1, ref, data[2:3])
    train(m2, opt, data[2:3])
    assert_same(m1, ref, m2, opt)
    sd = opt.state_dict()  # torch format out
    ref2 = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    ref2.load_state_dict(sd)
    tensors = materialized(opt)  # the provider protocol: placeholders, meta(), fill()
    meta = json.loads(json.dumps(opt.meta()))
    m3 = copy.deepcopy(m2)
    other = OffloadedAdamW(m3, tmp_path / "prov", lr=0.5)
    try:
        other.load(tensors, meta)
        assert other.param_groups[0]["lr"] == 1e-2
        train(m1, ref2, data[3:])
        train(m3, other, data[3:])
        assert_same(m1, ref2, m3, other)
    finally:
        other.close()


def test_files_checked_with_zlib_crc32_restore_and_corruption_is_still_caught(pair, tmp_path):
    """Files written before the checksum became CRC-32C (zlib's CRC-32: the header's "sum" says
    so, or says nothing) restore, checked with their own sum, into an optimizer using CRC-32C;
    a flipped byte in one of them is still caught."""
    m1, ref, m2, opt = pair(lr=1e-2)
    opt.io.sum = "crc32"  # as an older version wrote them
    data = batches(4)
    train(m1, ref, data[:2])
    train(m2, opt, data[:2])
    opt.finish()
    files = opt.state_files()
    for m3_dir, damage in (("new", False), ("bad", True)):
        m3 = copy.deepcopy(m2)
        other = OffloadedAdamW(m3, tmp_path / m3_dir, lr=1e-2)
        try:
            assert other.io.sum == offload_io.CHECKSUM
            if damage:
                path = files["layers"][0]["path"]
                with open(path, "r+b") as f:
                    f.seek(os.path.getsize(path) - 100)
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 0xFF]))
                with pytest.raises(OffloadError, match="corrupt"):
                    other.load_from(files)
                continue
            other.load_from(files)
            train(m1, ref, data[2:])
            train(m3, other, data[2:])
            assert_same(m1, ref, m3, other)
        finally:
            other.close()
