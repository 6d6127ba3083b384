"""The reconfigurable process group without etcd (an in-memory c10d store; real gloo)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hotspare.recovery.process_group import EpochSuperseded, ReconfigurableProcessGroup, register

pytestmark = pytest.mark.timeout(60)


def test_a_group_whose_member_never_connects_is_abandoned_when_a_new_epoch_comes():
    """Rank 1 never shows up (it died between the rendezvous and the connect): gloo's
    constructor would hold rank 0 for its whole timeout, without a heartbeat, and the agent's
    watchdog would kill it. A new epoch abandons the construction instead; rank 0 beat all
    along."""
    store = dist.HashStore()
    beats: list[int] = []
    pg = ReconfigurableProcessGroup(lambda e: dist.PrefixStore(f"epoch/{e}", store),
                                    timeout=timedelta(seconds=40), beat=lambda: beats.append(1))
    timer = threading.Timer(1.0, pg.supersede, args=(2,))
    timer.start()
    try:
        with pytest.raises(EpochSuperseded, match="superseded by 2 while its group was connecting"):
            pg.configure(1, 0, 2)
    finally:
        timer.cancel()
    assert len(beats) >= 2, "the worker must keep beating while its group connects"
    assert not pg.healthy


def test_a_group_of_one_is_built_and_usable():
    pg = ReconfigurableProcessGroup(lambda e: dist.PrefixStore(f"epoch/{e}", dist.HashStore()))
    pg.configure(1, 0, 1)
    assert pg.healthy and (pg.epoch, pg.rank(), pg.size()) == (1, 0, 1)


# -- the group as a torch.distributed.ProcessGroup ----------------------------------------
def _pair(store):
    """Two members of one gloo group in this process (each built in its own thread)."""
    groups = [ReconfigurableProcessGroup(lambda e: dist.PrefixStore(f"epoch/{e}", store), rank=r, world_size=2)
              for r in range(2)]
    threads = [threading.Thread(target=g.configure, args=(1, r, 2)) for r, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g.healthy for g in groups)
    return groups


def test_it_is_a_process_group_and_the_default_one():
    pg = ReconfigurableProcessGroup(lambda e: dist.PrefixStore(f"epoch/{e}", dist.HashStore()), rank=0, world_size=1)
    register(pg)
    assert isinstance(pg, dist.ProcessGroup)
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    assert dist.get_backend() == "gloo" and pg.group_name == "hotspare"
    pg.configure(1, 0, 1)
    t = torch.full((3,), 2.0)
    dist.all_reduce(t)  # the default group: through the wrapper
    assert torch.equal(t, torch.full((3,), 2.0)) and pg.healthy


def test_before_the_first_join_ddp_constructs_and_other_collectives_say_what_to_do():
    """DDP's constructor runs before session.steps(): its shape check and broadcast complete
    locally. Any other collective before the loop is an error that says where it belongs."""
    pg = ReconfigurableProcessGroup(lambda e: dist.PrefixStore(f"epoch/{e}", dist.HashStore()), rank=1, world_size=3)
    DistributedDataParallel(torch.nn.Linear(4, 4), process_group=pg)
    assert pg.prejoin_ops[0] == "allgather" and "broadcast" in pg.prejoin_ops
    with pytest.raises(RuntimeError, match=r"allreduce .*before session.steps\(\) started.*move the collective into"):
        pg.allreduce([torch.ones(2)])


def test_a_superseded_collective_completes_at_once_and_leaves_the_callers_tensor_alone():
    """Rank 1 never joins rank 0's allreduce: when a newer epoch is announced, rank 0's work
    completes anyway (no hang), the step is marked failed, and when rank 1 finally does take
    part in the old epoch's collective, gloo writes into the abandoned staging copy, never
    into rank 0's tensor."""
    g0, g1 = _pair(dist.HashStore())
    mine = torch.full((4,), 1.0)
    work = g0.allreduce([mine])
    assert not work.is_completed()
    threading.Timer(0.5, g0.supersede, args=(2,)).start()
    assert work.wait() is True  # returns: completed by the supersede
    assert work.is_completed() and not g0.healthy and "abandoned" in g0.error
    late = g1.allreduce([torch.full((4,), 5.0)])  # the old epoch's partner shows up
    late.wait()
    time.sleep(0.2)
    assert torch.equal(mine, torch.full((4,), 1.0)), "an abandoned collective wrote into the caller's tensor"


def test_collectives_of_a_healthy_pair_give_torchs_results():
    g0, g1 = _pair(dist.HashStore())
    out = [torch.zeros(2), torch.zeros(2)]

    def member(g, val):
        t = torch.full((2,), float(val))
        g.allreduce([t]).wait()
        o = torch.zeros(4)
        g.all_gather_single(o, torch.full((2,), float(val))).wait()
        r = torch.zeros(1)
        g.reduce_scatter_single(r, torch.tensor([val, 10.0 * val])).wait()
        out[g.rank()] = (t, o, r)

    ts = [threading.Thread(target=member, args=(g, v)) for g, v in ((g0, 1), (g1, 2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    (t0, o0, r0), (t1, o1, r1) = out
    assert torch.equal(t0, torch.full((2,), 3.0)) and torch.equal(t1, t0)
    assert torch.equal(o0, torch.tensor([1.0, 1.0, 2.0, 2.0])) and torch.equal(o1, o0)
    assert r0.item() == 3.0 and r1.item() == 30.0
    assert g0.healthy and g1.healthy
