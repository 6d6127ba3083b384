"""The reconfigurable process group's construction, without etcd (an in-memory c10d store)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from hotspare.recovery.process_group import EpochSuperseded, ReconfigurableProcessGroup

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
    assert pg.healthy and (pg.epoch, pg.rank, pg.world_size) == (1, 0, 1)
