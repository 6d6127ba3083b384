"""The persistent tier on real files: snapshot slots written by the real engine, persisted by
the agent's Persister, read back by load_checkpoint and by plain safetensors; truncated and
corrupt files refused by name; a really full filesystem (a tiny tmpfs) leaves the previous
checkpoint intact."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotspare.agents.node_view import NodeView
from hotspare.agents.persist import Persister
from hotspare.agents.replica import ReplicaStore
from hotspare.orchestrator.spec import JobSpec
from hotspare.recovery import persist
from hotspare.recovery.final import load_checkpoint
from hotspare.recovery.snapshot import SnapshotEngine
from hotspare.recovery.state import provider_for


def _engine(tmp: Path, width: int = 64, sid: int = 0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    eng = SnapshotEngine(tmp / "shm", sid, replicate_every=10, replication_timeout=5)
    eng.providers = provider_for("model", model) + provider_for("optimizer", opt)
    return eng, model, opt


def _train_to(eng, model, opt, upto: int, start: int = 0) -> None:
    store = ReplicaStore(eng.dir)
    for step in range(start, upto + 1):
        opt.zero_grad()
        model(torch.randn(4, model[0].in_features)).sum().backward()
        opt.step()
        eng.capture(step)
        eng.wait()
        if step % 10 == 0:
            store.confirm(eng.sid, step)  # what the agent's replicator does once buddies have it


def _spec(**fields) -> JobSpec:
    return JobSpec(name="t", entrypoint="train:main", ranks=1, steps=100, **fields)


def _persister(eng, root: Path, events: list, **spec) -> Persister:
    s = _spec(**{"persist_every": 10, "persist_path": str(root), "output_dir": str(root.parent), **spec})
    return Persister(eng.dir, s, job="t", view=lambda: NodeView(epoch=1, world_size=1, seats={0: 0}),
                     event=lambda kind, msg, **d: events.append((kind, msg, d)))


def test_persisted_checkpoint_loads_back_exactly_and_with_plain_safetensors(tmp_path):
    eng, model, opt = _engine(tmp_path)
    _train_to(eng, model, opt, 10)
    events: list = []
    p = _persister(eng, tmp_path / "ckpt", events, persist_local_dir=str(tmp_path / "ssd"))
    p.persist_once()
    assert persist.complete_steps(tmp_path / "ckpt") == [10]
    assert [e[0] for e in events] == ["persisted"]
    assert not list((tmp_path / "ssd").rglob("*.safetensors"))  # moved on to the shared path

    st = load_checkpoint(tmp_path / "ckpt")
    assert st.manifest["step"] == 10 and st.manifest["world_size"] == 1
    for name, t in model.state_dict().items():
        assert torch.equal(st.ranks[0][f"model.params/{name}"], t)
    plain = load_file(str(tmp_path / "ckpt" / "step00000010" / "rank0.safetensors"))
    assert set(plain) == set(st.ranks[0]) and any(k.startswith("optimizer/") for k in plain)
    assert "1e-3" in json.dumps(st.meta[0]["optimizer"]) or "0.001" in json.dumps(st.meta[0]["optimizer"])
    eng.close()


def test_a_step_computed_twice_never_makes_one_checkpoint_of_both_computations(tmp_path):
    """Rank 0 persisted step 10, then its peer died and every rank rolled back and computed
    step 10 again (timeline 2). The peer's new file and rank 0's old one are not one
    checkpoint; once rank 0 persists its timeline-2 step 10, they are."""
    root, events = tmp_path / "ckpt", []
    e0, m0, o0 = _engine(tmp_path / "a", sid=0)
    e1, m1, o1 = _engine(tmp_path / "b", sid=1)
    p0 = Persister(e0.dir, _spec(persist_every=10, persist_path=str(root), output_dir=str(tmp_path)),
                   job="t", view=lambda: NodeView(epoch=2, world_size=2, seats={0: 0}),
                   event=lambda kind, msg, **d: events.append(kind))
    p1 = Persister(e1.dir, _spec(persist_every=10, persist_path=str(root), output_dir=str(tmp_path)),
                   job="t", view=lambda: NodeView(epoch=2, world_size=2, seats={1: 1}),
                   event=lambda kind, msg, **d: events.append(kind))
    e0.lineage = {"timeline": 1, "world_rank": 0, "world_size": 2}
    _train_to(e0, m0, o0, 10)
    p0.persist_once()
    e1.lineage = {"timeline": 2, "world_rank": 1, "world_size": 2}  # the spare, after the rollback
    _train_to(e1, m1, o1, 10)
    p1.persist_once()
    assert json.loads((root / "step00000010" / "rank0.json").read_text())["timeline"] == 1
    assert persist.complete_steps(root) == [], "timelines 1 and 2 mixed into one checkpoint"
    e0.lineage = {"timeline": 2, "world_rank": 0, "world_size": 2}  # rank 0 computes step 10 again
    _train_to(e0, m0, o0, 10, start=1)
    p0.persist_once()
    assert persist.complete_steps(root) == [10] and events == ["persisted"]
    m = persist.read_manifest(root, 10)
    assert {r["timeline"] for r in m["files"].values()} == {2}
    e0.close()
    e1.close()


def test_keep_prunes_old_checkpoints_and_never_the_newest(tmp_path):
    eng, model, opt = _engine(tmp_path)
    events: list = []
    p = _persister(eng, tmp_path / "ckpt", events, persist_keep=2)
    for upto in (10, 20, 30):
        _train_to(eng, model, opt, upto, start=upto - 9 if upto > 10 else 0)
        p.persist_once()
    assert persist.complete_steps(tmp_path / "ckpt") == [20, 30]
    eng.close()


def test_truncated_or_corrupt_checkpoint_is_refused_with_the_file_named(tmp_path):
    eng, model, opt = _engine(tmp_path)
    _train_to(eng, model, opt, 10)
    _persister(eng, tmp_path / "ckpt", []).persist_once()
    eng.close()
    f = tmp_path / "ckpt" / "step00000010" / "rank0.safetensors"
    good = f.read_bytes()

    f.write_bytes(good[: len(good) // 2])
    with pytest.raises(persist.CheckpointError, match=rf"{f}: truncated"):
        load_checkpoint(tmp_path / "ckpt")

    bad = bytearray(good)
    bad[-5] ^= 0xFF
    f.write_bytes(bytes(bad))
    with pytest.raises(persist.CheckpointError, match=rf"{f}: corrupt: CRC32 mismatch"):
        load_checkpoint(tmp_path / "ckpt")

    f.write_bytes(good)
    (f.parent / "manifest.json").write_text("{not json")
    with pytest.raises(persist.CheckpointError, match="manifest.json: unreadable manifest"):
        load_checkpoint(tmp_path / "ckpt", step=10)
    (f.parent / "manifest.json").unlink()  # a half-written checkpoint is never a checkpoint
    assert persist.complete_steps(tmp_path / "ckpt") == []
    with pytest.raises(persist.CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def tiny_fs(tmp_path):
    """A real, really small filesystem (tmpfs) to fill up."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert r.returncode == 0, f"this test mounts a 1 MiB tmpfs and needs root: {r.stderr}"
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_during_persist_keeps_the_previous_checkpoint_and_says_so(tmp_path, tiny_fs):
    eng, model, opt = _engine(tmp_path, width=160)  # ~0.4 MB of state: two do not fit in 1 MiB
    events: list = []
    root = tiny_fs / "ckpt"
    p = _persister(eng, root, events)
    _train_to(eng, model, opt, 10)
    p.persist_once()
    assert persist.complete_steps(root) == [10]
    filler = tiny_fs / "filler"
    with open(filler, "wb") as f:  # leave less room than one more checkpoint needs
        f.write(b"\0" * (os.statvfs(tiny_fs).f_bavail * os.statvfs(tiny_fs).f_frsize - 64 * 1024))
    _train_to(eng, model, opt, 20, start=11)
    p.persist_once()
    kinds = [e[0] for e in events]
    assert kinds == ["persisted", "persist-failed"], events
    msg = events[-1][1]
    assert "disk full" in msg and "No space left on device" in msg and str(root) in msg
    assert "previous checkpoint (step 10) is intact" in msg
    assert persist.complete_steps(root) == [10]
    st = load_checkpoint(root)  # verified against its CRC: intact
    assert st.manifest["step"] == 10
    assert not [x for x in (root / "step00000020").iterdir() if x.name.startswith(".")]  # no temp left
    eng.close()


def test_manifest_names_every_rank_with_size_and_checksum(tmp_path):
    eng, model, opt = _engine(tmp_path)
    _train_to(eng, model, opt, 10)
    _persister(eng, tmp_path / "ckpt", []).persist_once()
    m = json.loads((tmp_path / "ckpt" / "step00000010" / "manifest.json").read_text())
    rec = m["files"]["0"]
    size = (tmp_path / "ckpt" / "step00000010" / rec["file"]).stat().st_size
    assert rec["bytes"] == size and isinstance(rec["crc32"], int) and m["format"] == "hotspare-ckpt-1"
    eng.close()


def test_fsspec_url_as_the_shared_path(tmp_path):
    """persist_path may be any fsspec URL: staged on local disk, then put; the manifest last."""
    import fsspec

    eng, model, opt = _engine(tmp_path)
    events: list = []
    url = "memory://hotspare-test/ckpt"
    s = _spec(persist_every=10, persist_path=url, output_dir=str(tmp_path),
              persist_local_dir=str(tmp_path / "ssd"), persist_keep=1)
    p = Persister(eng.dir, s, job="t", view=lambda: NodeView(epoch=1, world_size=1, seats={0: 0}),
                  event=lambda kind, msg, **d: events.append((kind, msg, d)))
    _train_to(eng, model, opt, 10)
    p.persist_once()
    _train_to(eng, model, opt, 20, start=11)
    p.persist_once()
    assert persist.complete_steps(url) == [20]  # keep 1: step 10 pruned
    assert events[-1][2]["path"] == url + "/step00000020"
    st = load_checkpoint(url)
    for name, t in model.state_dict().items():
        assert torch.equal(st.ranks[0][f"model.params/{name}"], t)
    fs = fsspec.filesystem("memory")
    raw = fs.cat_file("/hotspare-test/ckpt/step00000020/rank0.safetensors")
    fs.pipe_file("/hotspare-test/ckpt/step00000020/rank0.safetensors", raw[:-10])
    with pytest.raises(persist.CheckpointError, match=r"memory://hotspare-test/ckpt/step00000020/rank0.safetensors: truncated"):
        load_checkpoint(url)
    fs.rm("/hotspare-test", recursive=True)
    eng.close()


def test_any_damage_to_a_checkpoint_is_refused_naming_the_file(tmp_path):
    """Fuzz: truncations, byte flips and garbage in the data file or the manifest either load
    the intact state or raise CheckpointError naming the damaged file; nothing else."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    eng, model, opt = _engine(tmp_path, width=16)
    _train_to(eng, model, opt, 10)
    _persister(eng, tmp_path / "ckpt", []).persist_once()
    eng.close()
    d = tmp_path / "ckpt" / "step00000010"
    files = {"rank0.safetensors": (d / "rank0.safetensors").read_bytes(),
             "manifest.json": (d / "manifest.json").read_bytes()}

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(which=st.sampled_from(sorted(files)), cut=st.integers(0, 1 << 20),
           flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=4),
           tail=st.binary(max_size=16))
    def check(which, cut, flips, tail):
        raw = bytearray(files[which])
        for pos, x in flips:
            raw[pos % len(raw)] ^= x
        raw = raw[: cut % (len(raw) + 1)] + tail if cut % 3 else raw + tail
        for name, content in files.items():
            (d / name).write_bytes(bytes(raw) if name == which else content)
        try:
            st_ = load_checkpoint(tmp_path / "ckpt", step=10)
        except persist.CheckpointError as e:
            assert str(d / which) in str(e) or (which == "manifest.json" and "manifest.json" in str(e)), str(e)
        else:
            assert bytes(raw) == files[which] or which == "manifest.json", "damage went unnoticed"
            for name, t in model.state_dict().items():
                assert torch.equal(st_.ranks[0][f"model.params/{name}"], t)

    check()


def _filling_slot(tmp_path: Path, tensors: dict):
    """A slot as the engine leaves it mid-copy: header written, state WRITING, nothing copied."""
    from hotspare.recovery.slotfile import CTRL_SIZE, WRITING
    from hotspare.recovery.snapshot import Slot, plan

    infos = plan(tensors)
    hb = json.dumps({"rank": 0, "step": 10, "timeline": 1, "world_rank": 0, "world_size": 1, "meta": {},
                     "data_len": infos[-1].offset + infos[-1].nbytes,
                     "tensors": [i.__dict__ for i in infos]}).encode()
    slot = Slot(tmp_path / "rank0.point0", 4096, infos[-1].offset + infos[-1].nbytes)
    slot.set_ctrl(WRITING, 10, 7, len(hb))
    slot.mm[CTRL_SIZE: CTRL_SIZE + len(hb)] = hb
    slot.set_copied(0)
    return slot, infos


def test_persisting_streams_a_snapshot_while_it_is_still_being_copied(tmp_path):
    """The writer follows the slot's copied mark: the header and the first tensor are on disk
    before the second is even in the slot; the file counts once the slot is COMPLETE."""
    import threading
    import time

    from hotspare.recovery.slotfile import COMPLETE

    tensors = {"m/a": torch.arange(300_000, dtype=torch.float32), "m/b": torch.ones(200_000)}
    slot, infos = _filling_slot(tmp_path, tensors)
    root, out = tmp_path / "ckpt", {}
    view = persist.open_slot(slot.path, writing=True)
    assert view is not None and persist.open_slot(slot.path) is None  # not COMPLETE yet
    t = threading.Thread(target=lambda: out.setdefault("rec", persist.write_rank(
        view, root, rank=0, job="t", timeline=1, world_size=1)))
    t.start()
    slot.view(infos[0]).copy_(tensors["m/a"])
    slot.set_copied(infos[0].offset + infos[0].nbytes)
    tmp = root / "step00000010"
    deadline = time.monotonic() + 30
    while not any(f.stat().st_size > infos[0].nbytes for f in tmp.glob(".rank0*.tmp")):
        assert time.monotonic() < deadline and t.is_alive(), "nothing streamed before the copy finished"
        time.sleep(0.01)
    assert "rec" not in out  # still waiting for tensor b
    slot.view(infos[1]).copy_(tensors["m/b"])
    slot.set_copied(infos[1].offset + infos[1].nbytes)
    slot.set_ctrl(COMPLETE, 10, 7, slot.ctrl()[3], infos[1].offset + infos[1].nbytes)
    t.join(30)
    assert out["rec"]["timeline"] == 1
    assert persist.try_finish(root, 10, 1, "t")
    got = load_file(str(tmp / "rank0.safetensors"))
    assert torch.equal(got["m/a"], tensors["m/a"]) and torch.equal(got["m/b"], tensors["m/b"])
    view.close()
    slot.close()


def test_a_slot_reused_mid_stream_leaves_no_file(tmp_path):
    import threading

    from hotspare.recovery.slotfile import WRITING

    tensors = {"m/a": torch.arange(1000, dtype=torch.float32), "m/b": torch.ones(1000)}
    slot, infos = _filling_slot(tmp_path, tensors)
    view = persist.open_slot(slot.path, writing=True)
    err = {}

    def run():
        try:
            persist.write_rank(view, tmp_path / "ckpt", rank=0, job="t", timeline=1, world_size=1)
        except InterruptedError as e:
            err["e"] = e

    t = threading.Thread(target=run)
    t.start()
    slot.set_copied(infos[0].offset + infos[0].nbytes)
    slot.set_ctrl(WRITING, 20, 8, slot.ctrl()[3])  # the engine took the slot for a newer point
    t.join(30)
    assert "overwritten while persisting step 10" in str(err.get("e")), err
    assert not list((tmp_path / "ckpt").rglob("*.safetensors*")) and not list((tmp_path / "ckpt").rglob(".*tmp"))
    view.close()
    slot.close()


def test_staging_for_an_object_store_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    """Security review F5: with an object-store persist_path and no persist_local_dir the
    staging went to the predictable, shared $TMPDIR/hotspare-persist/<job>/<run>/step.../, and
    the temporary file was opened following links: another local user who created that
    directory first could make the agent overwrite any file it can write. Staging is in a
    private directory now, and the temporary name is opened with O_EXCL|O_NOFOLLOW."""
    import fsspec

    tmpdir = tmp_path / "shared-tmp"
    tmpdir.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmpdir))
    victim = tmp_path / "victim-bashrc"
    victim.write_text("precious\n")
    # the attacker's trap, at the path the old code used, for every pid the writer may have
    trap = tmpdir / "hotspare-persist" / "t" / "step00000010"
    trap.mkdir(parents=True)
    (trap / f".rank0.safetensors.{os.getpid()}.tmp").symlink_to(victim)

    eng, model, opt = _engine(tmp_path)
    url = "memory://hotspare-f5/ckpt"
    s = _spec(persist_every=10, persist_path=url, output_dir=str(tmp_path))
    p = Persister(eng.dir, s, job="t", view=lambda: NodeView(epoch=1, world_size=1, seats={0: 0}),
                  event=lambda kind, msg, **d: None)
    _train_to(eng, model, opt, 10)
    p.persist_once()
    assert victim.read_bytes() == b"precious\n", "the persister wrote through a planted link"
    assert persist.complete_steps(url) == [10]
    assert not [x for x in tmpdir.iterdir() if x.name.startswith("hotspare-persist-")], "staging dir left behind"
    fsspec.filesystem("memory").rm("/hotspare-f5", recursive=True)
    eng.close()
