"""hotspare.recovery.data: ``session.data_loader``'s loader resumes at the exact sample, with
the same random draws, whatever the workers, restores and world sizes did -- and a plain
DataLoader read across steps is reported once."""

from __future__ import annotations

import json
import random
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hotspare import ElasticDataLoader, UntrackedDataLoaderWarning
from hotspare.recovery import data
from hotspare.recovery.state import provider_for

from .test_sampler import assert_exactly_once_per_epoch

# one worker runs this module (pytest-xdist --dist loadgroup): its module-scoped fixture is made once
pytestmark = pytest.mark.xdist_group("data")

N = 30


def dataset(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def noisy_collate(items: list) -> dict:
    """Randomness from all three global generators, as augmentations draw it."""
    ids = torch.stack([i[0] for i in items])
    return {"ids": ids, "torch": torch.rand(len(items)), "numpy": float(np.random.rand()),
            "python": random.random()}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["ids"], b["ids"]) and torch.equal(a["torch"], b["torch"])
            and a["numpy"] == b["numpy"] and a["python"] == b["python"])


def loader(**kw) -> ElasticDataLoader:
    kw.setdefault("collate_fn", noisy_collate)
    kw.setdefault("seed", 7)
    return ElasticDataLoader(dataset(kw.pop("n", N)), kw.pop("batch_size", 4), **kw)


def global_states() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    """20 batches of one uninterrupted loader (30 samples, batch 4: crosses 2 epochs)."""
    dl = loader()
    return [next(dl) for _ in range(20)]


@pytest.mark.parametrize("workers", [{}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}],
                         ids=["in-process", "2-workers", "2-persistent-workers"])
def test_a_new_loader_restored_mid_epoch_continues_exactly(reference, workers):
    first = loader(**workers)
    for i in range(5):
        assert same(next(first), reference[i])
    state = json.loads(json.dumps(first.state_dict()))  # what a snapshot keeps
    first.close()
    second = loader(**workers)  # a spare's fresh process
    second.load_state_dict(state)
    for i in range(5, 20):
        assert same(next(second), reference[i]), f"batch {i} differs after the restore"
    second.close()


def test_a_rollback_drops_the_read_ahead_and_repeats_the_same_batches(reference):
    dl = loader(num_workers=2)
    for _ in range(9):  # the workers have prefetched beyond batch 9 by now
        next(dl)
    state_at_9 = dl.state_dict()
    dl.load_state_dict({"epoch": 0, "pos": 12})  # the session restores step 2's position
    assert same(next(dl), reference[3]) and same(next(dl), reference[4])
    dl.load_state_dict(state_at_9)
    assert all(same(next(dl), reference[i]) for i in range(9, 14))
    dl.close()


def test_the_global_generators_are_never_drawn_from():
    before = global_states()
    for kw in ({}, {"num_workers": 2}):
        dl = loader(**kw)
        [next(dl) for _ in range(10)]
        dl.load_state_dict({"epoch": 0, "pos": 8})
        [next(dl) for _ in range(3)]
        dl.close()
    after = global_states()
    assert torch.equal(before[0], after[0]), "torch's global generator moved"
    assert (before[1] == after[1]).all() and before[2] == after[2], "numpy's or Python's generator moved"


def test_epochs_follow_each_other_and_every_sample_is_read_once_per_epoch(reference):
    ids = torch.cat([b["ids"] for b in reference]).tolist()  # 80 entries: epochs 0, 1 and a bit of 2
    assert sorted(ids[:N]) == list(range(N)) and sorted(ids[N : 2 * N]) == list(range(N))
    assert ids[:N] != ids[N : 2 * N], "each epoch has its own order"
    assert ids[:N] != list(range(N)), "shuffled"
    in_order = loader(shuffle=False)
    assert torch.cat([next(in_order)["ids"] for _ in range(8)]).tolist() == list(range(N)) + [0, 1]


def test_drop_last_never_crosses_an_epoch():
    dl = loader(drop_last=True, batch_size=4)  # 30 samples: 7 full batches per epoch
    assert len(dl) == 7 and len(loader()) == 8
    epochs = []
    for _ in range(14):
        epochs.append(dl.epoch)
        next(dl)
    assert epochs == [0] * 7 + [1] * 7
    # the 2-sample tail is skipped when the next step starts (its world size decides)
    assert dl.state_dict() == {"epoch": 1, "pos": 28} and dl.epoch == 2
    with pytest.raises(ValueError, match="drop_last"):
        next(loader(drop_last=True, batch_size=4, rank=0, world_size=8))


def read_step(loaders: dict[int, ElasticDataLoader]) -> list[tuple[int, int]]:
    """One step of every rank; the (epoch, id) pairs read, in rank order."""
    read = []
    for _, dl in sorted(loaders.items()):
        epochs, ids = dl.sampler.peek()
        got = next(dl)["ids"]
        assert got.tolist() == ids.tolist(), "the loader reads what its sampler says"
        read += list(zip(epochs.tolist(), got.tolist(), strict=True))
    assert len({json.dumps(dl.state_dict()) for dl in loaders.values()}) == 1, "ranks disagree on the position"
    return read


def test_a_shrink_and_a_grow_reshard_from_the_global_position_without_a_restore():
    groups = {r: SimpleNamespace(rank=r, world_size=3) for r in range(3)}
    loaders = {r: loader(group=g, num_workers=2 if r == 0 else 0) for r, g in groups.items()}
    steps = [read_step(loaders) for _ in range(3)]
    loaders.pop(2).close()  # rank 2 is lost: the survivors carry on as a world of 2
    for g in groups.values():
        g.world_size = 2
    steps += [read_step(loaders) for _ in range(4)]
    for g in groups.values():
        g.world_size = 3
    loaders[2] = loader(group=groups[2])
    loaders[2].load_state_dict(loaders[0].state_dict())
    steps += [read_step(loaders) for _ in range(3)]
    assert [len(s) for s in steps] == [12] * 3 + [8] * 4 + [12] * 3
    assert_exactly_once_per_epoch(N, steps)
    loaders[0].close()


def test_arguments_that_would_break_exactness_are_refused():
    with pytest.raises(TypeError, match="no sampler="):
        ElasticDataLoader(dataset(), 2, sampler=range(N))
    with pytest.raises(TypeError, match="no generator="):
        ElasticDataLoader(dataset(), 2, generator=torch.Generator())
    with pytest.raises(ValueError, match="in_order=True"):
        ElasticDataLoader(dataset(), 2, num_workers=1, in_order=False)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="map-style dataset"):
        ElasticDataLoader(Stream(), 2)


# -- the trap ------------------------------------------------------------------------------
class FakeSession:
    """What the watch and session_loader read of a Session."""

    def __init__(self) -> None:
        self.committed = -1
        self.rank, self.world_size = 0, 1
        self.snapshots = SimpleNamespace(providers=[("rng", object())])

    def track(self, **components) -> None:
        for name, obj in components.items():
            self.snapshots.providers += provider_for(name, obj)


@pytest.fixture
def session():
    s = FakeSession()
    data._watch.warned = False
    stop = data.watch_untracked_loaders(s)
    yield s
    stop()
    data._watch.warned = False


def untracked_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, UntrackedDataLoaderWarning)]


def test_a_plain_dataloader_read_across_steps_warns_once_naming_the_fix(session):
    plain = DataLoader(dataset(), batch_size=2, shuffle=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        it = iter(plain)
        for step in range(4):
            session.committed = step - 1
            next(it)
        it2 = iter(plain)  # a second trap: still one warning
        next(it2)
        session.committed += 1
        next(it2)
    [w] = untracked_warnings(record)
    assert "session.data_loader(" in str(w.message)
    assert w.filename == __file__, "the warning points at the user's line"


def test_an_iterator_made_before_the_loop_and_read_inside_it_warns(session):
    it = iter(DataLoader(dataset(), batch_size=2))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(2):
            session.committed = step
            next(it)
    assert len(untracked_warnings(record)) == 1


def test_the_supported_path_and_one_pass_per_step_do_not_warn(session):
    tracked = ElasticDataLoader(dataset(), 2, group=session, num_workers=1)
    evaluation = DataLoader(dataset(), batch_size=10)
    stateful = DataLoader(dataset(), batch_size=2)  # tracked by the user: their responsibility
    stateful.state_dict, stateful.load_state_dict = dict, lambda s: None
    session.track(mine=stateful)
    it = iter(stateful)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(4):
            session.committed = step
            next(tracked)
            next(it)
            assert sum(b[0].numel() for b in evaluation) == N  # a whole pass within one step
    assert not untracked_warnings(record)
    tracked.close()


def test_the_watch_leaves_dataloader_as_it_found_it():
    before = DataLoader.__iter__, data._BaseDataLoaderIter.__next__
    s = FakeSession()
    stop = data.watch_untracked_loaders(s)
    assert DataLoader.__iter__ is not before[0]
    stop()
    assert (DataLoader.__iter__, data._BaseDataLoaderIter.__next__) == before


def test_session_loader_names_and_tracks_each_loader_and_refuses_inside_the_loop(session):
    data._watch.sessions.remove(session)  # before steps(): allowed
    a = data.session_loader(session, dataset(), 2, None)
    b = data.session_loader(session, dataset(), 2, None, shuffle=False)
    c = data.session_loader(session, dataset(), 2, "eval")
    names = [n for n, _ in session.snapshots.providers]
    assert names == ["rng", "data_loader", "data_loader1", "eval"]
    assert [p.obj for _, p in session.snapshots.providers[1:]] == [a, b, c]
    assert a.sampler.group is session
    data._watch.sessions.append(session)  # inside steps()
    with pytest.raises(RuntimeError, match="before the loop"):
        data.session_loader(session, dataset(), 2, None)



def pdeathsig() -> int:
    """This process's PR_GET_PDEATHSIG (the signal it gets when its parent dies)."""
    import ctypes

    sig = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    return sig.value


def report_init(worker_id: int) -> None:  # the user's worker_init_fn
    torch.save({"worker": worker_id, "pdeathsig": pdeathsig()}, f"{INIT_DIR}/w{worker_id}.pt")


INIT_DIR = ""


def test_loader_workers_die_with_the_training_process_and_run_the_users_init(tmp_path):
    global INIT_DIR
    INIT_DIR = str(tmp_path)  # a worker is forked: it sees this
    dl = ElasticDataLoader(dataset(), 2, num_workers=2, worker_init_fn=report_init)
    next(dl)
    dl.close()
    got = sorted((torch.load(f) for f in tmp_path.glob("w*.pt")), key=lambda r: r["worker"])
    # SIGKILL when the training process dies (a killed rank's workers do not linger)
    assert got == [{"worker": 0, "pdeathsig": 9}, {"worker": 1, "pdeathsig": 9}]
