"""hotspare.recovery.sampler.ElasticSampler without a server: exactly once per epoch through any
sequence of world sizes, and a state that any rank can restore."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotspare.recovery.sampler import ElasticSampler


def run_steps(n: int, batch: int, worlds: list[int], seed: int = 0, **kw) -> list[list[tuple[int, int]]]:
    """Every rank of every step reads its share the way a job does: each rank has its own
    sampler, restored from the state the previous step left (the same on every rank)."""
    state = {"epoch": 0, "pos": 0}
    steps = []
    for world in worlds:
        group = SimpleNamespace(rank=0, world_size=world)
        read, after = [], set()
        for r in range(world):
            s = ElasticSampler(n, batch, seed=seed, group=group, **kw)
            s.load_state_dict(state)
            group.rank = r
            epochs, ids = s.peek()
            assert ids.numel() == batch  # every rank always reads a full batch
            assert s.next().tolist() == ids.tolist()
            read += list(zip(epochs.tolist(), ids.tolist(), strict=True))
            after.add(json.dumps(s.state_dict()))
        assert len(after) == 1, "the state must not depend on the rank"
        state = json.loads(after.pop())
        steps.append(read)
    return steps


def assert_exactly_once_per_epoch(n: int, steps: list[list[tuple[int, int]]]) -> None:
    read = [x for step in steps for x in step]
    by_epoch: dict[int, list[int]] = {}
    for e, i in read:
        by_epoch.setdefault(e, []).append(i)
    last = max(by_epoch)
    assert sorted(by_epoch) == list(range(last + 1)), "an epoch was skipped"
    for e, ids in by_epoch.items():
        dup = [i for i, c in Counter(ids).items() if c > 1]
        assert not dup, f"epoch {e}: samples {dup[:5]} read twice"
        if e < last:
            assert sorted(ids) == list(range(n)), f"epoch {e}: {n - len(ids)} samples skipped"
    # and in stream order: epoch by epoch, never back
    assert [e for e, _ in read] == sorted(e for e, _ in read)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 6),
    worlds=st.lists(st.integers(1, 5), min_size=1, max_size=40),
    seed=st.integers(0, 3),
)
def test_any_sequence_of_world_sizes_reads_every_epoch_exactly_once(n, batch, worlds, seed):
    assert_exactly_once_per_epoch(n, run_steps(n, batch, worlds, seed))


def test_a_shrink_and_a_grow_mid_epoch_continue_from_the_global_position():
    steps = run_steps(20, 2, [3, 3, 2, 2, 2, 3, 3, 3, 2])
    assert [len(s) for s in steps] == [6, 6, 4, 4, 4, 6, 6, 6, 4]
    assert_exactly_once_per_epoch(20, steps)
    # the shrunk world's first step starts right where the 3-rank world stopped
    s = ElasticSampler(20, 2)
    flat = [s.permutation(0)[i].item() for i in range(12, 16)]
    assert [i for _, i in steps[2]] == flat


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 5),
    before=st.lists(st.integers(1, 4), max_size=15),
    after=st.lists(st.integers(1, 4), min_size=1, max_size=15),
)
def test_a_restored_state_continues_exactly_like_the_original(n, batch, before, after):
    a = ElasticSampler(n, batch, seed=3)
    for w in before:
        a.world_size = w
        a.next()
    b = ElasticSampler(n, batch, seed=3, rank=1)  # another rank's fresh object
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for w in after:
        a.world_size = b.world_size = w
        for r in range(w):
            a.rank = b.rank = r
            assert a.peek()[1].tolist() == b.peek()[1].tolist()
        a.advance()
        b.advance()
    assert a.state_dict() == b.state_dict()


def test_rank_and_world_size_follow_the_group_at_every_step():
    group = SimpleNamespace(rank=0, world_size=2)
    s = ElasticSampler(100, 4, group=group)
    s.next()
    assert s.state_dict() == {"epoch": 0, "pos": 8}
    group.rank, group.world_size = 2, 3  # a grow renumbered nothing and added rank 2
    ids = s.next()
    assert ids.tolist() == s.permutation(0)[16:20].tolist()
    assert s.state_dict() == {"epoch": 0, "pos": 20}


def test_rank_outside_the_world_is_refused():
    s = ElasticSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="outside world_size"):
        s.next()


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 6),
    worlds=st.lists(st.integers(1, 5), min_size=1, max_size=40),
)
def test_drop_last_steps_never_cross_an_epoch_and_skip_only_a_tail(n, batch, worlds):
    worlds = [w for w in worlds if batch * w <= n] or [1]
    if batch > n:
        return
    steps = run_steps(n, batch, worlds, seed=1, drop_last=True)
    by_epoch: dict[int, list[int]] = {}
    for step in steps:
        assert len({e for e, _ in step}) == 1, "a step crossed an epoch"
        by_epoch.setdefault(step[0][0], []).append(len(step))
    read = [x for step in steps for x in step]
    assert len(set(read)) == len(read), "a sample was read twice in one epoch"
    assert [e for e, _ in read] == sorted(e for e, _ in read)
    for e, sizes in by_epoch.items():
        if e < max(by_epoch):  # an epoch was left: what it skipped could not fill the next step
            nxt = next(s for s in steps if s[0][0] > e)
            assert n - sum(sizes) < len(nxt)


def test_without_shuffle_every_epoch_is_read_in_order():
    s = ElasticSampler(5, 2, shuffle=False, world_size=2)
    assert [s.next().tolist() for _ in range(3)] == [[0, 1], [4, 0], [3, 4]]  # rank 0 of 2
    assert s.state_dict() == {"epoch": 2, "pos": 2}


def test_a_fork_reads_ahead_without_moving_the_original():
    group = SimpleNamespace(rank=1, world_size=2)
    s = ElasticSampler(50, 3, seed=4, group=group)
    s.next()
    ahead = s.fork()
    group.rank, group.world_size = 0, 3  # the fork keeps the rank and world of its moment
    assert (ahead.rank, ahead.world_size) == (1, 2)
    first = ahead.next()
    ahead.next()
    assert s.state_dict() == {"epoch": 0, "pos": 6}
    group.rank, group.world_size = 1, 2
    assert s.next().tolist() == first.tolist()
