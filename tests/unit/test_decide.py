"""Unit tests for hotspare.orchestrator.decide: every branch of the controller policy, no etcd.

Patroni-style: small builders return a :class:`JobSnapshot` (a JobSpec, nodes ``node0..``
with role "active" and ``spare0..`` with role "spare", a world at some epoch), a test edits
it the way the cluster would (a lease expires, an agent reports), calls ``decide`` and
checks the action, the new world and the sentence the controller logs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotspare.orchestrator.decide import (
    Action,
    Decision,
    Loss,
    LossKind,
    _free_capacity,
    decide,
    find_losses,
)
from hotspare.orchestrator.spec import JobSpec
from hotspare.orchestrator.store.job import JobSnapshot
from hotspare.orchestrator.store.records import JobState, Node, Report, Seat, World

STEPS = 100


# -- builders ---------------------------------------------------------------------------
def make_spec(
    ranks: int = 3,
    spares: int = 1,
    rpn: int = 1,
    policy: str | None = "wait",
    min_ranks: int = 1,
    steps: int = STEPS,
) -> JobSpec:
    spec = {
        "name": "job",
        "entrypoint": "train.py:train",
        "ranks": ranks,
        "steps": steps,
        "spares": spares,
        "ranks_per_node": rpn,
        "min_ranks": min_ranks,
    }
    if policy is not None:  # None: leave the key out, to see the default
        spec["on_no_spare"] = policy
    return JobSpec.from_dict(spec)


def make_node(
    name: str, role: str = "active", slots: int = 1, warm: int = 0, incarnation: str = ""
) -> Node:
    return Node(
        name=name, incarnation=incarnation or f"{name}-inc1", role=role, slots=slots, warm=warm
    )


def node_set(active: int, spare: int, slots: int = 1, spare_slots: int | None = None) -> dict:
    nodes = [make_node(f"node{i}", "active", slots) for i in range(active)]
    nodes += [
        make_node(f"spare{i}", "spare", slots if spare_slots is None else spare_slots)
        for i in range(spare)
    ]
    return {n.name: n for n in nodes}


def snapshot_pending(
    ranks: int = 3,
    spares: int = 1,
    rpn: int = 1,
    policy: str = "wait",
    active: int | None = None,
    spare_nodes: int | None = None,
    slots: int | None = None,
) -> JobSnapshot:
    """A submitted job with no world yet; by default every expected node is registered."""
    needed = math.ceil(ranks / rpn)
    return JobSnapshot(
        job="job",
        revision=1,
        spec=make_spec(ranks, spares, rpn, policy),
        state=JobState.PENDING,
        nodes=node_set(
            needed if active is None else active,
            spares if spare_nodes is None else spare_nodes,
            rpn if slots is None else slots,
        ),
    )


def snapshot_running(
    ranks: int = 3,
    spares: int = 1,
    rpn: int = 1,
    policy: str | None = "wait",
    min_ranks: int = 1,
    epoch: int = 1,
) -> JobSnapshot:
    """A running job at ``epoch``: rank r on node{r // rpn}, seated since epoch 1."""
    needed = math.ceil(ranks / rpn)
    nodes = node_set(needed, spares, rpn)
    seats = tuple(
        Seat(f"node{r // rpn}", nodes[f"node{r // rpn}"].incarnation, 1) for r in range(ranks)
    )
    return JobSnapshot(
        job="job",
        revision=10,
        spec=make_spec(ranks, spares, rpn, policy, min_ranks),
        state=JobState.RUNNING,
        epoch=epoch,
        epoch_mod=5,
        world=World(epoch=epoch, seats=seats, reason="initial placement"),
        nodes=nodes,
    )


def report(
    snap: JobSnapshot,
    rank: int,
    kind: str = "exit",
    node: str | None = None,
    epoch: int | None = None,
    exit_code: int | None = 1,
    signal: int | None = None,
    message: str = "",
    time: float = 0.0,
) -> Report:
    """Add an agent's report that the worker of ``rank`` is gone (default: where it sits)."""
    assert snap.world is not None
    rep = Report(
        node=node or snap.world.seats[rank].node,
        rank=rank,
        epoch=snap.world.epoch if epoch is None else epoch,
        kind=kind,
        exit_code=exit_code,
        signal=signal,
        time=time,
        message=message,
    )
    snap.reports.append(rep)
    return rep


def lose(snap: JobSnapshot, *names: str) -> None:
    """The nodes' leases expire: their keys vanish."""
    for name in names:
        del snap.nodes[name]


def restart(snap: JobSnapshot, name: str) -> Node:
    """The node's agent re-registers under the same name with a new incarnation."""
    old = snap.nodes[name]
    new = Node(old.name, old.incarnation + "-again", old.role, old.slots, warm=old.warm)
    snap.nodes[name] = new
    return new


def add_node(snap: JobSnapshot, node: Node) -> Node:
    snap.nodes[node.name] = node
    return node


def mark_done(snap: JobSnapshot, rank: int, epoch: int | None = None) -> None:
    assert snap.world is not None
    snap.done[rank] = {"epoch": snap.world.epoch if epoch is None else epoch, "step": STEPS}


def assert_slots_respected(snap: JobSnapshot, world: World) -> None:
    per_node = Counter(s.node for s in world.seats)
    for name, count in per_node.items():
        assert name in snap.nodes, f"{name} is seated but not live"
        assert count <= snap.nodes[name].slots, f"{name}: {count} ranks > {snap.nodes[name].slots}"


def assert_swapped(
    snap: JobSnapshot, d: Decision, moves: dict[int, str], kind: str | None = None
) -> World:
    """The decision is a swap of exactly ``moves`` (rank -> node), everything else kept."""
    old = snap.world
    assert old is not None
    assert d.action == "swap", str(d)
    assert d.changes_world
    assert d.final_state is None
    new = d.world
    assert new is not None
    assert new.epoch == old.epoch + 1
    assert new.size == old.size
    assert new.lost == tuple(sorted(moves))
    assert new.shrunk_from == 0
    for r, seat in enumerate(new.seats):
        if r in moves:
            chosen = snap.nodes[moves[r]]
            assert seat == Seat(chosen.name, chosen.incarnation, new.epoch)
        else:
            assert seat == old.seats[r]
    assert [lo.rank for lo in d.losses] == sorted(moves)
    assert list(d.spares) == [moves[r] for r in sorted(moves)]
    if kind is not None:
        assert {lo.kind for lo in d.losses} == {kind}
    text = str(d)
    assert f"epoch {new.epoch}" in text
    for r, name in moves.items():
        assert f"rank {r} -> {name}" in text
    assert_slots_respected(snap, new)
    return new


# -- guards -----------------------------------------------------------------------------
def test_no_spec_means_nothing_to_do():
    d = decide(JobSnapshot(job="ghost", revision=1))
    assert d.action == "none"
    assert d.world is None and not d.changes_world
    assert "ghost" in str(d) and "no spec" in str(d)
    assert d.final_state is None


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_terminal_job_is_left_alone_even_with_a_loss_or_cancel(state):
    snap = snapshot_running()
    snap.state = state
    snap.cancel = True
    lose(snap, "node1")
    report(snap, 0)
    d = decide(snap)
    assert d.action == "none"
    assert d.world is None and d.clear_reports == ()
    assert state.value in str(d) and "nothing to do" in str(d)


@pytest.mark.parametrize("state", [JobState.PENDING, JobState.RUNNING])
def test_non_terminal_states_are_not_terminal(state):
    assert not state.terminal


def test_cancel_request_cancels_a_running_job_before_handling_losses():
    snap = snapshot_running()
    snap.cancel = True
    lose(snap, "node1")
    d = decide(snap)
    assert d.action == "cancel"
    assert d.final_state is JobState.CANCELLED
    assert d.world is None and d.losses == ()
    assert "cancelled on request" in str(d)


def test_cancel_request_cancels_a_job_not_yet_placed():
    snap = snapshot_pending(active=0, spare_nodes=0)
    snap.cancel = True
    d = decide(snap)
    assert d.action == "cancel"
    assert d.final_state is JobState.CANCELLED


# -- initial placement ------------------------------------------------------------------
def test_placement_waits_with_no_node_registered():
    d = decide(snapshot_pending(ranks=3, spares=1, active=0, spare_nodes=0))
    assert d.action == "wait"
    assert d.world is None
    assert "waiting for nodes" in str(d)
    assert "0 of 3 active nodes" in str(d)
    assert "(0 in all, 4 expected)" in str(d)


def test_placement_waits_until_enough_active_nodes_and_says_how_many():
    d = decide(snapshot_pending(ranks=3, spares=1, active=2, spare_nodes=0))
    assert d.action == "wait"
    assert d.world is None
    assert "2 of 3 active nodes registered" in str(d)
    assert "(2 in all, 4 expected)" in str(d)


def test_placement_waits_for_actives_while_expected_nodes_are_missing():
    # 2 active + 1 spare = 3 nodes: enough to hold 3 ranks, but not all 4 expected are here,
    # so it must not eat the spare yet.
    d = decide(snapshot_pending(ranks=3, spares=1, active=2, spare_nodes=1))
    assert d.action == "wait"
    assert d.world is None
    assert "2 of 3 active nodes registered (3 in all, 4 expected)" in str(d)


def test_placement_waits_for_active_nodes_counted_in_nodes_of_rpn():
    # ranks_per_node=2: 5 ranks need ceil(5/2)=3 nodes.
    d = decide(snapshot_pending(ranks=5, rpn=2, spares=0, active=2, spare_nodes=0))
    assert d.action == "wait"
    assert "2 of 3 active nodes" in str(d)
    assert "3 expected" in str(d)


def test_placement_places_on_active_nodes_and_keeps_spare_nodes_idle():
    snap = snapshot_pending(ranks=3, spares=1)
    d = decide(snap)
    assert d.action == "place"
    assert d.changes_world and d.final_state is None
    w = d.world
    assert w is not None
    assert w.epoch == 1
    assert w.reason == "initial placement"
    assert w.lost == () and w.shrunk_from == 0
    assert w.seats == tuple(
        Seat(f"node{r}", snap.nodes[f"node{r}"].incarnation, 1) for r in range(3)
    )
    assert str(d) == "placing 3 ranks on node0, node1, node2; spares: spare0"


def test_placement_does_not_need_spares_to_be_registered_once_actives_are_enough():
    snap = snapshot_pending(ranks=3, spares=2, spare_nodes=0)
    d = decide(snap)
    assert d.action == "place"
    assert [s.node for s in d.world.seats] == ["node0", "node1", "node2"]
    assert "no spare node registered" in str(d)


def test_placement_with_no_spares_says_no_spare_node_registered():
    d = decide(snapshot_pending(ranks=2, spares=0))
    assert d.action == "place"
    assert str(d) == "placing 2 ranks on node0, node1; no spare node registered"


def test_placement_of_one_rank_is_singular():
    d = decide(snapshot_pending(ranks=1, spares=0))
    assert str(d).startswith("placing 1 rank on node0")


def test_placement_leaves_extra_active_nodes_as_spares():
    snap = snapshot_pending(ranks=2, spares=0, active=3, spare_nodes=1)
    d = decide(snap)
    assert d.action == "place"
    assert [s.node for s in d.world.seats] == ["node0", "node1"]
    assert "spares: node2, spare0" in str(d)


def test_placement_uses_spare_nodes_only_when_all_expected_nodes_registered():
    # 3 ranks + 1 spare expected = 4 nodes; only 2 are active, but 4 registered in all.
    snap = snapshot_pending(ranks=3, spares=1, active=2, spare_nodes=2)
    d = decide(snap)
    assert d.action == "place"
    seats = d.world.seats
    assert [s.node for s in seats] == ["node0", "node1", "spare0"]
    assert seats[2] == Seat("spare0", snap.nodes["spare0"].incarnation, 1)
    assert "placing 3 ranks on node0, node1, spare0; spares: spare1" in str(d)


def test_placement_puts_active_nodes_first_whatever_their_names():
    snap = snapshot_pending(ranks=2, spares=1, active=0, spare_nodes=0)
    for n in [make_node("a-spare", "spare"), make_node("z-active"), make_node("b-active")]:
        add_node(snap, n)
    d = decide(snap)
    assert d.action == "place"
    assert [s.node for s in d.world.seats] == ["b-active", "z-active"]
    assert "spares: a-spare" in str(d)


def test_placement_packs_ranks_per_node():
    snap = snapshot_pending(ranks=4, rpn=2, spares=1)
    d = decide(snap)
    assert d.action == "place"
    assert [s.node for s in d.world.seats] == ["node0", "node0", "node1", "node1"]
    assert all(s.since == 1 for s in d.world.seats)
    assert "placing 4 ranks on node0, node1; spares: spare0" in str(d)


def test_placement_packs_an_uneven_last_node():
    d = decide(snapshot_pending(ranks=3, rpn=2, spares=0))
    assert d.action == "place"
    assert [s.node for s in d.world.seats] == ["node0", "node0", "node1"]


def test_placement_never_packs_more_than_ranks_per_node_on_a_big_node():
    snap = snapshot_pending(ranks=4, rpn=2, spares=0, slots=8)
    d = decide(snap)
    assert d.action == "place"
    assert Counter(s.node for s in d.world.seats) == {"node0": 2, "node1": 2}


def test_placement_waits_for_capacity_when_nodes_have_too_few_slots():
    # Two nodes are enough by count (4 ranks / 2 per node) but each offers one slot.
    d = decide(snapshot_pending(ranks=4, rpn=2, spares=0, slots=1))
    assert d.action == "wait"
    assert d.world is None
    assert "waiting for capacity: 2 of 4 rank slots" in str(d)


# -- healthy running job, success -------------------------------------------------------
def test_healthy_world_needs_nothing():
    d = decide(snapshot_running(ranks=3))
    assert d.action == "none"
    assert d.world is None and d.losses == () and d.clear_reports == ()
    assert str(d) == "epoch 1: 3 ranks healthy"


def test_healthy_world_sentence_names_the_current_epoch():
    d = decide(snapshot_running(ranks=1, spares=0, epoch=7))
    assert str(d) == "epoch 7: 1 rank healthy"


def test_done_mark_succeeds_the_job():
    snap = snapshot_running(ranks=3)
    mark_done(snap, 0)
    d = decide(snap)
    assert d.action == "succeed"
    assert d.final_state is JobState.SUCCEEDED
    assert d.world is None
    assert str(d) == f"all 3 ranks finished {STEPS} steps"


def test_done_mark_succeeds_even_if_another_rank_died_after_the_final_barrier():
    snap = snapshot_running(ranks=3)
    mark_done(snap, 2)
    report(snap, 1)
    lose(snap, "node0")
    d = decide(snap)
    assert d.action == "succeed"
    assert d.losses == ()
    assert d.clear_reports == (("node1", 1),)


def test_done_mark_from_an_earlier_world_still_counts_for_a_seat_kept_since_then():
    snap = snapshot_running(ranks=3, epoch=3)  # seats since 1
    mark_done(snap, 0, epoch=2)
    assert decide(snap).action == "succeed"


def test_done_mark_older_than_the_seat_is_ignored():
    snap = snapshot_running(ranks=3, epoch=2)
    w = snap.world
    snap.world = World(2, (w.seats[0], Seat("spare0", "spare0-inc1", 2), w.seats[2]))
    lose(snap, "node1")
    mark_done(snap, 1, epoch=1)  # left by the worker that rank 1 had before epoch 2
    d = decide(snap)
    assert d.action == "none"
    assert str(d) == "epoch 2: 3 ranks healthy"


def test_finished_rank_is_not_reported_lost():
    snap = snapshot_running(ranks=2)
    mark_done(snap, 0)
    lose(snap, "node0")
    losses, stale = find_losses(snap, snap.world)
    assert losses == [] and stale == []


# -- worker exit ------------------------------------------------------------------------
def test_worker_exit_swaps_in_the_spare_node():
    snap = snapshot_running(ranks=3, spares=1)
    report(snap, 1, exit_code=3, time=12.5)
    d = decide(snap)
    new = assert_swapped(snap, d, {1: "spare0"}, kind="exit")
    assert new.epoch == 2
    assert new.reason == "rank 1 on node1: worker died (exit code 3)"
    assert d.losses == (Loss(1, "node1", "exit", "worker died (exit code 3)", 12.5),)
    assert d.clear_reports == (("node1", 1),)
    text = str(d)
    assert "rank 1 on node1" in text and "exit code 3" in text
    assert "swapping in spare (rank 1 -> spare0) at epoch 2" in text


def test_worker_killed_by_signal_says_which_signal():
    snap = snapshot_running()
    report(snap, 0, exit_code=None, signal=9)
    d = decide(snap)
    assert d.action == "swap"
    assert d.losses[0].detail == "worker died (signal 9)"
    assert "signal 9" in str(d)


def test_a_fatal_report_fails_the_job_with_its_reason_even_with_spares_left():
    snap = snapshot_running(ranks=3, spares=2)
    lose(snap, "node1")
    report(snap, 2, kind="fatal", exit_code=4,
           message="worker pid 7 cannot go on: no usable persisted checkpoint in /ckpt")
    d = decide(snap)
    assert d.action == "fail" and d.final_state == JobState.FAILED and not d.changes_world, str(d)
    assert "rank 2 on node2: worker pid 7 cannot go on: no usable persisted checkpoint in /ckpt" in str(d)
    assert "rank 1" not in str(d)  # the node loss is not the reason
    assert {lo.rank for lo in d.losses} == {1, 2} and ("node2", 2) in d.clear_reports


def test_report_message_is_the_loss_detail():
    snap = snapshot_running()
    report(snap, 2, message="CUDA error: an illegal memory access")
    d = decide(snap)
    assert d.losses[0].detail == "CUDA error: an illegal memory access"
    assert "rank 2 on node2: CUDA error" in str(d)


def test_worker_exit_never_moves_the_rank_back_to_its_failed_node():
    # node1 is alive and has a free slot, but its worker just died: it is not a candidate.
    snap = snapshot_running(ranks=3, spares=0, policy="fail")
    add_node(snap, make_node("node1", slots=2, incarnation=snap.nodes["node1"].incarnation))
    report(snap, 1)
    d = decide(snap)
    assert d.action == "fail"
    assert "no spare left (0 free slot(s) for 1 lost rank(s))" in str(d)


def test_worker_exit_on_a_node_with_ranks_per_node_picks_another_node():
    snap = snapshot_running(ranks=4, rpn=2, spares=1)
    report(snap, 1)
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare0"}, kind="exit")
    assert "node0" not in d.spares


def test_report_from_before_the_seat_since_is_stale_and_cleared():
    snap = snapshot_running(ranks=3, epoch=2)
    w = snap.world
    node1 = restart(snap, "node1")
    snap.world = World(2, (w.seats[0], Seat("node1", node1.incarnation, 2), w.seats[2]))
    report(snap, 1, epoch=1)  # the worker rank 1 had in epoch 1
    d = decide(snap)
    assert d.action == "none"
    assert d.world is None and d.losses == ()
    assert d.clear_reports == (("node1", 1),)
    assert "healthy" in str(d)


def test_report_for_a_rank_seated_elsewhere_is_stale_and_cleared():
    snap = snapshot_running(ranks=3, epoch=2)
    w = snap.world
    snap.world = World(2, (w.seats[0], Seat("spare0", "spare0-inc1", 2), w.seats[2]))
    report(snap, 1, node="node1", epoch=2)
    d = decide(snap)
    assert d.action == "none"
    assert d.clear_reports == (("node1", 1),)
    assert str(d) == "epoch 2: 3 ranks healthy"


def test_report_for_a_rank_outside_the_world_is_stale_and_cleared():
    snap = snapshot_running(ranks=3)
    report(snap, 7, node="node0")
    report(snap, -1, node="node0")
    d = decide(snap)
    assert d.action == "none"
    assert d.clear_reports == (("node0", 7), ("node0", -1))


def test_stale_reports_are_cleared_together_with_a_handled_loss():
    snap = snapshot_running(ranks=3)
    report(snap, 0, node="node2")  # rank 0 is not on node2: stale
    report(snap, 1)
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare0"})
    assert set(d.clear_reports) == {("node2", 0), ("node1", 1)}


def test_report_from_a_later_epoch_than_the_seat_is_a_loss():
    snap = snapshot_running(ranks=3, epoch=4)  # seats since 1, report from epoch 4
    report(snap, 0)
    d = decide(snap)
    new = assert_swapped(snap, d, {0: "spare0"}, kind="exit")
    assert new.epoch == 5


# -- node loss --------------------------------------------------------------------------
def test_node_lease_lost_swaps_with_kind_node_loss():
    snap = snapshot_running(ranks=3)
    lose(snap, "node2")
    d = decide(snap)
    assert_swapped(snap, d, {2: "spare0"}, kind="node-loss")
    assert d.losses == (Loss(2, "node2", "node-loss", "node node2 lost its lease", 0.0),)
    assert d.clear_reports == (("node2", 2),)  # nothing was there; clearing is harmless
    assert "node node2 lost its lease" in str(d)


def test_agent_restart_under_the_same_name_is_a_node_loss():
    snap = snapshot_running(ranks=3)
    restart(snap, "node1")
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare0"}, kind="node-loss")
    assert d.losses[0].detail == "agent on node1 restarted"
    assert "agent on node1 restarted" in str(d)


def test_agent_restart_does_not_reuse_the_restarted_node():
    snap = snapshot_running(ranks=3, spares=0, policy="fail")
    restart(snap, "node1")  # alive, all its slots free, but it was the failed node
    d = decide(snap)
    assert d.action == "fail"


def test_node_loss_and_its_report_make_one_loss_and_the_report_is_cleared():
    snap = snapshot_running(ranks=3)
    report(snap, 1, kind="hang")
    lose(snap, "node1")
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare0"}, kind="node-loss")
    assert len(d.losses) == 1
    assert d.clear_reports == (("node1", 1),)


# -- hang -------------------------------------------------------------------------------
def test_hang_report_swaps_with_kind_hang():
    snap = snapshot_running(ranks=3)
    report(snap, 0, kind="hang", exit_code=None, time=99.0)
    d = decide(snap)
    assert_swapped(snap, d, {0: "spare0"}, kind="hang")
    assert d.losses == (Loss(0, "node0", "hang", "worker hung (no heartbeat), killed", 99.0),)
    assert "rank 0 on node0: worker hung" in str(d)
    assert d.clear_reports == (("node0", 0),)


# -- choosing the replacement -----------------------------------------------------------
def test_prefers_a_spare_role_node_over_an_active_node_with_a_free_slot():
    snap = snapshot_running(ranks=3, spares=1)
    add_node(snap, make_node("node3", warm=1, slots=4))  # active, unseated, warm, roomy
    lose(snap, "node1")
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare0"})


def test_prefers_a_warm_spare_over_a_cold_one():
    snap = snapshot_running(ranks=3, spares=0)
    add_node(snap, make_node("spare0", "spare"))
    add_node(snap, make_node("spare1", "spare", warm=1))
    lose(snap, "node0")
    d = decide(snap)
    assert_swapped(snap, d, {0: "spare1"})


def test_prefers_a_warm_active_node_over_a_cold_active_node():
    snap = snapshot_running(ranks=3, spares=0)
    add_node(snap, make_node("node3"))
    add_node(snap, make_node("node4", warm=2))
    lose(snap, "node0")
    assert_swapped(snap, decide(snap), {0: "node4"})


def test_among_equal_spares_prefers_the_emptier_then_the_first_by_name():
    snap = snapshot_running(ranks=3, spares=0)
    add_node(snap, make_node("spare0", "spare", slots=1))
    add_node(snap, make_node("spare1", "spare", slots=2))
    add_node(snap, make_node("spare2", "spare", slots=2))
    lose(snap, "node0")
    assert_swapped(snap, decide(snap), {0: "spare1"})


def test_falls_back_to_an_active_node_with_a_free_slot_without_a_spare_node():
    snap = snapshot_running(ranks=3, spares=0)
    add_node(snap, make_node("node3"))  # registered active node holding no rank
    lose(snap, "node1")
    d = decide(snap)
    assert_swapped(snap, d, {1: "node3"})


def test_falls_back_to_the_free_slot_of_a_partly_used_active_node():
    snap = snapshot_running(ranks=3, rpn=2, spares=0)  # node0: ranks 0,1; node1: rank 2
    report(snap, 0)
    d = decide(snap)
    new = assert_swapped(snap, d, {0: "node1"})
    assert Counter(s.node for s in new.seats) == {"node0": 1, "node1": 2}


def test_a_spare_already_holding_a_rank_offers_only_its_free_slots():
    snap = snapshot_running(ranks=3, spares=0, epoch=2, policy="fail")
    spare = add_node(snap, make_node("spare0", "spare", slots=1))
    w = snap.world
    snap.world = World(2, (w.seats[0], Seat("spare0", spare.incarnation, 2), w.seats[2]))
    lose(snap, "node1")
    lose(snap, "node2")
    d = decide(snap)  # rank 2 lost; spare0's only slot already holds rank 1
    assert d.action == "fail"
    assert [lo.rank for lo in d.losses] == [2]


def test_two_ranks_lost_on_one_node_are_both_swapped_to_one_spare_with_two_slots():
    snap = snapshot_running(ranks=4, rpn=2, spares=1)
    lose(snap, "node0")
    d = decide(snap)
    new = assert_swapped(snap, d, {0: "spare0", 1: "spare0"}, kind="node-loss")
    assert Counter(s.node for s in new.seats) == {"spare0": 2, "node1": 2}
    assert new.lost == (0, 1)


def test_two_ranks_lost_on_one_node_go_to_distinct_one_slot_spares():
    snap = snapshot_running(ranks=4, rpn=2, spares=0)
    add_node(snap, make_node("spare0", "spare", slots=1))
    add_node(snap, make_node("spare1", "spare", slots=1))
    report(snap, 0)
    report(snap, 1)
    d = decide(snap)
    assert_swapped(snap, d, {0: "spare0", 1: "spare1"}, kind="exit")
    assert set(d.clear_reports) == {("node0", 0), ("node0", 1)}


def test_two_lost_ranks_spill_from_a_spare_onto_an_active_free_slot():
    snap = snapshot_running(ranks=4, rpn=2, spares=0)
    add_node(snap, make_node("spare0", "spare", slots=1))
    add_node(snap, make_node("node2", slots=2))
    lose(snap, "node0")
    d = decide(snap)
    assert_swapped(snap, d, {0: "spare0", 1: "node2"})


def test_losses_on_two_nodes_are_handled_in_one_swap():
    snap = snapshot_running(ranks=4, spares=2)
    lose(snap, "node0")
    report(snap, 3, kind="hang")
    d = decide(snap)
    assert_swapped(snap, d, {0: "spare0", 3: "spare1"})
    assert [lo.kind for lo in d.losses] == ["node-loss", "hang"]
    assert "rank 0 on node0: node node0 lost its lease; rank 3 on node3: worker hung" in str(d)


# -- no spare left ----------------------------------------------------------------------
def test_no_spare_with_on_no_spare_fail_fails_and_says_how_to_fix_it():
    snap = snapshot_running(ranks=3, spares=0, policy="fail")
    report(snap, 1)
    d = decide(snap)
    assert d.action == "fail"
    assert d.final_state is JobState.FAILED
    assert d.world is None and not d.changes_world
    assert [lo.rank for lo in d.losses] == [1]
    assert d.clear_reports == (("node1", 1),)
    text = str(d)
    assert "no spare left" in text
    assert "on_no_spare=fail" in text
    assert "spares" in text and "Add spare nodes" in text
    assert "on_no_spare: wait|shrink" in text


def test_too_few_free_slots_for_all_losses_is_no_spare():
    snap = snapshot_running(ranks=3, spares=1, policy="fail")
    lose(snap, "node0", "node1")
    d = decide(snap)
    assert d.action == "fail"
    assert "1 free slot(s) for 2 lost rank(s)" in str(d)


def test_no_spare_with_on_no_spare_wait_waits_and_keeps_the_report():
    snap = snapshot_running(ranks=3, spares=0, policy="wait")
    report(snap, 1)
    lose(snap, "node1")  # and its node is gone: no node has room
    d = decide(snap)
    assert d.action == "wait"
    assert d.world is None and d.final_state is None
    assert [lo.rank for lo in d.losses] == [1]
    assert d.clear_reports == ()  # the loss must still be seen once a spare joins
    assert "no spare left" in str(d)
    assert "waiting for a spare node to join (on_no_spare=wait)" in str(d)


def test_on_no_spare_defaults_to_wait():
    snap = snapshot_running(ranks=3, spares=0, policy=None)
    lose(snap, "node2")
    assert decide(snap).action == "wait"


def test_a_waiting_job_swaps_once_a_spare_joins():
    snap = snapshot_running(ranks=3, spares=0, policy="wait")
    lose(snap, "node1")
    assert decide(snap).action == "wait"
    add_node(snap, make_node("spare0", "spare"))
    assert_swapped(snap, decide(snap), {1: "spare0"})


def test_with_no_spare_and_on_no_spare_wait_a_node_whose_agent_registered_again_takes_its_rank_back():
    """Its lease expired (etcd slow under load, a network blip) and its agent registered
    again: with spares: 0, waiting for another node to join could be forever, so the node
    that is back gets its rank again. The failure guards bound a node that keeps flapping."""
    snap = snapshot_running(ranks=3, spares=0, policy="wait")
    restart(snap, "node1")
    d = decide(snap)
    new = assert_swapped(snap, d, {1: "node1"}, kind="node-loss")
    assert new.seats[1].incarnation == snap.nodes["node1"].incarnation
    assert ("restarting on the same node(s), its agent registered again and no other node has room "
            "(rank 1 -> node1)") in str(d)


def test_a_node_back_but_a_crash_on_another_node_waits_for_a_spare_for_both():
    snap = snapshot_running(ranks=3, spares=0, policy="wait")
    restart(snap, "node1")
    report(snap, 2, kind="exit")  # a machine fault: node2 is not given rank 2 back
    assert decide(snap).action == "wait"


def test_a_lost_node_that_comes_back_takes_its_rank_back_when_no_spare_joined():
    snap = snapshot_running(ranks=3, spares=0, policy="wait")
    lose(snap, "node1")
    assert decide(snap).action == "wait"
    add_node(snap, make_node("node1", incarnation="node1-inc2"))  # re-registered: a new incarnation
    assert_swapped(snap, decide(snap), {1: "node1"}, kind="node-loss")


def test_no_spare_with_on_no_spare_shrink_drops_the_lost_rank():
    snap = snapshot_running(ranks=4, spares=0, policy="shrink", min_ranks=2)
    old = snap.world
    report(snap, 1)
    d = decide(snap)
    assert d.action == "shrink"
    assert d.changes_world and d.final_state is None
    new = d.world
    assert new.epoch == old.epoch + 1
    # survivors in order; those renumbered hold their new rank from the new epoch on
    assert [(x.node, x.incarnation) for x in new.seats] == [
        (x.node, x.incarnation) for x in (old.seats[0], old.seats[2], old.seats[3])
    ]
    assert [x.since for x in new.seats] == [old.seats[0].since, new.epoch, new.epoch]
    assert new.shrunk_from == 4
    assert new.lost == (1,)
    assert new.reason == "rank 1 on node1: worker died (exit code 1)"
    assert d.spares == ()
    assert d.clear_reports == (("node1", 1),)
    assert "no spare left" in str(d)
    assert "shrinking to 3 ranks at epoch 2" in str(d)


def test_shrink_drops_every_rank_of_a_lost_node():
    snap = snapshot_running(ranks=6, rpn=2, spares=0, policy="shrink", min_ranks=1)
    old = snap.world
    lose(snap, "node1")
    d = decide(snap)
    assert d.action == "shrink"
    assert [(x.node, x.since) for x in d.world.seats] == [
        (old.seats[0].node, old.seats[0].since),
        (old.seats[1].node, old.seats[1].since),
        (old.seats[4].node, d.world.epoch),  # renumbered 4 -> 2
        (old.seats[5].node, d.world.epoch),  # renumbered 5 -> 3
    ]
    assert d.world.lost == (2, 3)
    assert d.world.shrunk_from == 6


def test_shrink_to_exactly_min_ranks_is_allowed():
    snap = snapshot_running(ranks=3, spares=0, policy="shrink", min_ranks=2)
    lose(snap, "node0")
    d = decide(snap)
    assert d.action == "shrink"
    assert d.world.size == 2
    assert "shrinking to 2 ranks" in str(d)


def test_shrink_below_min_ranks_fails():
    snap = snapshot_running(ranks=3, spares=0, policy="shrink", min_ranks=3)
    lose(snap, "node0")
    d = decide(snap)
    assert d.action == "fail"
    assert d.final_state is JobState.FAILED
    assert d.world is None
    assert d.clear_reports == (("node0", 0),)
    assert "shrinking would leave 2 rank(s) < min_ranks=3" in str(d)


def test_shrink_never_leaves_an_empty_world_by_default():
    snap = snapshot_running(ranks=1, spares=0, policy="shrink")
    snap.spec = dataclasses.replace(snap.spec, min_ranks=JobSpec.min_ranks)  # the default
    lose(snap, "node0")
    d = decide(snap)
    assert d.action == "fail"
    assert "min_ranks=1" in str(d)


def test_shrink_is_only_the_last_resort_when_a_spare_exists():
    snap = snapshot_running(ranks=3, spares=1, policy="shrink")
    lose(snap, "node0")
    assert_swapped(snap, decide(snap), {0: "spare0"})


def test_report_from_before_a_shrink_does_not_hit_the_survivor_renumbered_into_its_rank():
    # epoch 1: node0 holds ranks 0,1; node1 holds ranks 2,3. Rank 0 dies: shrink to
    # [node0 (was 1), node1 (was 2), node1 (was 3)] at epoch 2.
    snap = snapshot_running(ranks=4, rpn=2, spares=0, policy="shrink", min_ranks=1)
    report(snap, 0)
    d = decide(snap)
    assert d.action == "shrink"
    # Next round: the shrunk world is current; node1's agent now reports (late) that its
    # epoch-1 worker for rank 2 died. Rank 2 is now a different worker (old rank 3).
    snap.world = d.world
    snap.epoch = d.world.epoch
    snap.reports = [Report("node1", 2, 1, "exit", exit_code=1)]
    d2 = decide(snap)
    assert d2.action == "none", str(d2)
    assert d2.clear_reports == (("node1", 2),)


def test_a_shrink_keeps_each_survivors_sid_and_a_later_swap_keeps_the_lost_one():
    snap = snapshot_running(ranks=3, spares=0, policy="shrink", min_ranks=1)
    lose(snap, "node0")
    shrink = decide(snap)
    assert shrink.action == "shrink"
    w = shrink.world
    # ranks 1, 2 became 0, 1: their snapshots and replicas are still named 1 and 2
    assert [w.sid(r) for r in range(w.size)] == [1, 2]
    snap.world, snap.epoch = w, w.epoch
    lose(snap, "node2")
    add_node(snap, make_node("spare0", "spare"))
    d = decide(snap)
    assert d.action == "swap"
    assert d.world.seats[1].node == "spare0" and d.world.sid(1) == 2  # restores sid 2's replicas
    assert d.world.sid(0) == 1


def shrunk_snapshot(ranks: int = 3, lost: tuple[str, ...] = ("node1",), min_ranks: int = 1) -> JobSnapshot:
    """A job that shrank after losing ``lost`` (no spare), at the shrunk world's epoch."""
    snap = snapshot_running(ranks=ranks, spares=0, policy="shrink", min_ranks=min_ranks)
    lose(snap, *lost)
    d = decide(snap)
    assert d.action == "shrink", str(d)
    snap.world, snap.epoch = d.world, d.world.epoch
    return snap


def test_a_shrunk_world_grows_back_when_a_warm_spare_joins():
    snap = shrunk_snapshot()
    old = snap.world
    late = add_node(snap, make_node("late0", "spare", warm=1))
    d = decide(snap)
    assert d.action == "grow", str(d)
    assert d.changes_world and d.final_state is None and d.losses == ()
    new = d.world
    assert new.epoch == old.epoch + 1 and new.size == 3 and new.grown_from == 2
    assert new.seats[:2] == old.seats  # members keep their seats and numbers
    seat = new.seats[2]
    assert (seat.node, seat.incarnation, seat.since) == ("late0", late.incarnation, new.epoch)
    # a fresh sid: no snapshot or replica of any earlier seat can be mistaken for its state
    assert new.sid(2) not in {0, 1, 2}
    assert d.spares == ("late0",)
    assert str(d) == "epoch 2: 2 ranks of 3; growing to 3 ranks (rank 2 -> late0) at epoch 3"


def test_a_shrunk_world_waits_for_a_warm_worker_before_growing():
    snap = shrunk_snapshot()
    add_node(snap, make_node("late0", "spare", warm=0))  # agent up, worker still importing torch
    d = decide(snap)
    assert d.action == "none"
    assert "2 ranks healthy (1 below ranks=3; growing back once a warm worker is free)" in str(d)


def test_a_grow_takes_only_as_many_seats_as_there_are_warm_workers():
    snap = shrunk_snapshot(ranks=4, lost=("node1", "node2"))
    add_node(snap, make_node("late0", "spare", slots=2, warm=1))
    d = decide(snap)
    assert d.action == "grow"
    assert d.world.size == 3 and [s.node for s in d.world.seats[2:]] == ["late0"]
    snap.world, snap.epoch = d.world, d.world.epoch
    snap.nodes["late0"] = make_node("late0", "spare", slots=2, warm=1)  # its second worker warmed up
    d2 = decide(snap)
    assert d2.action == "grow" and d2.world.size == 4 and d2.world.grown_from == 3
    sids = [d2.world.sid(r) for r in range(4)]
    assert len(set(sids)) == 4


def test_a_loss_is_handled_before_growing():
    snap = shrunk_snapshot()
    add_node(snap, make_node("late0", "spare", warm=1))
    lose(snap, "node2")  # rank 1 of the shrunk world
    d = decide(snap)
    assert d.action == "swap" and d.world.seats[1].node == "late0"


def test_a_full_world_never_grows():
    snap = snapshot_running(ranks=3, spares=1, policy="shrink")
    snap.nodes["spare0"] = make_node("spare0", "spare", warm=1)
    assert decide(snap).action == "none"


# -- failure during recovery ------------------------------------------------------------
def recovering_snapshot(spares: int = 2, policy: str = "wait") -> JobSnapshot:
    """Epoch 2 after node1 was lost at epoch 1 and rank 1 moved to spare0."""
    snap = snapshot_running(ranks=3, spares=spares, policy=policy, epoch=2)
    lose(snap, "node1")
    w = snap.world
    spare0 = snap.nodes["spare0"]
    snap.world = World(
        2,
        (w.seats[0], Seat("spare0", spare0.incarnation, 2), w.seats[2]),
        reason="rank 1 on node1: node node1 lost its lease",
        lost=(1,),
    )
    return snap


def test_recovery_world_is_healthy_without_the_first_failed_node():
    assert decide(recovering_snapshot()).action == "none"


def test_spare_lost_during_recovery_is_swapped_again():
    snap = recovering_snapshot(spares=2)
    lose(snap, "spare0")
    report(snap, 1, node="node1", epoch=1)  # leftover report of the first failure
    d = decide(snap)
    new = assert_swapped(snap, d, {1: "spare1"}, kind="node-loss")
    assert new.epoch == 3
    assert new.seats[1] == Seat("spare1", snap.nodes["spare1"].incarnation, 3)
    assert new.lost == (1,)
    assert "node spare0 lost its lease" in str(d)
    assert set(d.clear_reports) == {("node1", 1), ("spare0", 1)}


def test_spare_worker_dying_during_recovery_is_swapped_again_not_to_itself():
    snap = recovering_snapshot(spares=2)
    report(snap, 1, epoch=2)  # spare0's new worker for rank 1 exits
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare1"}, kind="exit")


def test_spare_lost_during_recovery_without_another_spare_waits():
    snap = recovering_snapshot(spares=1)
    lose(snap, "spare0")
    d = decide(snap)
    assert d.action == "wait"
    assert d.world is None


def test_a_second_loss_during_recovery_keeps_the_recovered_seat():
    snap = recovering_snapshot(spares=2)
    lose(snap, "node2")
    d = decide(snap)
    new = assert_swapped(snap, d, {2: "spare1"})
    assert new.seats[1] == snap.world.seats[1]  # rank 1 stays on spare0, since epoch 2


# -- Decision ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("action", "state"),
    [
        ("succeed", JobState.SUCCEEDED),
        ("fail", JobState.FAILED),
        ("cancel", JobState.CANCELLED),
        ("none", None),
        ("wait", None),
        ("place", None),
        ("swap", None),
        ("shrink", None),
        ("grow", None),
    ],
)
def test_final_state_maps_only_succeed_fail_and_cancel(action, state):
    assert Decision(action, "why").final_state is state


def test_decision_str_is_its_reason_and_changes_world_follows_world():
    d = Decision("none", "all good")
    assert str(d) == "all good"
    assert not d.changes_world
    assert Decision("place", "x", world=World(1, ())).changes_world


# -- properties -------------------------------------------------------------------------
@st.composite
def running_with_failures(draw):
    rpn = draw(st.integers(1, 3))
    ranks = draw(st.integers(1, 8))
    spares = draw(st.integers(0, 3))
    policy = draw(st.sampled_from(["wait", "fail", "shrink"]))
    snap = snapshot_running(ranks=ranks, spares=spares, rpn=rpn, policy=policy)
    for name in sorted(snap.nodes):
        if name.startswith("spare"):
            snap.nodes[name] = make_node(
                name, "spare", slots=draw(st.integers(1, 3)), warm=draw(st.integers(0, 1))
            )
    for name in sorted(snap.nodes):
        what = draw(st.sampled_from(["ok", "ok", "lose", "restart"]))
        if what == "lose":
            lose(snap, name)
        elif what == "restart":
            restart(snap, name)
    for r in range(ranks):
        if draw(st.integers(0, 4)) == 0:
            report(snap, r, kind=draw(st.sampled_from(["exit", "hang"])))
    return snap


@settings(max_examples=300, deadline=None)
@given(running_with_failures())
def test_every_decision_on_a_running_job_is_consistent(snap):
    old = snap.world
    losses, _ = find_losses(snap, old)
    failed = {lo.node for lo in losses}
    d = decide(snap)
    assert d.action in {"none", "swap", "shrink", "wait", "fail"}
    if not losses:
        assert d.action == "none"
        return
    assert [lo.rank for lo in d.losses] == [lo.rank for lo in losses]
    if d.action == "swap":
        new = d.world
        assert new.epoch == old.epoch + 1 and new.size == old.size
        assert set(new.lost) == {lo.rank for lo in losses}
        if failed & set(d.spares):  # only when no other node had room and the job would wait for one
            assert snap.spec.on_no_spare == "wait" and "restarting on the same node(s)" in str(d)
            assert sum(_free_capacity(snap, old, failed, {lo.rank for lo in losses}).values()) < len(losses)
            assert all(lo.kind == "node-loss" for lo in losses if lo.node in d.spares)
        assert_slots_respected(snap, new)
        for r, seat in enumerate(new.seats):
            if r in new.lost:
                assert seat.since == new.epoch
                assert seat.incarnation == snap.nodes[seat.node].incarnation
            else:
                assert seat == old.seats[r]
    elif d.action == "shrink":
        assert d.world.size == old.size - len(losses) >= snap.spec.min_ranks
        assert d.world.shrunk_from == old.size
    if d.world is not None:  # every seat's state keeps a name of its own
        assert len({d.world.sid(r) for r in range(d.world.size)}) == d.world.size
    else:
        assert d.world is None


def test_action_and_loss_kind_are_their_plain_names_to_callers_logs_and_json():
    d = Decision("swap", "why")
    assert d.action is Action.SWAP and d.action == "swap"
    assert f"{d.action}" == "swap" and json.dumps([d.action, LossKind.NODE_LOSS]) == '["swap", "node-loss"]'
    with pytest.raises(ValueError):
        Decision("reboot", "no such action")


def test_decide_returns_enum_members():
    snap = snapshot_running()
    lose(snap, "node1")
    d = decide(snap)
    assert d.action is Action.SWAP
    assert [lo.kind for lo in d.losses] == [LossKind.NODE_LOSS]


def test_a_report_kind_from_a_newer_agent_is_still_a_loss_swapped_to_a_spare():
    snap = snapshot_running()
    report(snap, 1, kind="xid-error", message="its GPU fell off the bus")
    d = decide(snap)
    assert_swapped(snap, d, {1: "spare0"}, kind="xid-error")
    assert "rank 1 on node1: its GPU fell off the bus" in str(d)
