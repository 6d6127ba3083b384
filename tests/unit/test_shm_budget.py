"""State larger than the snapshot directory's room (issue 14 item 4), without a real full filesystem.

The decision (:mod:`hotspare.recovery.shm_budget`) is arithmetic over a faked ``statvfs``; the
snapshot engine is driven for real, with ``posix_fallocate`` made to fail as a full tmpfs makes
it fail, and with a session-like ``admit`` that applies a configured budget. The job-level test
(a real job refused at its start) is ``tests/e2e/test_shm_budget.py``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hotspare.orchestrator.spec import JobSpec, SpecError, parse_spec
from hotspare.recovery import shm_budget
from hotspare.recovery.errors import ShmTooSmall, Unrecoverable
from hotspare.recovery.shm_budget import ShmNeed, check_room, fmt_bytes, need_for, verdict
from hotspare.recovery.slotfile import REPLICAS_KEPT, SlotDir
from hotspare.recovery.snapshot import SnapshotEngine
from hotspare.recovery.state import provider_for

pytestmark = pytest.mark.timeout(60)

GiB = 1 << 30


def _spec(**fields) -> JobSpec:
    return JobSpec(name="t", entrypoint="train:main", ranks=fields.pop("ranks", 4), steps=10, **fields)


# -- what a node needs --------------------------------------------------------------------------
def test_a_node_keeps_its_ranks_slots_and_its_ring_predecessors_replicas():
    need = need_for(_spec(ranks=8, ranks_per_node=2, replicas=1), state_bytes=GiB, copy_bytes=GiB + 4096,
                    slots_per_rank=4)
    assert (need.ranks_per_node, need.slots_per_rank, need.replica_ranks) == (2, 4, 2)
    assert need.copies == 2 * 4 + 2 * (REPLICAS_KEPT + 1) == 16
    assert need.total == 16 * (GiB + 4096)
    two = need_for(_spec(ranks=8, ranks_per_node=2, replicas=2), state_bytes=GiB, copy_bytes=GiB, slots_per_rank=4)
    assert two.replica_ranks == 4  # the two nodes before it push their 2 ranks each
    # two nodes: only one other node can push here, whatever replicas says
    assert need_for(_spec(ranks=2, replicas=3), state_bytes=1, copy_bytes=1, slots_per_rank=4).replica_ranks == 1
    assert need_for(_spec(ranks=1, replicas=1), state_bytes=1, copy_bytes=1, slots_per_rank=4).replica_ranks == 0
    off = need_for(_spec(ranks=4, replicas=0), state_bytes=GiB, copy_bytes=GiB, slots_per_rank=2)
    assert (off.copies, off.replica_ranks) == (2, 0) and "replicas" not in off.why()


def _need() -> ShmNeed:
    return ShmNeed(state_bytes=GiB, copy_bytes=GiB, ranks_per_node=1, slots_per_rank=4, replica_ranks=1)


def test_verdict_refuses_more_than_the_filesystem_has_with_the_numbers_and_the_fix():
    why = verdict(_need(), free=6 * GiB, used=1 * GiB, budget=None, where="/dev/shm/hotspare-x", who="rank 2")
    assert why == (
        "this node's snapshots need 8.00 GiB in /dev/shm/hotspare-x: rank 2's state is 1.00 GiB and the node keeps "
        "8 copies of such a state (4 snapshot slots for each of its 1 rank(s) + 4 replicas (3 kept, 1 arriving) "
        "for each of 1 rank(s) of the nodes before it in the ring), but its filesystem has only 7.00 GiB for them "
        "(6.00 GiB free + 1.00 GiB this job holds there already); give /dev/shm more room (docker run "
        "--shm-size=9g, or the Kubernetes option shm_size), or lower replicas or ranks_per_node, or shrink the state")
    assert why.count(". ") == 0, "one sentence"
    assert verdict(_need(), free=7 * GiB, used=1 * GiB, budget=None, where="d", who="rank 2") is None  # exactly fits


def test_verdict_refuses_more_than_the_configured_budget_even_with_room_to_spare():
    why = verdict(_need(), free=100 * GiB, used=0, budget=6 * GiB, where="d", who="rank 0")
    assert why is not None and "need 8.00 GiB in d" in why
    assert "more than the spec's shm_budget of 6.00 GiB; raise shm_budget to at least 8.00 GiB" in why
    assert verdict(_need(), free=100 * GiB, used=0, budget=8 * GiB, where="d", who="rank 0") is None


def test_check_room_counts_this_jobs_files_as_room_and_reads_statvfs(tmp_path):
    (tmp_path / "rank0.slot0").write_bytes(b"x" * 100_000)  # a slot of the smaller layout before
    used = os.stat(tmp_path / "rank0.slot0").st_blocks * 512
    need = ShmNeed(state_bytes=1000, copy_bytes=1_000_000, ranks_per_node=1, slots_per_rank=4, replica_ranks=0)

    def statvfs(free: int):
        return lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096)

    check_room(tmp_path, need, None, "rank 0", statvfs=statvfs(4_000_000 - used + 4096))
    with pytest.raises(ShmTooSmall) as e:
        check_room(tmp_path, need, None, "rank 0", statvfs=statvfs(4_000_000 - used - 8192))
    assert isinstance(e.value, Unrecoverable), "it must end the job, not send the rank to a spare"
    assert f"{fmt_bytes(used)} this job holds there already" in str(e.value)


def test_no_room_is_a_sentence_for_enospc_only(tmp_path):
    full = shm_budget.no_room(tmp_path, 3 * GiB, "a snapshot slot of sid 1", OSError(errno.ENOSPC, "No space left"))
    assert isinstance(full, ShmTooSmall)
    assert str(full).startswith(f"no space left in {tmp_path} for a snapshot slot of sid 1 of 3.00 GiB (")
    assert "give /dev/shm more room (docker run --shm-size, the Kubernetes option shm_size)" in str(full)
    assert shm_budget.no_room(tmp_path, 1, "x", OSError(errno.EACCES, "denied")) is None


# -- the spec field --------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "size"), [("8GiB", 8 * GiB), ("8Gi", 8 * GiB), ("8G", 8 * 10**9),
                                             ("512 MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2), (4096, 4096)])
def test_shm_budget_takes_sizes_as_kubernetes_writes_them(tmp_path, value, size):
    (tmp_path / "t.py").write_text("def train(session):\n    pass\n")
    spec = parse_spec({"name": "a", "entrypoint": "t.py:train", "ranks": 2, "steps": 3, "shm_budget": value},
                      base_dir=tmp_path)
    assert spec.shm_budget == size
    assert JobSpec.from_json(spec.to_json()).shm_budget == size


@pytest.mark.parametrize("value", ["lots", "8i", "0GiB", 0, -1, True, 2.5, "8 GiBs"])
def test_shm_budget_refuses_what_is_not_a_size_naming_the_field_and_the_form(tmp_path, value):
    (tmp_path / "t.py").write_text("def train(session):\n    pass\n")
    with pytest.raises(SpecError) as e:
        parse_spec({"name": "a", "entrypoint": "t.py:train", "ranks": 2, "steps": 3, "shm_budget": value},
                   base_dir=tmp_path)
    assert "shm_budget" in str(e.value)
    assert "8GiB" in str(e.value) or "between 1 byte" in str(e.value)


# -- the engine: the check before a bigger layout's first slot, and a full filesystem -----------------
def _engine(directory: Path, width: int = 64) -> tuple[SnapshotEngine, torch.nn.Module]:
    model = torch.nn.Linear(width, width)
    eng = SnapshotEngine(directory, sid=0, replicate_every=10, replication_timeout=5)
    eng.providers = provider_for("model", model)
    return eng, model


def test_a_state_over_the_budget_ends_the_job_at_its_first_snapshot_before_any_slot_is_made(tmp_path):
    eng, _ = _engine(tmp_path)
    spec = _spec(ranks=2, shm_budget=100_000)  # 8 copies of a ~16 KiB state + header room: ~600 KiB
    asked: list[tuple[int, int, int]] = []

    def admit(data_len: int, slot_bytes: int, slots: int) -> None:  # what Session._admit_snapshots does
        asked.append((data_len, slot_bytes, slots))
        check_room(eng.dir, need_for(spec, state_bytes=data_len, copy_bytes=slot_bytes, slots_per_rank=slots),
                   spec.shm_budget, "rank 0")

    eng.admit = admit
    eng.capture(-1)
    with pytest.raises(ShmTooSmall, match=r"more than the spec's shm_budget of 97\.7 KiB") as e:
        eng.wait()  # as the optimizer's pre-hook or the next capture would: not a RuntimeError
    assert "rank 0's state is 16.2 KiB and the node keeps 8 copies" in str(e.value)
    assert asked == [(64 * 64 * 4 + 64 * 4, asked[0][1], 4)]  # weight and bias; 2 ring + 2 point slots
    assert not SlotDir(tmp_path).sids(), "no slot was made"
    eng.close()


def test_a_bigger_layout_is_checked_again_and_a_smaller_or_equal_one_is_not(tmp_path):
    eng, _ = _engine(tmp_path)
    sizes: list[int] = []
    eng.admit = lambda data_len, slot_bytes, slots: sizes.append(data_len)
    for step in (-1, 0, 1, 2):
        eng.capture(step)
        eng.wait()
    opt = torch.optim.Adam([p for _, p in eng.providers[0][1].module.named_parameters()])
    eng.providers = eng.providers + provider_for("opt", opt)
    eng.providers[0][1].module(torch.ones(1, 64)).sum().backward()
    opt.step()  # Adam's state appears: a bigger layout
    eng.capture(3)
    eng.wait()
    assert len(sizes) == 2 and sizes[1] > 2 * sizes[0], sizes
    eng.close()


def _no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_filesystem_when_a_slot_is_made_is_one_sentence_and_leaves_no_file(tmp_path, monkeypatch):
    eng, _ = _engine(tmp_path)
    monkeypatch.setattr(os, "posix_fallocate", _no_space)  # what a full tmpfs answers
    eng.capture(5)
    with pytest.raises(ShmTooSmall) as e:
        eng.wait()
    msg = str(e.value)
    assert msg.startswith(f"no space left in {tmp_path} for a snapshot slot of sid 0 of ") and "free)" in msg
    assert "give /dev/shm more room" in msg
    assert not [p.name for p in tmp_path.iterdir() if "slot" in p.name or "point" in p.name], "a half-made slot"
    eng.close()
