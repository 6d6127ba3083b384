"""`hotspare submit`, `run` and `submit --dry-run` check the entrypoint before anything starts:
a syntax error, a misspelled function or arguments the function does not take are one line on
stderr, exit code 2, and no job, agent or output directory (orchestrator/entry_check.py)."""

from __future__ import annotations

import pytest

BROKEN = {
    "syntax.py": "import time\n\ndef train(session, steps=3:\n    pass\n",
    "fine.py": "def train(session, lr=0.1):\n    pass\n\ndef evaluate(session):\n    pass\n",
}


@pytest.mark.parametrize("command, file, fields, words", [
    (["submit"], "syntax.py:train", {}, ["syntax.py:3", "syntax error"]),
    (["run"], "fine.py:trian", {}, ["no function 'trian'", "did you mean 'train'?"]),
    (["submit", "--dry-run"], "fine.py:train", {"args": {"lrr": 0.5}}, ["no parameter 'lrr'", "did you mean 'lr'?"]),
])
def test_a_broken_entrypoint_is_refused_before_anything_starts(cluster, command, file, fields, words):
    cluster.entry_check = True
    for name, source in BROKEN.items():
        (cluster.tmp / name).write_text(source)
    spec = cluster.spec_file(name="broken", entrypoint=str(cluster.tmp / file), **fields)
    r = cluster.hotspare(command[0], str(spec), *command[1:], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--no-check" in err[0], r.stderr
    for w in words:
        assert w in err[0], err[0]
    assert not cluster.job("broken").exists()
    assert not (cluster.tmp / "out" / "broken").exists()  # no output dir, no agents.json: nothing ran
    assert "# resolved spec" not in r.stdout


def test_no_check_skips_the_check(cluster):
    (cluster.tmp / "fine.py").write_text(BROKEN["fine.py"])
    spec = cluster.spec_file(name="unchecked", entrypoint=str(cluster.tmp / "fine.py") + ":trian")
    r = cluster.hotspare("submit", str(spec), "--dry-run", "--no-check", timeout=120)
    assert r.returncode == 0, r.stderr
