"""The container image cannot be built here (no Docker engine); check what can be checked
offline: every COPY source exists, both variants resolve to a defined stage, the image's
entry point is the CLI, and the Kubernetes backend's default image is the tag the docs build."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_every_copy_source_is_in_the_repository():
    copies = [shlex.split(rest) for word, rest in _instructions() if word == "COPY"]
    assert copies
    for args in copies:
        for src in [a for a in args[:-1] if not a.startswith("--")]:
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"


def test_both_variants_resolve_to_a_stage_and_the_entrypoint_is_the_cli():
    ins = _instructions()
    stages = {m.group(1) for w, r in ins if w == "FROM" and (m := re.search(r"\bAS\s+(\S+)", r, re.I))}
    final = [r for w, r in ins if w == "FROM"][-1]
    assert "${VARIANT}" in final
    for variant in ("cpu", "cuda"):
        assert final.split()[0].replace("${VARIANT}", variant) in stages
    default = next(r for w, r in ins if w == "ARG" and r.startswith("VARIANT="))
    assert default == "VARIANT=cpu"
    assert ("ENTRYPOINT", '["hotspare"]') in ins
    assert any(w == "RUN" and "torch==${TORCH_VERSION}" in r for w, r in ins)  # pinned, never a bare torch


def test_kubernetes_default_image_is_the_documented_tag():
    from hotspare.orchestrator.launchers import kubernetes

    assert kubernetes.DEFAULT_IMAGE == "hotspare:cpu"
    assert "-t hotspare:cpu" in (REPO / "docker" / "README.md").read_text()


def test_the_image_runs_as_the_unprivileged_user_the_kubernetes_pods_require():
    """Security review F17: the pods run with runAsNonRoot and runAsUser 10001; an image
    without that user would run as root (or not start)."""
    from hotspare.orchestrator.launchers.k8s_manifests import RUN_AS

    ins = _instructions()
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1] == f"{RUN_AS}:{RUN_AS}"
    assert any(word == "RUN" and f"--uid {RUN_AS}" in rest for word, rest in ins)
    assert [w for w, _ in ins].index("USER") > max(i for i, (w, r) in enumerate(ins) if w == "RUN" and "pip install" in r)
