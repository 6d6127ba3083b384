"""The import layering of hotspare's own modules (docs/architecture.md, "Layers").

A module may import modules of its own layer or of a lower one, never of a higher one;
``control``, ``node`` and ``train`` stand side by side and never import each other (the
controller never pulls in torch, the agent never pulls in the training loop, the training
process never needs the agent's code). Every import counts, including function-local ones:
a lazy import is still an edge a newcomer must know about.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the import package and the repository folders its subpackages live in (pyproject's package-dir)
FOLDERS = {"hotspare": "hotspare", "hotspare.orchestrator": "orchestrator",
           "hotspare.agents": "agents", "hotspare.recovery": "recovery"}
BARE = ("orchestrator", "agents", "recovery")  # never imported without the hotspare. prefix

#: (layer, module patterns, written without the ``hotspare.`` prefix), lowest first. The first
#: matching pattern wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("orchestrator", "orchestrator.util", "orchestrator.spec", "orchestrator.spec_*",
              "orchestrator.chaos")),
    ("store", ("orchestrator.store", "orchestrator.store.errors", "orchestrator.store.client",
               "orchestrator.store.lease", "orchestrator.store.options", "orchestrator.store.records", "orchestrator.store.snapshot",
               "orchestrator.store.job",
               "orchestrator.store.events")),
    ("contracts", ("recovery.slotfile", "recovery.wire", "recovery.wire_body", "recovery.replica_client", "recovery.bell",
                   "recovery.errors", "recovery.shm_budget",
                   "recovery.persist", "recovery.checkpoint*", "agents.worker_link", "agents.zygote", "agents.zygote_server",
                   "agents.heartbeat", "orchestrator.timeline", "orchestrator.status")),
    ("control", ("orchestrator.decide", "orchestrator.failure_guards", "orchestrator.controller")),
    ("node", ("agents", "agents.agent", "agents.job_follower", "agents.replica", "agents.replica_store", "agents.persist", "agents.node*")),
    ("train", ("recovery", "recovery.*", "agents.worker", "orchestrator.store.c10d")),
    ("launch", ("orchestrator.launchers", "orchestrator.launchers.*", "orchestrator.embedded*",
                "orchestrator.etcd_server", "orchestrator.etcd_tls", "orchestrator.torchrun_rdzv",
                "orchestrator.entry_check")),
    ("face", ("orchestrator.cli", "orchestrator.cli_*", "orchestrator.commands",
              "orchestrator.commands.*", "")),  # "": the hotspare package, the public API
]
#: Layers that stand side by side: neither may import the other.
SIBLINGS = {"control", "node", "train"}
ORDER = {name: i for i, (name, _) in enumerate(LAYERS)}
#: control, node and train share one floor
FLOOR = {name: (ORDER["control"] if name in SIBLINGS else ORDER[name]) for name in ORDER}


def layer_of(module: str) -> str:
    short = module.removeprefix("hotspare").removeprefix(".")
    for name, patterns in LAYERS:
        if any(fnmatch.fnmatchcase(short, p) for p in patterns):
            return name
    raise LookupError(f"module {module} is in no layer: add it to LAYERS (and to docs/architecture.md)")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    package = next(pkg for pkg, folder in FOLDERS.items() if rel.parts[0] == folder)
    parts = [package, *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def own_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS.values() for p in sorted((ROOT / folder).rglob("*.py"))}


def imports_of(module: str, path: Path) -> set[str]:
    """hotspare modules imported anywhere in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # ``from pkg import mod`` is an edge to pkg.mod; ``from pkg import name``, to pkg
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in ("hotspare", *BARE))
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` refers to (``from pkg import thing`` names pkg's module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def violations(modules: dict[str, Path]) -> list[str]:
    out = []
    for mod, path in modules.items():
        mine = layer_of(mod)
        found = imports_of(mod, path)
        out += [f"{mod} imports {imp}: write hotspare.{imp}" for imp in sorted(found)
                if imp.split(".")[0] in BARE]
        targets = {resolve(imp, modules) for imp in found} - {None, mod}
        for target in sorted(targets):
            theirs = layer_of(target)
            upward = FLOOR[theirs] > FLOOR[mine]
            sideways = theirs != mine and theirs in SIBLINGS and mine in SIBLINGS
            if upward or sideways:
                out.append(f"{mod} ({mine}) imports {target} ({theirs})")
    return out


def test_every_module_has_a_layer():
    for mod in own_modules():
        layer_of(mod)


def test_no_module_imports_a_layer_above_or_beside_its_own():
    bad = violations(own_modules())
    assert not bad, "imports against the layering (docs/architecture.md, Layers):\n  " + "\n  ".join(bad)


def test_tests_benchmarks_and_examples_import_hotspare_by_its_one_name():
    """A bare ``import recovery`` would load a second copy of a module (the repository root is
    on pytest's path) or, in a user's directory, the user's own ``recovery.py``."""
    bad = []
    for folder in ("tests", "benchmarks", "examples", "docker", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)}: {imp}" for imp in sorted(imports_of("x", path))
                    if imp.split(".")[0] in BARE]
    assert not bad, "imports without the hotspare. prefix:\n  " + "\n  ".join(bad)


def test_the_check_catches_upward_sideways_and_bare_imports(tmp_path):
    """The check itself can fail: a store module importing the controller (upward) and the
    agent lazily importing the training session (sideways) are reported, and so is an import
    without the hotspare. prefix."""
    files = {
        "hotspare.orchestrator.store.job": "from ..controller import Controller\n",
        "hotspare.agents.agent": "def f():\n    from hotspare.recovery.session import Session\n"
                                 "import recovery.state\n",
        "hotspare.orchestrator.controller": "",
        "hotspare.recovery.session": "",
    }
    modules = {}
    for mod, text in files.items():
        f = tmp_path.joinpath(*mod.split(".")).with_suffix(".py")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        modules[mod] = f
    bad = violations(modules)
    assert bad == [
        "hotspare.orchestrator.store.job (store) imports hotspare.orchestrator.controller (control)",
        "hotspare.agents.agent imports recovery.state: write hotspare.recovery.state",
        "hotspare.agents.agent (node) imports hotspare.recovery.session (train)",
    ]


@pytest.mark.parametrize("module", ["hotspare.orchestrator.cli", "hotspare.agents.agent", "hotspare.recovery.session"])
def test_known_modules_sit_where_the_docs_say(module):
    assert layer_of(module) == {"hotspare.orchestrator.cli": "face", "hotspare.agents.agent": "node",
                                "hotspare.recovery.session": "train"}[module]
