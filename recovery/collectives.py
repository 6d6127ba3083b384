"""What torch calls on the job's process group, and the work it gets back.

:class:`TorchCollectives` is the ``torch.distributed.ProcessGroup`` collective API (the names
torch's pybind trampoline and ``torch.distributed``'s functions call, old and new), each
forwarded through :meth:`ReconfigurableProcessGroup._collective`, which applies the group's
rules (see :mod:`hotspare.recovery.process_group`). :class:`HotspareWork` is the work they
return. :func:`register` puts the group in torch's registry as the default group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

if TYPE_CHECKING:
    from .process_group import ReconfigurableProcessGroup

GROUP_NAME = "hotspare"
BACKEND_NAME = "hotspare"


class Op:
    """One collective in flight: the future handed out, the caller's tensors it writes,
    and the staged copies the backend writes instead (gloo)."""

    __slots__ = ("what", "fut", "outputs", "staged", "work", "done")

    def __init__(self, what: str, outputs: list[torch.Tensor], staged: list[torch.Tensor]) -> None:
        self.what = what
        self.fut: torch.futures.Future = torch.futures.Future()
        self.outputs = outputs
        self.staged = staged
        self.work: dist.Work | list[dist.Work] | None = None
        self.done = False


class HotspareWork(dist.Work):
    """The work a collective on the stable group returns: it always completes (with the
    result, or with the caller's tensors untouched when the collective was abandoned).
    ``wait()`` keeps the worker's heartbeat going while it blocks."""

    def __init__(self, group: ReconfigurableProcessGroup, fut: torch.futures.Future,
                 device_work: dist.Work | None = None) -> None:
        super().__init__()
        self._group = group
        self._fut = fut
        self._device_work = device_work  # NCCL: its wait() makes the current stream wait

    def wait(self, timeout: object = None) -> bool:
        if self._device_work is not None:
            self._fut.wait()  # stream semantics, never raises (see the group's _chained)
            return True
        self._group._wait(self._fut)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done()

    def exception(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class TorchCollectives:
    """The collectives of ``torch.distributed.ProcessGroup`` (mixed into the group)."""

    backend_name: str
    device: torch.device
    _collective: Callable[..., HotspareWork]

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> HotspareWork:
        opts = options(opts, c10d.AllreduceOptions, "reduceOp")
        return self._collective("allreduce", tensors, lambda pg, t: pg.allreduce(t, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        return self._collective("allreduce_coalesced", tensors, lambda pg, t: pg.allreduce_coalesced(t, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        return self._collective("broadcast", tensors, lambda pg, t: pg.broadcast(t, opts), prejoin=lambda: None)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        flat = [t for o in output_tensors for t in o]

        def launch(pg: dist.ProcessGroup, staged: list[torch.Tensor]) -> dist.Work:
            return pg.allgather(nest(staged, output_tensors), input_tensors, opts)

        def local() -> None:  # every rank "sent" this rank's tensor (DDP's shape check)
            for outs, x in zip(output_tensors, input_tensors, strict=True):
                for o in outs:
                    o.copy_(x)

        return self._collective("allgather", flat, launch, prejoin=local)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> HotspareWork:  # noqa: A002
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._collective("allgather_into_tensor", [output],
                                lambda pg, t: backend_method(pg, "all_gather_single", "_allgather_base")(t[0], input, opts))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._collective("allgather_into_tensor_coalesced", outputs,
                                lambda pg, t: [backend_method(pg, "all_gather_single", "_allgather_base")(o, i, opts)
                                               for o, i in zip(t, inputs, strict=True)])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> HotspareWork:  # noqa: A002
        opts = options(opts, c10d.ReduceScatterOptions, "reduceOp")
        return self._collective("reduce_scatter_tensor", [output],
                                lambda pg, t: backend_method(pg, "reduce_scatter_single", "_reduce_scatter_base")(t[0], input, opts))

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> HotspareWork:
        opts = options(opts, c10d.ReduceScatterOptions, "reduceOp")
        return self._collective("reduce_scatter_tensor_coalesced", outputs,
                                lambda pg, t: [backend_method(pg, "reduce_scatter_single", "_reduce_scatter_base")(o, i, opts)
                                               for o, i in zip(t, inputs, strict=True)])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> HotspareWork:
        opts = options(opts, c10d.ReduceScatterOptions, "reduceOp")
        return self._collective("reduce_scatter", outputs, lambda pg, t: pg.reduce_scatter(t, inputs, opts))

    # torch 2.13 names the single-tensor and coalesced forms anew; older torch uses the
    # underscore names above. Both are served.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.ReduceOptions()
        return self._collective("reduce", tensors, lambda pg, t: pg.reduce(t, opts))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.GatherOptions()
        flat = [t for o in outputs for t in o]
        return self._collective("gather", flat, lambda pg, t: pg.gather(nest(t, outputs), inputs, opts))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.ScatterOptions()
        return self._collective("scatter", outputs, lambda pg, t: pg.scatter(t, inputs, opts))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        return self._collective("alltoall", outputs, lambda pg, t: pg.alltoall(t, inputs, opts))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                          input_split_sizes: list[int], opts: Any = None) -> HotspareWork:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        return self._collective("all_to_all_single", [output], lambda pg, t: backend_method(pg, "all_to_all_single", "alltoall_base")(
            t[0], input, output_split_sizes, input_split_sizes, opts))

    alltoall_base = all_to_all_single

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> HotspareWork:
        return self._collective("send", [], lambda pg, _t: pg.send(tensors, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> HotspareWork:
        return self._collective("recv", tensors, lambda pg, t: pg.recv(t, src, tag))

    def barrier(self, opts: Any = None) -> HotspareWork:
        return self._collective("barrier", [], lambda pg, _t: pg.allreduce([torch.zeros(1, device=self.device)]))


def future_of(work: dist.Work, what: str) -> torch.futures.Future:
    """A future that completes with ``work`` (gloo's reduce-scatter has none: a thread waits)."""
    try:
        return work.get_future()
    except RuntimeError:
        f: torch.futures.Future = torch.futures.Future()

        def waiter() -> None:
            try:
                work.wait()
                f.set_result(None)
            except Exception as e:  # noqa: BLE001 - handed to the future
                f.set_exception(e)

        threading.Thread(target=waiter, name=f"hotspare-{what}", daemon=True).start()
        return f


def backend_method(pg: dist.ProcessGroup, *names: str) -> Callable[..., dist.Work]:
    """The backend's method by its newest name (torch renamed several in 2.13)."""
    for n in names:
        fn = getattr(pg, n, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"the {pg._get_backend_name()} backend has none of {names}")


def nest(flat: list[torch.Tensor], like: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    out, i = [], 0
    for o in like:
        out.append(flat[i:i + len(o)])
        i += len(o)
    return out


def options(opts: Any, cls: type, field: str) -> Any:
    """torch's Python collectives pass an options object; a bare ReduceOp is accepted."""
    if opts is None:
        return cls()
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        o = cls()
        setattr(o, field, opts)
        return o
    return opts


def register(pg: ReconfigurableProcessGroup) -> None:
    """Make ``pg`` torch's default process group, and record its current ranks, so that
    ``dist.get_rank()``, ``dist.all_reduce(t)``, ``DeviceMesh.from_group`` and functional
    collectives find it. Redone at every epoch: a shrink or grow changes the size. (torch's
    registry is private API; tests/unit/test_process_group.py pins what it needs.)"""
    w = c10d._world
    w.pg_map[pg] = (pg.backend_name, None)
    w.pg_names[pg] = GROUP_NAME
    w.pg_backend_config[pg] = pg.backend_name
    w.pg_group_ranks[pg] = {i: i for i in range(pg.size())}
    if w.pg_to_tag.get(pg) is None:
        w.tags_to_pg.setdefault("", []).append(pg)
        w.tags_to_pg.setdefault(f"ptd:{GROUP_NAME}", []).append(pg)
        w.pg_to_tag[pg] = f"ptd:{GROUP_NAME}"
        try:
            c10d._register_process_group(GROUP_NAME, pg)
        except Exception:  # noqa: BLE001 - already registered (a second session in a test process)
            c10d._unregister_process_group(GROUP_NAME)
            c10d._register_process_group(GROUP_NAME, pg)
    if w.default_pg is None or w.default_pg is pg or isinstance(w.default_pg, TorchCollectives):
        c10d._update_default_pg(pg)
