"""What ``hotspare status`` reports (orchestrator/status.py), from snapshots built by hand."""

from __future__ import annotations

import json

import pytest

from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.status import (
    format_metrics,
    job_status,
    job_step,
    next_point,
    rank_rows,
    spares,
    straggler_scores,
)
from hotspare.orchestrator.store import JobSnapshot, JobState, Node, Progress, Report, Seat, World

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
    assert list(data)[:8] == ["job", "state", "message", "epoch", "ranks", "spares", "nodes", "leader"]
    assert {"step", "total_steps", "metrics"} <= set(data)
    assert list(data["ranks"][0]) == ["rank", "node", "state", "step", "since_epoch", "step_time",
                                      "compute_time", "straggler_score", "age_s", "metrics"]
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


def test_a_seat_without_a_step_in_it_is_starting_not_running():
    """A spare that just took the seat (its worker restoring, or publishing -1) and a rank
    whose last progress is from a previous holder of the seat have not trained in it yet."""
    snap = snapshot(steps=(10, None, 10, 10))
    snap.progress[2] = Progress(rank=2, step=-1, epoch=2, node="n2", time=NOW)
    snap.progress[3] = Progress(rank=3, step=9, epoch=1, node="n3", time=NOW)  # before the seat (since 2)
    assert states(snap) == ["running", "starting", "starting", "starting"]


def test_a_worker_its_agent_reported_gone_is_not_running_though_its_node_lives():
    snap = snapshot()
    snap.reports.append(Report(node="n1", rank=1, epoch=2, kind="error", exit_code=1))
    snap.reports.append(Report(node="n2", rank=2, epoch=2, kind="hang"))
    snap.reports.append(Report(node="n3", rank=3, epoch=1, kind="exit"))  # about the seat's previous holder
    assert states(snap) == ["running", "exited", "hung", "running"]


@pytest.mark.parametrize("state, want", [(JobState.FAILED, "stopped"), (JobState.CANCELLED, "stopped"),
                                         (JobState.SUCCEEDED, "done")])
def test_no_rank_of_an_ended_job_is_running(state, want):
    snap = snapshot(done=(0,) if state is not JobState.SUCCEEDED else ())
    snap.state = state
    assert states(snap)[1:] == [want] * 3 and states(snap)[0] == "done"


def test_status_carries_step_total_and_every_logged_metric():
    snap = snapshot(steps=(10, 12, -1, 11))
    for r, loss in enumerate((1.0, 2.0, 9.0, 3.0)):
        old = snap.progress[r]
        snap.progress[r] = Progress(rank=r, step=old.step, epoch=2, node=old.node, time=NOW,
                                    metrics={"loss": loss, "acc": 0.5} if r != 2 else {})
    data = job_status(snap, NOW)
    assert data["step"] == 11 and data["total_steps"] == 1000  # the slowest rank that stepped: 10 -> 11 done
    assert data["metrics"] == {"loss": 2.0, "acc": 0.5}
    assert data["ranks"][1]["metrics"] == {"loss": 2.0, "acc": 0.5}
    assert format_metrics(data["metrics"]) == "loss 2 acc 0.5"
    assert job_step([]) == 0


def test_the_run_progress_line_never_goes_backwards_after_a_recovery():
    """After a swap the new holder of a seat publishes step -1 until it restored, and the
    world resumes from the last replicated step: `hotspare run` keeps showing the most it showed."""
    from hotspare.orchestrator.commands.jobs import _progress_line

    line, shown = _progress_line(snapshot(steps=(40, 41, 40, 42)), 1000)
    assert shown == 41 and "steps 41/1000" in line
    after = snapshot(steps=(38, 38, 38, 38))
    after.progress[1] = Progress(rank=1, step=-1, epoch=2, node="n1", time=NOW)
    line, shown = _progress_line(after, 1000, shown)
    assert shown == 41 and "steps 41/1000" in line
    line, shown = _progress_line(snapshot(steps=(50, 50, 50, 50)), 1000, shown)
    assert shown == 51 and "steps 51/1000" in line
