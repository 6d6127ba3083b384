"""decide()'s failure guards (hotspare.orchestrator.failure_guards), no etcd: a job whose code
cannot start, a code error (fail at once, or retry on a budget), a crash loop (one seat
failing at the same step after every restore), too many failures in a window -- and the
failure history the controller writes for them.

The builders are test_decide's: a running job with rank r on node{r}, spares spare0..; a
test adds the history (``snap.failures``) and an agent's report, and checks the decision.
"""

from __future__ import annotations

import dataclasses

import pytest

from hotspare.orchestrator.decide import Action, Loss, LossKind, decide
from hotspare.orchestrator.failure_guards import new_failures
from hotspare.orchestrator.store.records import Failure, Report, Seat, World

from .test_decide import add_node, assert_swapped, make_node, snapshot_pending, snapshot_running

TB = ('Traceback (most recent call last):\n  File "/work/train.py", line 12, in train\n'
      '    raise ValueError("boom")\nValueError: boom')
SYNTAX = ('Traceback (most recent call last):\n  File "/work/train.py", line 3\n    def train(session\n'
          '                 ^\nSyntaxError: \'(\' was never closed')


def with_spec(snap, **fields):
    snap.spec = dataclasses.replace(snap.spec, **fields)
    return snap


def code_error(snap, rank: int, step: int = 5, tb: str = TB, kind: str = "error", t: float = 0.0) -> Report:
    """The agent's report that the worker of ``rank`` raised (or died, for another ``kind``)
    at ``step``."""
    seat = snap.world.seats[rank]
    rep = Report(node=seat.node, rank=rank, epoch=snap.world.epoch, kind=kind,
                 exit_code=1 if kind == "error" else None, signal=9 if kind == "signal" else None,
                 time=t, message=f"worker pid 42 {'raised ValueError: boom' if kind == 'error' else 'died'}",
                 step=step, traceback=tb if kind == "error" else "")
    snap.reports.append(rep)
    return rep


def history(*failures: tuple[int, str, int], t: float = 0.0) -> tuple[Failure, ...]:
    """Earlier handled failures: (sid, kind, step) each, on node{sid}."""
    return tuple(Failure(time=t, rank=sid, sid=sid, node=f"node{sid}", kind=kind, step=step, epoch=1)
                 for sid, kind, step in failures)


def assert_failed(d, *phrases: str) -> None:
    assert d.action is Action.FAIL, str(d)
    assert d.world is None and d.spares == (), "a failed job takes no spare"
    for phrase in phrases:
        assert phrase in str(d), f"{phrase!r} not in {str(d)!r}"


# -- the job's code cannot start ------------------------------------------------------------
def test_a_startup_error_fails_the_job_before_it_is_even_placed():
    snap = snapshot_pending()
    snap.reports.append(Report(node="node1", rank=-1, epoch=0, kind="error", exit_code=5,
                               message="worker pid 9 could not start the job", traceback=SYNTAX))
    d = decide(snap)
    assert_failed(d, "the entrypoint train.py:train cannot start on node node1: SyntaxError: '(' was never closed")
    assert d.error == SYNTAX, "the traceback is the evidence the job keeps"
    assert d.clear_reports == (("node1", -1),)


def test_a_startup_error_fails_a_running_job_and_names_every_node_it_hit():
    snap = snapshot_running()
    for node in ("spare0", "node2"):
        snap.reports.append(Report(node=node, rank=-1, epoch=0, kind="error", time=1.0 if node == "node2" else 2.0,
                                   traceback=TB))
    d = decide(snap)
    assert_failed(d, "cannot start on node node2 (nor on spare0): ValueError: boom")


def test_an_agent_that_could_not_start_fails_the_job_while_it_waits_for_its_first_world():
    snap = snapshot_pending()
    del snap.nodes["node0"]  # its agent died before it registered
    assert decide(snap).action is Action.WAIT  # without the report: waiting for the node, forever
    snap.reports.append(Report(node="node0", rank=-1, epoch=0, kind="agent", time=1.0,
                               message="FileNotFoundError: [Errno 2] No such file or directory", traceback=TB))
    d = decide(snap)
    assert_failed(d, "the agent of node node0 could not start: FileNotFoundError: [Errno 2] No such file",
                  f"hotspare logs {snap.job} --node node0")
    assert d.error == TB
    assert d.clear_reports == (("node0", -1),)


def test_once_the_job_runs_an_agent_that_could_not_start_does_not_fail_it():
    snap = snapshot_running()  # a late spare's agent failed: the job goes on without that spare
    snap.reports.append(Report(node="spare1", rank=-1, epoch=0, kind="agent", message="OSError: boom"))
    d = decide(snap)
    assert d.action is not Action.FAIL, str(d)
    assert ("spare1", -1) in d.clear_reports, "a report that does not matter any more is cleared"


def test_a_warm_worker_that_exits_otherwise_is_not_a_startup_error():
    snap = snapshot_running()
    snap.reports.append(Report(node="spare0", rank=-1, epoch=0, kind="exit"))
    assert decide(snap).action is Action.NONE, "only a code error of the job's module fails it"


# -- code errors ----------------------------------------------------------------------------
def test_a_code_error_fails_the_job_at_once_with_its_traceback_and_no_spare():
    snap = snapshot_running()
    code_error(snap, 1, step=5)
    d = decide(snap)
    assert_failed(d, "rank 1 on node1 raised at step 5: ValueError: boom (on_code_error: fail)",
                  "on_code_error: retry")
    assert d.error == TB
    assert [(lo.rank, lo.kind, lo.step) for lo in d.losses] == [(1, LossKind.ERROR, 5)]
    assert d.clear_reports == (("node1", 1),)


def test_a_code_error_before_the_first_step_says_so():
    snap = snapshot_running()
    code_error(snap, 0, step=-1)
    assert_failed(decide(snap), "rank 0 on node0 raised before its first step: ValueError: boom")


def test_code_errors_on_two_ranks_name_the_first_and_count_the_others():
    snap = snapshot_running()
    code_error(snap, 0)
    code_error(snap, 2)
    assert_failed(decide(snap), "rank 0 on node0 raised at step 5: ValueError: boom (and 1 more rank(s))")


@pytest.mark.parametrize("earlier", [0, 1])
def test_on_code_error_retry_swaps_the_rank_while_the_budget_lasts(earlier):
    snap = with_spec(snapshot_running(), on_code_error="retry", code_error_retries=2)
    snap.failures = history(*[(1, "error", 5)] * earlier)
    code_error(snap, 1, step=7 + earlier)  # another step each time: no crash loop
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare0"}, kind="error")
    assert d.losses[0].step == 7 + earlier and d.losses[0].traceback == TB


def test_on_code_error_retry_fails_once_the_retries_are_spent():
    snap = with_spec(snapshot_running(), on_code_error="retry", code_error_retries=2)
    snap.failures = history((1, "error", 5), (1, "signal", 6), (0, "error", 8))
    code_error(snap, 1, step=9)
    d = decide(snap)
    assert_failed(d, "rank 1 on node1 raised at step 9: ValueError: boom; that is code error 3, and "
                     "on_code_error: retry allows 2 retries (code_error_retries)")
    assert d.error == TB


def test_a_retried_code_error_goes_back_to_its_own_node_only_when_no_other_has_room():
    snap = with_spec(snapshot_running(spares=0), on_code_error="retry")
    code_error(snap, 1)
    assert_swapped(snap, decide(snap), {1: "node1"}, kind="error")
    add_node(snap, make_node("node9"))
    assert_swapped(snap, decide(snap), {1: "node9"}, kind="error")


def test_a_machine_fault_never_goes_back_to_the_node_that_just_failed_it():
    snap = snapshot_running(spares=0, policy="wait")
    code_error(snap, 1, kind="signal")
    d = decide(snap)
    assert d.action is Action.WAIT and "no spare left" in str(d)


# -- crash loops ----------------------------------------------------------------------------
def test_a_seat_failing_at_the_same_step_after_every_restore_is_a_crash_loop():
    snap = snapshot_running()
    snap.failures = history((1, "signal", 7), (1, "oom", 7))
    code_error(snap, 1, step=7, kind="signal")
    d = decide(snap)
    assert_failed(d, "rank 1 failed at step 7 3 times in a row, after each restore (crash loop): "
                     "worker pid 42 died", "crash_loop_limit (3)")
    assert [lo.rank for lo in d.losses] == [1]


@pytest.mark.parametrize(
    ("earlier", "step"),
    [
        ([(1, "signal", 7), (1, "signal", 6)], 7),  # the newest earlier failure was elsewhere
        ([(1, "signal", 7), (1, "signal", 7)], 8),  # this one is at another step
        ([(1, "signal", 7), (0, "signal", 7)], 7),  # another seat's failure
        ([(1, "signal", 7), (1, "fenced", 7)], 7),  # a fenced exit is no failure of its own
        ([(1, "signal", -1), (1, "signal", -1)], -1),  # no step known
    ],
    ids=["interrupted", "other-step", "other-seat", "fenced-not-counted", "no-step"],
)
def test_no_crash_loop_without_the_same_step_in_a_row(earlier, step):
    snap = snapshot_running()
    snap.failures = history(*earlier)
    code_error(snap, 1, step=step, kind="signal")
    assert_swapped(snap, decide(snap), {1: "spare0"}, kind="signal")


def test_a_crash_loop_follows_the_seat_not_its_rank_number():
    snap = snapshot_running()
    w = snap.world
    snap.world = World(epoch=w.epoch, seats=(w.seats[0], Seat(w.seats[1].node, w.seats[1].incarnation, 1, sid=4),
                                             w.seats[2]))
    snap.failures = history((4, "signal", 3), (4, "hang", 3))  # as rank 2, before a shrink renumbered it
    code_error(snap, 1, step=3, kind="signal")
    assert_failed(decide(snap), "rank 1 failed at step 3 3 times in a row")


def test_a_retried_code_error_that_repeats_is_a_crash_loop_before_its_budget_is_spent():
    snap = with_spec(snapshot_running(), on_code_error="retry", code_error_retries=5, crash_loop_limit=2)
    snap.failures = history((1, "error", 5))
    code_error(snap, 1, step=5)
    assert_failed(decide(snap), "rank 1 failed at step 5 2 times in a row, after each restore (crash loop)")


# -- the failure rate -----------------------------------------------------------------------
def test_more_than_max_failures_in_the_window_fail_the_job_and_name_the_fields():
    snap = with_spec(snapshot_running(), max_failures=3, failure_window=60.0)
    snap.now = 1000.0
    snap.failures = (history((0, "signal", 1), t=100.0)  # long ago: outside the window
                     + history((0, "signal", 2), (2, "hang", 3), (0, "exit", 4), t=990.0))
    code_error(snap, 1, step=9, kind="signal", t=999.0)
    d = decide(snap)
    assert_failed(d, "4 failures within 60s, more than max_failures=3 in failure_window=60s",
                  "the latest: rank 1 on node1: worker pid 42 died")


def test_failures_up_to_max_failures_are_recovered():
    snap = with_spec(snapshot_running(), max_failures=3, failure_window=60.0)
    snap.now = 1000.0
    snap.failures = history((0, "signal", 2), (2, "hang", 3), t=990.0) + history((0, "exit", 4), t=100.0)
    code_error(snap, 1, step=9, kind="signal", t=999.0)
    assert_swapped(snap, decide(snap), {1: "spare0"})


def test_a_lost_node_counts_towards_max_failures():
    snap = with_spec(snapshot_running(), max_failures=1)
    snap.failures = history((0, "node-loss", -1))
    del snap.nodes["node1"]
    assert_failed(decide(snap), "2 failures within 3600s, more than max_failures=1")


# -- the history ----------------------------------------------------------------------------
def test_each_handled_loss_becomes_a_failure_record_of_its_seat():
    snap = snapshot_running(epoch=4)
    snap.now = 50.0
    w = snap.world
    snap.world = World(epoch=4, seats=(w.seats[0], w.seats[1], Seat(w.seats[2].node, w.seats[2].incarnation, 1, sid=7)))
    losses = [Loss(2, "node2", LossKind.ERROR, "raised", detected=42.0, step=5, traceback=TB),
              Loss(0, "node0", LossKind.NODE_LOSS, "lost its lease")]
    assert new_failures(snap, snap.world, losses) == (
        Failure(time=42.0, rank=2, sid=7, node="node2", kind="error", step=5, epoch=4),
        Failure(time=50.0, rank=0, sid=0, node="node0", kind="node-loss", step=-1, epoch=4),
    )


def test_a_report_carries_its_step_and_traceback_into_the_loss():
    snap = with_spec(snapshot_running(), on_code_error="retry")
    code_error(snap, 2, step=11)
    [lo] = decide(snap).losses
    assert (lo.kind, lo.step, lo.traceback, lo.detail) == (LossKind.ERROR, 11, TB, "worker pid 42 raised ValueError: boom")
