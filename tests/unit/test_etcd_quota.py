"""etcd's space quota reached (its NOSPACE alarm): etcd still answers reads, deletes and
keepalives but refuses every write. hotspare names it and what fixes it, says so once per
process, and waits for it where waiting is right (a finished rank's done mark)."""

from __future__ import annotations

import logging
import time

import grpc
import pytest

from hotspare.agents.worker_link import EXIT_ERROR
from hotspare.orchestrator.commands.observe import etcd_alarm
from hotspare.orchestrator.store import StoreError, StoreFull, StoreUnavailable
from hotspare.orchestrator.store.client import _translate
from hotspare.recovery.session import until_stored

from .test_node_agent import _exited_worker, _supervising_agent


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_write_refused_for_the_quota_is_store_full_naming_the_fix():
    with pytest.raises(StoreFull) as e, _translate("put /hotspare/j/done/0"):
        raise _RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded")
    assert str(e.value).startswith("etcd refused put /hotspare/j/done/0: its space quota is exhausted "
                                   "(etcdserver: mvcc: database space exceeded, the NOSPACE alarm)")
    assert "`etcdctl alarm disarm`" in str(e.value) and "--quota-backend-bytes" in str(e.value)
    with pytest.raises(StoreError) as other, _translate("put k"):  # another exhausted resource is not the quota
        raise _RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "grpc: received message larger than max")
    assert not isinstance(other.value, StoreFull)


def test_the_done_mark_waits_for_etcds_quota_to_be_freed_saying_so_once(caplog):
    caplog.set_level(logging.WARNING)
    calls = []

    def full_then_freed():
        calls.append(1)
        if len(calls) < 5:
            raise StoreFull("etcd refused put /done/0: its space quota is exhausted")

    # the deadline (an outage's) has long passed: a full etcd still answers, so the rank waits
    until_stored(full_then_freed, deadline=time.monotonic() - 1, pause=0.001)
    assert len(calls) == 5
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "space quota is exhausted" in said[0] and "waits to record it" in said[0]

    def down():
        raise StoreUnavailable("etcd gone")

    with pytest.raises(StoreUnavailable):  # an outage still has its deadline
        until_stored(down, deadline=time.monotonic() + 0.02, pause=0.001)


def test_an_exit_report_etcd_refuses_is_retried_every_poll_but_said_once(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    w = _exited_worker(tmp_path, 0, EXIT_ERROR)
    w.assign(rank=1, sid=1, epoch=2)
    agent, js, _ = _supervising_agent(monkeypatch, [w])

    def refuse(rep):
        raise StoreFull("etcd refused put /hotspare/j/reports/node3/1: its space quota is exhausted")

    monkeypatch.setattr(js, "report", refuse)
    for _ in range(5):
        agent._supervise()
    assert agent.workers == {0: w} and agent._retry, "kept, to be reported once etcd takes it"
    refused = [r.getMessage() for r in caplog.records if "could not report" in r.getMessage()]
    assert len(refused) == 1 and "space quota is exhausted" in refused[0]


class _Alarms:
    def __init__(self, names=None, error=None) -> None:
        self.names, self.error = names or [], error

    def alarms(self) -> list[str]:
        if self.error:
            raise self.error
        return self.names


def test_status_names_a_raised_nospace_alarm_and_its_fix():
    said = etcd_alarm(_Alarms(["NOSPACE"]))  # type: ignore[arg-type]
    assert said.startswith("etcd: its space quota is exhausted (NOSPACE alarm): it refuses every write")
    assert "`etcdctl defrag`" in said
    assert etcd_alarm(_Alarms()) == ""  # type: ignore[arg-type]
    assert etcd_alarm(_Alarms(error=StoreUnavailable("down"))) == ""  # type: ignore[arg-type]
    assert etcd_alarm(_Alarms(["CORRUPT"])) == "etcd: alarm(s) raised: CORRUPT (`etcdctl alarm list`)"  # type: ignore[arg-type]

