"""What ``hotspare status`` reports (orchestrator/status.py), from snapshots built by hand."""

from __future__ import annotations

import json

import pytest

from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.status import job_status, next_point, rank_rows, spares, straggler_scores
from hotspare.orchestrator.store import JobSnapshot, JobState, Node, Progress, Seat, World

NOW = 1_000_000.0


def spec(**fields) -> JobSpec:
    return JobSpec(name="s", entrypoint="x.py:train", ranks=4, steps=1000, **fields)


def snapshot(compute=(0.1, 0.1, 0.1, 0.1), nodes=("n0", "n1", "n2", "n3", "spare0"), done=(),
             steps=(10, 10, 10, 10), step_time=0.5, at=NOW, **spec_fields) -> JobSnapshot:
    seats = tuple(Seat(f"n{r}", f"inc{r}", since=2) for r in range(4))
    live = {n: Node(n, f"inc{n[1:]}" if n.startswith("n") else "x", "active", 1) for n in nodes}
    progress = {r: Progress(rank=r, step=s, epoch=2, node=f"n{r}", time=at, step_time=step_time,
                            compute_time=c)
                for r, (s, c) in enumerate(zip(steps, compute, strict=True)) if s is not None}
    return JobSnapshot(job="s", revision=1, spec=spec(**spec_fields), state=JobState.RUNNING,
                       epoch=2, world=World(2, seats), nodes=live, progress=progress,
                       done={r: {"epoch": 2, "step": 999} for r in done})


def states(snap: JobSnapshot) -> list[str]:
    return [r.state for r in rank_rows(snap, NOW)]


def test_a_rank_is_running_lost_or_done_by_its_node_and_done_mark():
    snap = snapshot(nodes=("n0", "n2", "n3"), done=(3,))
    assert states(snap) == ["running", "lost", "running", "done"]


def test_a_rank_on_a_new_incarnation_of_its_node_is_lost():
    snap = snapshot()
    snap.nodes["n1"] = Node("n1", "rejoined", "spare", 1)
    assert states(snap)[1] == "lost"


def test_a_rank_at_the_threshold_is_a_straggler_and_the_threshold_is_the_spec_s():
    snap = snapshot(compute=(0.1, 0.1, 0.2, 0.4))  # median 0.2: scores 0.5, 0.5, 1.0, 2.0
    assert states(snap) == ["running"] * 3 + ["straggler"]  # the default threshold is 2.0
    assert [r.straggler_score for r in rank_rows(snap, NOW)] == [0.5, 0.5, 1.0, 2.0]
    assert states(snapshot(compute=(0.1, 0.1, 0.2, 0.4), straggler_threshold=2.5)) == ["running"] * 4


def test_no_scores_until_more_than_half_the_world_reported_in_its_seat():
    snap = snapshot(compute=(0.1, 0.9, 0.0, 0.0))
    assert straggler_scores(snap, snap.world) == {}
    old_seat = snapshot(compute=(0.1, 0.9, 0.1, 0.1))
    old_seat.progress[2] = Progress(rank=2, step=5, epoch=1, node="n2", time=NOW, compute_time=0.1)
    old_seat.progress[3] = Progress(rank=3, step=5, epoch=1, node="n3", time=NOW, compute_time=0.1)
    assert straggler_scores(old_seat, old_seat.world) == {}  # epoch 1 < the seats' since (2)
    assert straggler_scores(snapshot(compute=(0.1, 0.9, 0.1, 0.0)), snapshot().world)[1] == pytest.approx(9.0)


def test_spares_are_the_live_nodes_without_a_seat():
    assert spares(snapshot()) == ["spare0"]
    assert spares(snapshot(nodes=("n0",))) == []


def test_the_json_keeps_its_fields_and_their_order():
    snap = snapshot(steps=(10, None, 10, 10), at=NOW - 3.04)
    data = json.loads(json.dumps(job_status(snap, NOW)))
    assert list(data) == ["job", "state", "message", "epoch", "ranks", "spares", "nodes", "leader"]
    assert list(data["ranks"][0]) == ["rank", "node", "state", "step", "since_epoch", "step_time",
                                      "compute_time", "straggler_score", "age_s"]
    assert data["ranks"][0]["age_s"] == 3.0
    assert data["ranks"][1]["step"] == -1 and data["ranks"][1]["age_s"] is None


def test_a_job_without_a_world_has_no_rows():
    snap = JobSnapshot(job="s", revision=1)
    assert rank_rows(snap, NOW) == [] and spares(snap) == []


def test_next_point_extrapolates_the_fastest_rank_and_leaves_the_margin():
    # published at step 10, 4 s ago, 0.5 s a step: at about step 18 now; 2 s more is 4 steps
    snap = snapshot(steps=(10, 8, 10, 9), at=NOW - 4.0)
    assert next_point(snap, every=10, margin_s=2.0, now=NOW) == 30  # 22 -> the point after it
    assert next_point(snap, every=10, margin_s=0.0, now=NOW) == 20
    assert next_point(snap, every=10, margin_s=0.0, now=NOW - 4.0) == 20  # at 10: the next one


def test_next_point_without_progress_is_the_first_point():
    snap = JobSnapshot(job="s", revision=1)
    assert next_point(snap, every=5, margin_s=2.0, now=NOW) == 0
