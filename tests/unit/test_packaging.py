"""hotspare installs one import name, ``hotspare``, and nothing of ours shadows or is shadowed.

The repository keeps its top-level folders (``orchestrator/``, ``agents/``, ``recovery/``);
pyproject's package-dir installs them as ``hotspare.orchestrator`` and so on. These tests read
pyproject, build the wheel a ``pip install .`` (the Docker image) would install, and check the
benchmark, example and test folders for modules named like ours."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
OURS = ("hotspare", "orchestrator", "agents", "recovery")


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _expected_packages() -> set[str]:
    dirs = _setuptools()["package-dir"]
    out = set()
    for name, folder in dirs.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            out.add(".".join((name, *rel)))
    return out


def test_every_package_folder_is_listed_and_everything_installs_under_hotspare():
    listed = set(_setuptools()["packages"])
    assert listed == _expected_packages(), "pyproject's packages and the folders with __init__.py differ"
    assert all(p == "hotspare" or p.startswith("hotspare.") for p in listed)


def test_the_wheel_holds_every_module_under_hotspare_and_nothing_at_the_top(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    [wheel] = tmp_path.glob("hotspare-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    tops = {n.split("/")[0] for n in names}
    assert tops == {"hotspare"}, f"the wheel installs other top-level names: {sorted(tops)}"
    dirs = _setuptools()["package-dir"]
    for name, folder in dirs.items():
        for py in (REPO / folder).rglob("*.py"):
            want = "/".join((*name.split("."), *py.relative_to(REPO / folder).parts))
            assert want in names, f"{py.relative_to(REPO)} is missing from the wheel (as {want})"


def test_no_benchmark_example_or_test_module_is_named_like_a_hotspare_package():
    """``python benchmarks/x.py`` puts benchmarks/ first on sys.path: a benchmarks/recovery.py
    once shadowed the recovery package there and every torchrun run failed."""
    bad = [str(p.relative_to(REPO)) for folder in ("benchmarks", "examples", "tests")
           for p in (REPO / folder).rglob("*")
           if (p.is_file() and p.suffix == ".py" and p.stem in OURS) or (p.is_dir() and p.name in OURS)]
    assert not bad, f"these would shadow (or be shadowed by) hotspare's packages: {bad}"


def test_the_bare_names_are_not_importable_from_outside_the_repository(tmp_path):
    """Only ``hotspare`` is installed: a user's ``import agents`` finds the user's module."""
    code = ("import importlib.util, json\n"
            "print(json.dumps({n: importlib.util.find_spec(n) is not None "
            "for n in ('hotspare', 'orchestrator', 'agents', 'recovery')}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == '{"hotspare": true, "orchestrator": false, "agents": false, "recovery": false}'
