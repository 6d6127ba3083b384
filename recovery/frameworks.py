"""DDP and FSDP2 on the job's reconfigurable process group: what the session does at every
join so that a script wrapped for torchrun needs no recovery code.

**DDP.** ``DistributedDataParallel(model, process_group=session.process_group)`` holds the
group object, which never changes; its *state* is what must agree across ranks after a
swap. DDP rebuilds its gradient buckets once, after the first iteration, in the order the
gradients became ready, with a broadcast from rank 0 that only an instance which has not
rebuilt yet issues: a spare's fresh instance would issue it alone (the group would hang or
mix a broadcast with an allreduce), and in the meantime it would reduce a bucket layout
that differs from the survivors' (wrong sums). So at every join, the first included, on
every rank, each DDP instance bound to the group is reset with torch's own
``DistributedDataParallel._update_process_group`` (which also makes the gradient divisor
follow a shrink or a grow), and its buckets are rebuilt right there, together, in
parameter order (``Reducer._push_all_rebuilt_params`` + ``_rebuild_buckets``, rank 0's
layout broadcast to all). DDP never rebuilds again, so every step of every run reduces
the same layout: sums stay bit-identical whatever rank took over, with any world size.
The price: buckets in parameter order are ready only when the first layer's gradients
are, so the all-reduce no longer overlaps the backward pass (``benchmarks/ddp_overhead.py``
measures it). With ``find_unused_parameters=True`` DDP never rebuilds anyway and keeps its
initial, overlapping layout. When the job
starts fresh (no state restored), rank 0's module state is broadcast to all ranks, which
is what DDP's constructor does under torchrun (before the first join the group has no
backend, so the constructor's own broadcast completed locally).

**FSDP2.** ``fully_shard(module, mesh=session.device_mesh)``: each rank holds a shard, as
DTensors. Snapshots, replicas and restores work on the local shards
(``hotspare.recovery.state.local``), so a one-for-one swap restores the lost rank's shard by its sid like any
other state. A shrink or a grow would need re-sharding, which hotspare does not do: the
member refuses the new world with :class:`WorldFixed` (an ``Unrecoverable``: the job fails
with that sentence) instead of training on shards of the wrong shape.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable
from typing import Any

import torch

from .restore import Unrecoverable
from .state import is_dtensor

log = logging.getLogger(__name__)


class WorldFixed(Unrecoverable):
    """The job's sharded state (FSDP2) cannot follow a change of world size."""


def ddp_instances(group: object) -> list[Any]:
    """Every live DDP module bound to ``group`` (a heap walk: this runs once per join)."""
    from torch.nn.parallel import DistributedDataParallel

    return [o for o in gc.get_objects()
            if isinstance(o, DistributedDataParallel) and getattr(o, "process_group", None) is group]


def after_join(group: Any, fresh_start: bool) -> int:
    """Bring every DDP instance on ``group`` to the same state on every rank (see the module
    docstring). A collective when ``fresh_start``: False if it failed (the caller waits for
    the next epoch). Returns how many instances there are, or -1 on failure."""
    ddps = ddp_instances(group)
    for ddp in ddps:
        ddp._update_process_group(group)
        ddp.reducer._push_all_rebuilt_params()  # a no-op where DDP never rebuilds (find_unused_parameters)
        if ddp.reducer._rebuild_buckets():  # collective: rank 0's layout, on every rank
            ddp._has_rebuilt_buckets = True
    if not group.healthy:
        return -1
    if fresh_start and ddps:
        from torch.distributed.utils import _sync_module_states

        for ddp in ddps:
            _sync_module_states(module=ddp.module, process_group=group,
                                broadcast_bucket_size=ddp.broadcast_bucket_size, src=0,
                                params_and_buffers_to_ignore=ddp.parameters_to_ignore,
                                broadcast_buffers=ddp.broadcast_buffers)
        if not group.healthy:
            return -1
    return len(ddps)


def sharded(tensors: Iterable[torch.Tensor]) -> bool:
    return any(is_dtensor(t) for t in tensors)


def check_world(first_size: int | None, size: int, has_shards: bool) -> None:
    """Refuse a world whose size differs from the one the shards were cut for."""
    if has_shards and first_size is not None and size != first_size:
        raise WorldFixed(
            f"the job's model is sharded with FSDP2 over {first_size} ranks and the new world has {size}: "
            "hotspare does not re-shard, so it cannot shrink or grow an FSDP2 job; give the job spares "
            "(spec `spares:`) so a lost rank is replaced one for one, or resume it from its checkpoint "
            f"with {first_size} ranks")
