"""Exact data loading: ``session.data_loader(dataset, batch_size=..., shuffle=True, ...)``.

A stock ``torch.utils.data.DataLoader`` cannot be resumed exactly: its position is not
state, ``iter(loader)`` draws the shuffle seed and the workers' base seed from torch's
global generator, and each worker's RNG depends on how many batches it served since the
iterator began. Re-creating an iterator after a restore therefore shifts every later random
draw, and the job "succeeds" with different weights.

:class:`ElasticDataLoader` keeps the DataLoader's machinery (workers, prefetching, pinning,
``collate_fn``) and replaces what breaks exactness:

* **Which samples**: an :class:`~hotspare.recovery.sampler.ElasticSampler` -- the global
  position ``{"epoch", "pos"}`` in the stream of per-epoch permutations is the loader's
  whole state (``state_dict``), advanced when a batch is *handed to the caller*, not when a
  worker prefetches it. Rank and world size are read at every batch (from the session), so
  a shrink or grow re-shards from the restored global position.
* **Randomness**: every batch is fetched and collated with torch's CPU generator, numpy's
  and Python's global generators seeded from the batch's place in the stream (seed, epoch,
  position, rank), in a worker or -- with ``num_workers=0`` -- in the training process
  inside a fork of its generators that is put back afterwards. A batch is thus the same
  whatever the number of workers, whichever worker fetched it, and whether or not an
  iterator was re-created before it. The DataLoader's own base seed comes from a private
  generator: nothing draws from the global generators.
* **After a restore** (``load_state_dict`` with another position) the read-ahead is
  dropped; the next batch rebuilds the iterator at the restored position (persistent
  workers are kept and reset).

Detecting the trap: while ``session.steps()`` runs, :func:`watch_untracked_loaders` wraps
``DataLoader.__iter__`` and the DataLoader iterator's ``__next__`` (the class attributes are
put back when the loop ends). An iterator of an untracked DataLoader that is read in more
than one step -- its position lives outside the tracked state -- triggers one
:class:`UntrackedDataLoaderWarning` naming the fix. An iterator created and used up within
one step (an evaluation pass) draws from the tracked global generator at the same step in
every run, so it is exact and does not warn.
"""

from __future__ import annotations

import ctypes
import random
import signal
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .sampler import ElasticSampler

__all__ = ["ElasticDataLoader", "UntrackedDataLoaderWarning", "watch_untracked_loaders"]

_MASK = (1 << 64) - 1
#: DataLoader arguments the loader decides itself (the sampler, the generator) or refuses
_REFUSED = {
    "sampler": "the loader shards and orders the samples itself (shuffle=, seed=)",
    "batch_sampler": "the loader shards and orders the samples itself (batch_size=, shuffle=, drop_last=)",
    "generator": "the loader seeds itself from seed= and its tracked position",
}


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over each): nearby inputs, unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h >> 1


def _seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # the CPU generator only: never a device's
    np.random.seed(seed % 2**32)
    random.seed(seed)


@contextmanager
def _own_generators(seed: int) -> Iterator[None]:
    """Run with the global generators seeded to ``seed``, then put them back."""
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        _seed_all(seed)
        yield
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


class _Batch(list):
    """One batch's sample ids and the seed its fetch and collation run under (pickled to a
    worker with the ids)."""

    def __init__(self, ids: list[int], seed: int) -> None:
        super().__init__(ids)
        self.seed = seed


class _SeededFetch(Dataset):
    """The user's dataset as the inner DataLoader sees it: a batch is fetched and collated
    in one call, under its own seed (``__getitems__`` receives the whole batch)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def _collated(self, ids: list[int]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(ids) if getitems else [self.dataset[i] for i in ids]
        return self.collate_fn(samples)

    def __getitems__(self, batch: _Batch) -> list:
        ids = list(batch)
        if get_worker_info() is not None:  # a worker's generators are its own
            _seed_all(batch.seed)
            return [self._collated(ids)]
        with _own_generators(batch.seed):  # the training process's are tracked state
            return [self._collated(ids)]


def _collated(data: list) -> Any:
    return data[0]  # _SeededFetch.__getitems__ already collated


class _WorkerInit:
    """A loader worker dies with the training process -- a killed rank's workers do not
    linger until DataLoader's 5 s parent check -- then runs the user's ``worker_init_fn``."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
        except (AttributeError, OSError):
            pass  # not Linux: DataLoader's own parent check remains
        if self.user_fn is not None:
            self.user_fn(worker_id)


class _ReadAhead:
    """The inner DataLoader's batch sampler: this rank's batches from the loader's position
    at the moment an iterator is (re)started, on a private cursor (prefetching never moves
    the loader's own position)."""

    def __init__(self, loader: ElasticDataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[_Batch]:
        cursor = self.loader.sampler.fork()
        while True:
            epoch, pos = cursor.start()
            yield _Batch(cursor.next().tolist(), _mix(self.loader.seed, epoch, pos, cursor.rank))


class ElasticDataLoader:
    """Batches of a map-style dataset for one data-parallel rank, resumable at the exact
    sample (create it with ``session.data_loader(...)``, which also tracks it).

    An endless iterator: each ``next(loader)`` is this rank's batch of the next step, epochs
    following each other (``loader.epoch`` is the epoch the next batch starts in;
    ``len(loader)`` is the number of steps in an epoch at the current world size). Take
    exactly one batch per step, after the step began::

        loader = session.data_loader(dataset, batch_size=32, shuffle=True, num_workers=2)
        for step, (x, y) in zip(session.steps(), loader):   # steps() first
            ...

    Sharding and epochs are :class:`~hotspare.recovery.sampler.ElasticSampler`'s: with
    ``drop_last=False`` (the default) a step at an epoch's end takes the old epoch's tail
    and the new epoch's head, so every batch is full and each epoch reads every sample
    exactly once; ``drop_last=True`` skips the tail that cannot fill a whole step. The
    other keyword arguments (``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
    ``worker_init_fn``, ``timeout``, ``multiprocessing_context``, ...) go to
    ``torch.utils.data.DataLoader``; ``sampler``, ``batch_sampler``, ``generator`` and
    ``in_order=False`` are refused. Randomness in the dataset or ``collate_fn`` (torch's
    CPU generator, numpy's, Python's) is seeded per batch from its place in the stream.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        group: Any = None,
        rank: int = 0,
        world_size: int = 1,
        **loader_kwargs: Any,
    ) -> None:
        _check_arguments(dataset, loader_kwargs)
        self.seed = int(seed)
        self.sampler = ElasticSampler(len(dataset), batch_size, seed=self.seed, rank=rank, world_size=world_size,
                                      group=group, shuffle=shuffle, drop_last=drop_last)
        self._base = torch.Generator()  # the DataLoader's base seed: never the global generator
        self._loader = DataLoader(
            _SeededFetch(dataset, collate_fn or default_collate),
            batch_sampler=_ReadAhead(self),
            num_workers=num_workers,
            collate_fn=_collated,
            generator=self._base,
            worker_init_fn=_WorkerInit(loader_kwargs.pop("worker_init_fn", None)),
            **loader_kwargs,
        )
        self._loader._hotspare_tracked = True  # type: ignore[attr-defined]
        self._it: Iterator | None = None
        self._for: tuple[int, int] | None = None  # (rank, world size) the iterator reads for

    @property
    def dataset(self) -> Any:
        return self._loader.dataset.dataset

    @property
    def epoch(self) -> int:
        return self.sampler.start()[0]

    def __len__(self) -> int:
        step = self.sampler.batch_size * self.sampler.world_size
        n = self.sampler.num_samples
        return n // step if self.sampler.drop_last else -(-n // step)

    def __iter__(self) -> ElasticDataLoader:
        return self

    def __next__(self) -> Any:
        where = (self.sampler.rank, self.sampler.world_size)
        if self._it is None or self._for != where:
            self._restart(where)
        batch = next(self._it)
        self.sampler.advance()  # only now: a batch the caller never got is not consumed
        return batch

    def _restart(self, where: tuple[int, int]) -> None:
        self._it = None  # a non-persistent iterator shuts its workers down here
        self._base.manual_seed(_mix(self.seed, where[0], 0xDA7A))
        it = iter(self._loader)  # persistent workers: the same iterator, reset
        it._hotspare_tracked = True  # type: ignore[attr-defined]
        self._it, self._for = it, where

    # torchdata StatefulDataLoader convention: tracked by the session
    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._it is not None and self.sampler.state_dict() == {k: int(state[k]) for k in ("epoch", "pos")}:
            return  # the running iterator already reads from there
        self.sampler.load_state_dict(state)
        self._for = None  # drop the read-ahead: the next batch restarts at the restored position

    def close(self) -> None:
        """Stop the worker processes (also done when the loader is garbage-collected)."""
        self._it = None
        persistent = getattr(self._loader, "_iterator", None)
        if persistent is not None:
            persistent._shutdown_workers()
            self._loader._iterator = None


def _check_arguments(dataset: Any, loader_kwargs: dict) -> None:
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"data_loader() takes a map-style dataset (__getitem__ and __len__), not a "
            f"{type(dataset).__name__}: an iterable dataset's position cannot be restored; track "
            "your own loader with state_dict/load_state_dict instead"
        )
    for name, why in _REFUSED.items():
        if name in loader_kwargs:
            raise TypeError(f"data_loader() takes no {name}=: {why}")
    if loader_kwargs.get("in_order", True) is False:
        raise ValueError("data_loader() needs in_order=True: out-of-order batches are not reproducible")


# -- the trap: an untracked DataLoader read across steps ------------------------------------
class UntrackedDataLoaderWarning(UserWarning):
    """An untracked ``torch.utils.data.DataLoader`` iterator is read across steps of
    ``session.steps()``: after a failure the job will not be exact."""


UNTRACKED_MESSAGE = (
    "hotspare: a torch DataLoader iterator is read across steps inside session.steps(), but "
    "its position and seeds are not tracked (after a failure it restarts elsewhere and draws "
    "from torch's global generator, so the job is no longer exact); create the loader with "
    "session.data_loader(dataset, batch_size=..., shuffle=...) instead"
)


class _Watch:
    """Wraps the DataLoader's iteration while at least one session's ``steps()`` runs."""

    def __init__(self) -> None:
        self.sessions: list[Any] = []
        self.warned = False
        self.originals: tuple[Any, Any] | None = None

    def tracked(self, loader: Any) -> bool:
        if getattr(loader, "_hotspare_tracked", False):
            return True
        return any(getattr(p, "obj", None) is loader for s in self.sessions for _, p in s.snapshots.providers)

    def install(self) -> None:
        orig_iter, orig_next = DataLoader.__iter__, _BaseDataLoaderIter.__next__
        watch = self

        def __iter__(loader: DataLoader) -> Any:
            it = orig_iter(loader)
            it._hotspare_tracked = watch.tracked(loader)  # a new pass: judged afresh
            it._hotspare_seen = None
            return it

        def __next__(it: Any) -> Any:
            if not watch.warned and not getattr(it, "_hotspare_tracked", False):
                watch.seen(it)
            return orig_next(it)

        self.originals = orig_iter, orig_next
        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]

    def seen(self, it: Any) -> None:
        step = self.sessions[-1].committed if self.sessions else None
        first = getattr(it, "_hotspare_seen", None)
        if first is None:
            it._hotspare_seen = step
        elif first != step:
            self.warned = True
            warnings.warn(UNTRACKED_MESSAGE, UntrackedDataLoaderWarning, stacklevel=3)

    def uninstall(self) -> None:
        if self.originals is not None:
            DataLoader.__iter__, _BaseDataLoaderIter.__next__ = self.originals  # type: ignore[method-assign]
            self.originals = None


_watch = _Watch()


def watch_untracked_loaders(session: Any) -> Callable[[], None]:
    """Start watching for untracked DataLoader iterators while ``session.steps()`` runs;
    returns the function that stops it."""
    _watch.sessions.append(session)
    if _watch.originals is None:
        _watch.install()

    def stop() -> None:
        if session in _watch.sessions:
            _watch.sessions.remove(session)
        if not _watch.sessions:
            _watch.uninstall()

    return stop


def session_loader(session: Any, dataset: Any, batch_size: int, name: str | None, **kwargs: Any) -> ElasticDataLoader:
    """``session.data_loader``: build the loader, sharded by the session, and track it."""
    if session in _watch.sessions:
        raise RuntimeError(
            "session.data_loader() was called inside session.steps(): create the loader before "
            "the loop, so that its position is restored when the loop starts"
        )
    taken = {n.split(".")[0] for n, _ in session.snapshots.providers}
    if name is None:
        name = next(f"data_loader{i or ''}" for i in range(len(taken) + 1) if f"data_loader{i or ''}" not in taken)
    loader = ElasticDataLoader(dataset, batch_size, group=session, **kwargs)
    session.track(**{name: loader})
    return loader
