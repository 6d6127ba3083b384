"""The two places a persisted checkpoint can live -- a directory and an fsspec URL -- behave
the same for everything the checkpoint format does with them (one scenario, both tiers)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from hotspare.recovery.checkpoint_store import FsspecDir, LocalDir, checkpoint_path, tier_for


@pytest.fixture(params=["dir", "memory"])
def tier(request, tmp_path):
    if request.param == "dir":
        yield LocalDir(tmp_path / "root")
        return
    pytest.importorskip("fsspec")
    bucket = f"hs-{uuid.uuid4().hex[:8]}"
    t = FsspecDir(f"memory://{bucket}/root")
    yield t
    t.fs.rm(f"/{bucket}", recursive=True)


def test_a_tier_stores_lists_and_removes_step_directories(tier, tmp_path):
    assert tier.ls() == []  # a root nobody wrote to yet is empty, not an error
    with pytest.raises(FileNotFoundError):
        tier.read("step00000010", "rank0.json")
    assert not tier.exists("step00000010", "rank0.json")

    local = tmp_path / "staged.bin"
    local.write_bytes(b"\x00\x01payload")
    tier.put(local, "step00000010", "rank0.safetensors")  # creates the step directory
    tier.write_json({"b": 1, "a": [2]}, "step00000010", "rank0.json")
    tier.sync("step00000010")

    assert tier.exists("step00000010", "rank0.json")
    assert tier.read("step00000010", "rank0.safetensors") == b"\x00\x01payload"
    raw = tier.read("step00000010", "rank0.json")
    assert json.loads(raw) == {"a": [2], "b": 1} and raw.startswith(b'{\n "a"')  # sorted, indented
    assert tier.ls() == ["step00000010"]

    tier.rm("step00000010")
    tier.rm("step00000010")  # already gone: quietly
    assert tier.ls() == [] and not tier.exists("step00000010", "rank0.json")


def test_a_directory_tier_leaves_no_temporary_files(tmp_path):
    t = LocalDir(tmp_path)
    (tmp_path / "step00000001").mkdir()
    t.write_json({"x": 1}, "step00000001", "manifest.json")
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    t.put(src, "step00000001", "rank0.safetensors")
    assert sorted(p.name for p in (tmp_path / "step00000001").iterdir()) == ["manifest.json", "rank0.safetensors"]


def test_only_text_with_a_scheme_is_a_url():
    assert isinstance(tier_for("/data/ckpt"), LocalDir)
    assert isinstance(tier_for(Path("/data/ckpt")), LocalDir)
    pytest.importorskip("fsspec")
    assert isinstance(tier_for("memory://x/ckpt"), FsspecDir)
    assert checkpoint_path("memory://x/ckpt/", 40) == "memory://x/ckpt/step00000040"
