"""A worker tells a code error (the job fails by default) from an exception its training
function raised only because something under it broke (a crash, recovered like a lost
worker): :func:`hotspare.agents.worker.not_the_code`. No processes: a stand-in session
carries what the worker looks at (its process group's recorded failure, its epoch, the
newest epoch in etcd)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from hotspare.agents.worker import not_the_code
from hotspare.orchestrator.store import StoreUnavailable
from hotspare.orchestrator.store.c10d import RendezvousAborted
from hotspare.orchestrator.util import atomic_write
from hotspare.recovery.process_group import EpochSuperseded, GroupBroken


def session(error: str | None = None, epoch: int = 2, newest: int = 2) -> SimpleNamespace:
    return SimpleNamespace(process_group=SimpleNamespace(error=error), epoch=epoch,
                           link=SimpleNamespace(check_epoch=lambda: newest))


def raised(make) -> BaseException:
    try:
        make()
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("it did not raise")


def _boom():
    raise ValueError("boom")


def _raise_while_handling(first: BaseException):
    try:
        raise first
    except BaseException:  # noqa: BLE001
        raise KeyError("loss")  # noqa: B904 - the implicit context is the point


def test_a_plain_exception_of_the_code_is_a_code_error():
    assert not_the_code(raised(_boom), session()) == ""
    assert not_the_code(raised(lambda: open("/nonexistent/data.bin")), session()) == "", \
        "the user's own I/O failing is the user's to fix"
    assert not_the_code(raised(_boom), session(epoch=0, newest=1)) == "", \
        "before the first join the target epoch is always newer: no reason"


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"),
        RuntimeError("NCCL communicator was aborted"),
        dist.DistBackendError("c10d timed out"),
        EpochSuperseded("epoch 3 superseded by 4"),
        GroupBroken("collective failed (None) and no new epoch came within hang_timeout"),
        RendezvousAborted("epoch moved on"),
        StoreUnavailable("etcd down"),
    ],
    ids=["gloo-peer-died", "nccl", "dist-error", "superseded", "gave-up", "rendezvous", "etcd"],
)
def test_a_collective_or_etcd_failing_under_the_code_is_not_a_code_error(exc):
    assert not_the_code(exc, session())
    assert not_the_code(raised(lambda: _raise_while_handling(exc)), session()), \
        "also when the code raised while handling it"


def test_hotspare_own_io_failing_is_not_a_code_error(tmp_path):
    e = raised(lambda: atomic_write(tmp_path / "no" / "such" / "dir" / "f", b"x"))
    assert isinstance(e, OSError)
    assert not_the_code(e, session()) == "hotspare's own I/O failed"


def test_a_step_computed_on_a_broken_group_is_not_a_code_error():
    assert "its process group failed (allreduce failed)" in not_the_code(raised(_boom), session(error="allreduce failed"))
    assert not_the_code(raised(_boom), session(epoch=2, newest=3)) == "epoch 2 was superseded"


def test_the_done_mark_is_retried_through_an_etcd_outage():
    """Security review F21: mark_done sat outside any StoreError guard, so an etcd outage at
    the moment a rank finished turned it into a crash (exit 1), handled as a failure."""
    from hotspare.orchestrator.store import StoreUnavailable
    from hotspare.recovery.session import until_stored

    calls, beats = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise StoreUnavailable("etcd down")

    until_stored(flaky, deadline=time.monotonic() + 30, beat=lambda: beats.append(1), pause=0.01)
    assert len(calls) == 3 and len(beats) == 2

    def down():
        raise StoreUnavailable("etcd gone for good")

    with pytest.raises(StoreUnavailable, match="gone for good"):
        until_stored(down, deadline=time.monotonic() + 0.05, pause=0.01)
