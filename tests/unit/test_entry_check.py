"""The entrypoint check (orchestrator/entry_check.py): a real subprocess imports the user's
module the way a worker does and binds ``(session, **args)``; each problem is one sentence
naming the file and line, the function or the parameter."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hotspare.orchestrator.entry_check import EntryError, check_entrypoint, require


def module(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


GOOD = """\
    print("printed at import: must not confuse the check")

    def train(session, lr: float = 0.1, steps: int = 3):
        pass

    def build_model():
        pass
"""


def test_a_good_entrypoint_passes(tmp_path):
    path = module(tmp_path, "good.py", "import torch\n" + textwrap.dedent(GOOD))
    assert check_entrypoint(f"{path}:train", {"lr": 0.5}) is None


def test_the_users_files_never_shadow_what_the_worker_imported_first(tmp_path):
    """The worker imports torch before the user's module: a ``numpy.py`` next to the
    entrypoint is not what torch (or the user's ``import numpy``) gets; so it is in the check."""
    module(tmp_path, "numpy.py", "raise RuntimeError('the user numpy.py was imported')\n")
    path = module(tmp_path, "uses_numpy.py", "import numpy\n\ndef train(session):\n    pass\n")
    assert check_entrypoint(f"{path}:train", {}) is None


def test_a_syntax_error_names_the_file_and_line(tmp_path):
    path = module(tmp_path, "broken.py", """\
        import torch

        def train(session, lr=0.1:
            pass
    """)
    problem = check_entrypoint(f"{path}:train", {})
    assert problem is not None and problem.kind == "syntax" and problem.about_code
    assert f"{path}:3" in problem.message and "syntax error" in problem.message
    assert "\n" not in problem.message


def test_a_missing_function_names_it_and_suggests_the_one_that_exists(tmp_path):
    path = module(tmp_path, "good.py", GOOD)
    problem = check_entrypoint(f"{path}:trian", {})
    assert problem is not None and problem.kind == "missing"
    assert "no function 'trian'" in problem.message and "did you mean 'train'?" in problem.message
    assert "build_model, train" in problem.message  # what the module does define


@pytest.mark.parametrize("args, words", [
    ({"lrr": 0.1}, ["no parameter 'lrr'", "did you mean 'lr'?"]),
    ({}, ["needs argument 'depth'", "add args.depth"]),
])
def test_arguments_the_function_does_not_take_name_the_parameter(tmp_path, args, words):
    path = module(tmp_path, "needs.py", """\
        def train(session, depth, lr=0.1):
            pass
    """)
    problem = check_entrypoint(f"{path}:train", {"depth": 2, **args} if "lrr" in args else args)
    assert problem is not None and problem.kind == "args", problem
    for w in words:
        assert w in problem.message, problem.message


def test_a_function_without_a_session_parameter_is_refused(tmp_path):
    path = module(tmp_path, "nosession.py", "def train():\n    pass\n")
    problem = check_entrypoint(f"{path}:train", {})
    assert problem is not None and problem.kind == "args" and "takes no session" in problem.message


def test_a_module_entrypoint_is_imported_from_the_workers_directory(tmp_path):
    """``pkg.mod:fn`` is found from the current directory, as the worker finds it; a module
    that is not there, or one whose own import fails, is named with the fix."""
    module(tmp_path, "pkg/__init__.py", "")
    module(tmp_path, "pkg/mod.py", "def train(session, n=1):\n    pass\n")
    module(tmp_path, "pkg/needs_dep.py", "import no_such_dependency\n\ndef train(session):\n    pass\n")
    assert check_entrypoint("pkg.mod:train", {"n": 2}, cwd=tmp_path) is None
    gone = check_entrypoint("pkg.nope:train", {}, cwd=tmp_path)
    assert gone is not None and gone.kind == "import" and "no module named 'pkg.nope'" in gone.message
    dep = check_entrypoint("pkg.needs_dep:train", {}, cwd=tmp_path)
    assert dep is not None and dep.kind == "import" and not dep.about_code
    assert "no_such_dependency" in dep.message and f"{tmp_path / 'pkg' / 'needs_dep.py'}:1" in dep.message


def test_the_specs_env_is_the_environment_the_module_is_imported_with(tmp_path):
    path = module(tmp_path, "env.py", """\
        import os
        DATA = os.environ["MY_DATA_DIR"]

        def train(session):
            pass
    """)
    problem = check_entrypoint(f"{path}:train", {})
    assert problem is not None and problem.kind == "raised" and f"{path}:2" in problem.message
    assert "KeyError" in problem.message
    assert check_entrypoint(f"{path}:train", {}, {"MY_DATA_DIR": "/data"}) is None


def test_local_jobs_refuse_every_problem_other_backends_only_problems_in_the_code(tmp_path):
    """A module that does not import here may import in the cluster's image: for a non-local
    backend that is a warning; a missing function is wrong everywhere."""
    dep = module(tmp_path, "dep.py", "import no_such_dependency\n\ndef train(session):\n    pass\n")
    with pytest.raises(EntryError, match="no_such_dependency.*--no-check"):
        require(f"{dep}:train", {}, {}, "local", warn=print)
    warnings: list[str] = []
    require(f"{dep}:train", {}, {}, "kubernetes", warn=warnings.append)
    assert len(warnings) == 1 and "no_such_dependency" in warnings[0] and "kubernetes" in warnings[0]
    good = module(tmp_path, "good.py", GOOD)
    with pytest.raises(EntryError, match="no function 'trian'"):
        require(f"{good}:trian", {}, {}, "slurm", warn=warnings.append)
