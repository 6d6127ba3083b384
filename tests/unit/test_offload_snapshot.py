"""OffloadedAdamW inside hotspare's snapshots: the engine reads the layer files into the slot on
its own thread (placeholders, ``meta()``, ``fill()``), the next iteration's updates wait for that
read, and a new optimizer restored from the slot trains on bit-identical to torch.optim.AdamW.
The end-to-end kill-rank and kill-node runs are in tests/e2e/test_frameworks.py."""

from __future__ import annotations

import copy

import pytest
import torch

from hotspare.recovery.offload import OffloadedAdamW
from hotspare.recovery.snapshot import SnapshotEngine, restore, tensors_from_bytes
from hotspare.recovery.state import ModuleState

from .test_offload import assert_same, batches, make_model, train


def providers(model, opt):
    return [("model.params", ModuleState(model, True)), ("optimizer", opt)]


@pytest.mark.parametrize("in_backward", [True, False])
def test_a_snapshot_taken_while_the_next_step_runs_restores_bit_identical(tmp_path, in_backward):
    """The engine holds each copy open 0.2 s (test_delay), so the next step's backward (and
    with it the layer updates of step_in_backward) starts while the snapshot still reads the
    files and parameters: the updates must wait for it, or the snapshot would be torn."""
    base = make_model()
    m_ref, m = copy.deepcopy(base), copy.deepcopy(base)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=2e-2, weight_decay=0.1)
    opt = OffloadedAdamW(m, tmp_path / "opt", lr=2e-2, weight_decay=0.1, overlap=True,
                         step_in_backward=in_backward)
    eng = SnapshotEngine(tmp_path / "snap", sid=0, slots=3, test_delay=0.2)
    eng.providers = providers(m, opt)
    opt.on_update_start.append(eng.wait)  # what session.track() hooks
    data = batches(6)
    snaps = {}
    try:
        for i, mbs in enumerate(data):
            train(m, opt, [mbs])
            eng.capture(i)
            train(m_ref, ref, [mbs])
            if i == 3:  # what the snapshot must hold, exactly
                snaps[i] = ({k: v.clone() for k, v in m_ref.state_dict().items()},
                            {p: {k: t.clone() for k, t in st.items()} for p, st in ref.state.items()})
        eng.wait()
        assert_same(m_ref, ref, m, opt)
        header, body = eng.read(3)
        assert header["meta"]["optimizer"]["step"] == 4
        got = tensors_from_bytes(header, body)
        names = dict(zip(ref.state, (n for n, _ in m_ref.named_parameters()), strict=True))
        for p, st in snaps[3][1].items():
            for k, t in st.items():
                assert torch.equal(got[f"optimizer/{names[p]}:{k}"], t), (names[p], k)

        # a new model and optimizer (another path: a spare's) restored from step 3's snapshot
        # train on to the same result as AdamW that never stopped
        m2 = make_model()
        opt2 = OffloadedAdamW(m2, tmp_path / "spare", lr=0.5, overlap=True, step_in_backward=in_backward)
        try:
            restore(providers(m2, opt2), got, header["meta"])
            assert opt2.completed_step == 4 and opt2.param_groups[0]["lr"] == 2e-2
            for k, v in snaps[3][0].items():
                assert torch.equal(m2.state_dict()[k], v), k
            train(m2, opt2, data[4:])
            assert_same(m_ref, ref, m2, opt2)
        finally:
            opt2.close()
    finally:
        eng.close()
        opt.close()


def test_never_stepped_parameters_snapshot_as_zeros_and_restore_as_no_state(tmp_path):
    """The snapshot layout is fixed from the first capture (step -1, before any update): a
    parameter without state is a zero step and zero moments, and restores to no state."""
    m = make_model()
    opt = OffloadedAdamW(m, tmp_path / "opt", lr=1e-2)
    eng = SnapshotEngine(tmp_path / "snap", sid=0)
    eng.providers = providers(m, opt)
    opt.on_update_start.append(eng.wait)
    try:
        eng.capture(-1)
        train(m, opt, batches(1))
        eng.capture(0)
        eng.wait()
        h0, b0 = eng.read(-1)
        h1, b1 = eng.read(0)
        assert [t["name"] for t in h0["tensors"]] == [t["name"] for t in h1["tensors"]]
        before = tensors_from_bytes(h0, b0)
        assert all(not t.any() for k, t in before.items() if k.startswith("optimizer/"))
        assert any(t.any() for k, t in tensors_from_bytes(h1, b1).items() if k.endswith(":exp_avg"))
        restore(providers(m, opt), before, h0["meta"])
        assert opt.completed_step == 0 and opt.read_state() == {}
    finally:
        eng.close()
        opt.close()


def test_ddp_models_update_from_step_not_from_each_ranks_own_gradients(tmp_path):
    """Under DDP the gradient hooks fire before the gradients are averaged: the default there
    is step_in_backward=False, and asking for True is refused with the reason."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.HashStore()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DDP(make_model())
        opt = OffloadedAdamW(model, tmp_path / "a")
        assert opt.in_backward is False
        opt.close()
        with pytest.raises(ValueError, match="DDP averages them at the end of backward"):
            OffloadedAdamW(model, tmp_path / "b", step_in_backward=True)
    finally:
        dist.destroy_process_group()
