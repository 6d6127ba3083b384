"""Which samples each data-parallel rank reads: exactly once per epoch, whatever the world
size does between steps.

The sample stream is the concatenation of per-epoch permutations of ``range(num_samples)``
(epoch ``e`` shuffled by a generator seeded with ``seed + e``). The only state is the
*global* position in that stream — ``{"epoch", "pos"}``: samples of epoch ``epoch``
consumed so far — and it is the same on every rank. A step takes the next
``batch_size * world_size`` entries; rank ``r`` reads the ``r``-th block of ``batch_size``.
A step that crosses an epoch boundary takes the old epoch's tail and the new epoch's head,
so no sample is skipped or repeated and every rank always reads a full batch (the usual
gradient averaging, a sum divided by the world size, stays the global mean).

Because rank and world size are read at every step (from ``group``, e.g. the hotspare
``Session``), a shrink or grow simply continues from the agreed global position with the
new world size: every member restores the same step, so the same position. A seat added
by a grow takes a member's state (same position) and reads its own rank's block.

``shuffle=False`` reads each epoch in order. ``drop_last=True`` never lets a step cross an
epoch: when what is left of the epoch cannot fill a whole step (``batch_size * world_size``
at the current world size), that tail is skipped and the step starts the next epoch, so
each epoch reads every sample at most once.

:class:`hotspare.recovery.data.ElasticDataLoader` (``session.data_loader(...)``) puts this
sampler in front of a ``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

from typing import Any

import torch


class ElasticSampler:
    """Resumable, re-shardable sample ids (torchdata ``StatefulDataLoader`` convention:
    ``state_dict()`` is JSON-able, ``load_state_dict`` restores it).

    ``group`` is anything with ``rank`` and ``world_size`` attributes read at every step
    (the session); without it, the plain ``rank``/``world_size`` attributes are used.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        group: Any = None,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError("num_samples and batch_size must be positive")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._rank, self._world_size = int(rank), int(world_size)
        self.group = group
        self.epoch = 0
        self.pos = 0
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def rank(self) -> int:
        return int(self.group.rank) if self.group is not None else self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = int(value)

    @property
    def world_size(self) -> int:
        return int(self.group.world_size) if self.group is not None else self._world_size

    @world_size.setter
    def world_size(self, value: int) -> None:
        self._world_size = int(value)

    # torchdata StatefulDataLoader convention
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])

    def fork(self) -> ElasticSampler:
        """A detached copy at the same position, with the current rank and world size fixed
        (a loader's read-ahead cursor); it shares the permutations computed so far."""
        c = ElasticSampler(self.num_samples, self.batch_size, seed=self.seed, rank=self.rank,
                           world_size=self.world_size, shuffle=self.shuffle, drop_last=self.drop_last)
        c.epoch, c.pos, c._perms = self.epoch, self.pos, self._perms
        return c

    def start(self) -> tuple[int, int]:
        """(epoch, pos) where the next step starts: the current position, or with
        ``drop_last`` the next epoch's head when the step does not fit in this epoch."""
        step = self.batch_size * self.world_size
        if self.drop_last and self.pos + step > self.num_samples:
            if step > self.num_samples:
                raise ValueError(
                    f"drop_last: one step ({self.batch_size} x {self.world_size} ranks) needs more "
                    f"than the {self.num_samples} samples of an epoch; use drop_last=False or a "
                    "smaller batch_size"
                )
            return self.epoch + 1, 0
        return self.epoch, self.pos

    def permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                perm = torch.randperm(self.num_samples, generator=g)
            else:
                perm = torch.arange(self.num_samples)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}  # keep it small
            self._perms[epoch] = perm
        return perm

    def locate(self, offset: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(epochs, sample ids) of ``count`` stream entries starting ``offset`` past where
        the next step starts (:meth:`start`), without advancing."""
        n = self.num_samples
        first, pos = self.start()
        at = pos + offset
        epoch, i = first + at // n, at % n
        ids, epochs = [], []
        while count > 0:
            k = min(count, n - i)
            ids.append(self.permutation(epoch)[i : i + k])
            epochs.append(torch.full((k,), epoch, dtype=torch.long))
            count, epoch, i = count - k, epoch + 1, 0
        if not ids:
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
        return torch.cat(epochs), torch.cat(ids)

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(epochs, ids) of this rank's share of the next step, without advancing."""
        rank, world = self.rank, self.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world_size {world}")
        return self.locate(rank * self.batch_size, self.batch_size)

    def advance(self) -> None:
        """Move the global position past one step of the current world size."""
        epoch, pos = self.start()
        at = pos + self.batch_size * self.world_size
        self.epoch, self.pos = epoch + at // self.num_samples, at % self.num_samples

    def next(self) -> torch.Tensor:
        """This rank's sample ids for the next step; advances the global position."""
        _, ids = self.peek()
        self.advance()
        return ids
