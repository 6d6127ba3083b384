"""A job's keys in etcd and typed access to them.

Layout (see docs/architecture.md):

    /hotspare/<job>/spec               validated job spec (JSON)          CLI
    /hotspare/<job>/secret             HMAC secret for peer traffic        CLI
    /hotspare/<job>/state              {"state", "message", "time"}        controller
    /hotspare/<job>/cancel             cancellation request                 CLI
    /hotspare/<job>/leader             controller id, under its lease       controller
    /hotspare/<job>/checkpoint         {"step"} to persist out of schedule  CLI (hotspare checkpoint)
    /hotspare/<job>/failures           handled failures, for the guards     controller (decision txn)
    /hotspare/<job>/epoch              current world version                controller (txn)
    /hotspare/<job>/world/<epoch>      rank -> node table                   controller (same txn)
    /hotspare/<job>/world_change       what changed since the last world    controller (same txn)
    /hotspare/<job>/nodes/<node>       live agent, under its lease          agent
    /hotspare/<job>/reports/<node>/<r> a worker is gone                     agent
    /hotspare/<job>/done/<rank>        rank finished all steps              worker
    /hotspare/<job>/chaos/<node>/<id>  failure to inject                    CLI / worker
    /hotspare/<job>/fired/<n>          scheduled chaos entry n already fired worker
    /hotspare-events/<job>/<t>-<id>    the timeline                         everyone
    /hotspare-progress/<job>/<rank>    last step, every second               worker
    /hotspare-rdzv/<job>/...           process-group rendezvous keys        workers

Events, progress and rendezvous keys live outside the job prefix: a snapshot read of the
control state stays small however long the job runs, and the agents' and controller's
watches on the job prefix are not woken by every rank's progress report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable

from hotspare.orchestrator.spec import JobSpec

from . import events
from .client import KV, Compare, Lease, Store
from .errors import Conflict
from .records import (
    Event,
    EventKind,
    Failure,
    JobState,
    Node,
    Progress,
    Report,
    StateRecord,
    World,
    WorldChange,
)
from .snapshot import (  # noqa: F401 - CONTROLLER, JobSnapshot and parse_snapshot are re-exported
    CONTROLLER,
    PARSE_ERRORS,
    JobKeys,
    JobSnapshot,
    log_bad_once,
    parse_snapshot,
)

log = logging.getLogger("hotspare.store")



class MissingSecret(RuntimeError):
    """The job's secret is missing from etcd, or too short to be a key."""


#: worlds kept in etcd: the current one and the ones before it, back this far (a spare
#: looks for the node that last ran its seat up to PeerReplicas.LOOKBACK = 8 epochs back);
#: each decision deletes the one that falls out (680 KB each at 10,000 ranks)
KEEP_WORLDS = 16


def _range_end(prefix: str) -> str:
    """The end of ``prefix``'s key range (every hotspare prefix ends in "/")."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class JobStore:
    """Typed operations on one job's keys."""

    def __init__(self, store: Store, job: str) -> None:
        self.store = store
        self.job = job
        self.keys = JobKeys(job)

    def snapshot(self, progress: bool = True) -> JobSnapshot:
        """The control state at one revision, with (unless asked not to) the ranks' latest
        progress records.

        Of the worlds only the current one is read (the others are history: 680 KB each at
        10,000 ranks; a prefix read of them all outgrew gRPC's 4 MB answers after three
        decisions in benchmarks/scale.py): the rest of the prefix and the progress records in
        one transaction, then the world of the epoch it holds -- written once, in the txn that
        wrote that epoch. Two requests."""
        p, worlds = self.keys.prefix, self.keys.world(0).rsplit("/", 1)[0]  # .../world
        ranges = [(p, worlds + "/"), (worlds + "0", _range_end(p))]
        if progress:
            ranges.append((self.keys.progress_prefix, _range_end(self.keys.progress_prefix)))
        kvs = self.store.get_many([], ranges=ranges)
        epoch = next((kv for kv in kvs if kv.key == self.keys.epoch), None)
        if epoch is not None:
            try:
                world = self.store.get(self.keys.world(int(epoch.value)))
            except ValueError:
                world = None  # parse_snapshot names the bad epoch record
            if world is not None:
                kvs.append(world)
        return parse_snapshot(self.job, kvs, 0)

    def with_progress(self, snap: JobSnapshot, kvs: Iterable[KV]) -> JobSnapshot:
        """``snap`` with ``kvs`` (a watch's puts under the progress prefix) put over its progress
        records: no request."""
        return dataclasses.replace(snap, progress={**snap.progress, **parse_snapshot(self.job, list(kvs), 0).progress})

    def agent_keys(self, node: str) -> tuple[list[str], list[str]]:
        """(keys, prefixes) a node agent acts on. Not the whole job: node records come and go
        and reports are written all the time, and a watch on the prefix woke every agent for
        each of them -- O(N) wake-ups and reads of O(N) records per agent, O(N^2) in all
        (benchmarks/scale.py: 1,000 agents never finished starting)."""
        k = self.keys
        return [k.spec, k.state, k.cancel, k.checkpoint, k.epoch, k.node(node)], [k.chaos_node_prefix(node)]

    def agent_watches(self, node: str) -> tuple[list[str], list[str]]:
        """(keys, prefixes) a node agent watches: :meth:`agent_keys`, with the world's change
        (whose events carry it: :meth:`follow_change`) in place of the epoch key, which is
        written in the same txn."""
        keys, prefixes = self.agent_keys(node)
        return [self.keys.world_change if key == self.keys.epoch else key for key in keys], prefixes

    def follow_change(self, previous: JobSnapshot | None, kv: KV) -> JobSnapshot | None:
        """``previous`` moved on to the world that ``kv`` -- the :class:`WorldChange` record,
        as a watch delivered it -- describes, without reading etcd; None if the change does
        not apply to ``previous``'s world (read the job then: :meth:`agent_snapshot`). The
        epoch key is written in the same txn, so its revision is the record's."""
        if previous is None or kv.key != self.keys.world_change:
            return None
        try:
            change = WorldChange.from_json(kv.value)
        except PARSE_ERRORS:
            return None
        if change.epoch <= previous.epoch or not change.applies_to(previous.world, previous.epoch_mod):
            return None
        return dataclasses.replace(previous, epoch=change.epoch, epoch_mod=kv.mod_revision,
                                   world=change.apply(previous.world), world_change=change)  # type: ignore[arg-type]

    def agent_snapshot(self, node: str, previous: JobSnapshot | None = None) -> JobSnapshot:
        """What :meth:`agent_keys` names plus the current world, whatever the number of nodes.
        ``nodes`` holds this node's record only (see :meth:`nodes`).

        ``previous`` is this agent's last snapshot: its world is reused if it is still the
        current one, or patched with the :class:`WorldChange` written with the new one -- one
        round trip and O(changed seats) parsed. Only a world that cannot be derived that way
        (the first, a missed epoch, a shrink) is read in full: a second round trip and O(N)."""
        keys, prefixes = self.agent_keys(node)
        kvs = self.store.get_many([*keys, self.keys.world_change], prefixes)
        snap = parse_snapshot(self.job, kvs, 0)
        if not snap.epoch:
            return snap
        known, known_rev = (previous.world, previous.epoch_mod) if previous is not None else (None, 0)
        change = snap.world_change
        if known is not None and (known.epoch, known_rev) == (snap.epoch, snap.epoch_mod):
            snap.world = known
        elif change is not None and change.epoch == snap.epoch and change.applies_to(known, known_rev):
            snap.world = change.apply(known)  # type: ignore[arg-type]
        else:
            world = self.store.get(self.keys.world(snap.epoch))
            if world is not None:
                snap = parse_snapshot(self.job, [*kvs, world], 0)
        return snap

    def nodes(self, names: Iterable[str]) -> dict[str, Node]:
        """The live node records of ``names`` (one round trip); a record that does not parse
        is left out (and logged once), as in :func:`parse_snapshot`."""
        kvs = self.store.get_many([self.keys.node(n) for n in names])
        return parse_snapshot(self.job, kvs, 0).nodes

    def exists(self) -> bool:
        return self.store.get(self.keys.spec) is not None

    def spec(self) -> JobSpec | None:
        kv = self.store.get(self.keys.spec)
        return JobSpec.from_json(kv.value) if kv else None

    def secret(self) -> bytes:
        """The job's HMAC key for the replica wire. Fails closed: a missing or short secret
        (a key anyone could compute) is an error, never an empty key."""
        kv = self.store.get(self.keys.secret)
        if kv is None or len(kv.value) < 16:
            raise MissingSecret(f"job {self.job} has no usable secret in etcd ({'none' if kv is None else f'{len(kv.value)} bytes'}"
                                "; at least 16 are needed): its records are incomplete or were tampered with; "
                                "resubmit the job")
        return kv.value

    def epoch(self) -> int:
        kv = self.store.get(self.keys.epoch)
        return int(kv.value) if kv else 0

    def world(self, epoch: int) -> World | None:
        kv = self.store.get(self.keys.world(epoch))
        return World.from_json(kv.value) if kv else None

    def state(self) -> tuple[JobState, str]:
        kv = self.store.get(self.keys.state)
        if not kv:
            return JobState.PENDING, ""
        rec = StateRecord.from_json(kv.value)
        return rec.job_state, rec.message

    # -- writes -----------------------------------------------------------------------
    def submit(self, spec: JobSpec | dict, secret: bytes) -> str:
        """Create the job; returns its run id (the spec's, or a new one when it has none).
        Fails with Conflict if a job of that name is not finished."""
        spec = (spec if isinstance(spec, JobSpec) else JobSpec.from_dict(spec)).to_dict()  # every reader parses it
        spec["run_id"] = spec.get("run_id") or new_run_id()
        state, _ = self.state() if self.exists() else (None, "")
        if state is not None and not state.terminal:
            raise Conflict(f"job {self.job!r} exists and is {state.value}")
        if state is not None:  # a finished job of the same name: its records are replaced
            self.delete()
        ok = self.store.txn(
            [Compare(self.keys.spec, "create", "==", 0)],
            puts={
                self.keys.spec: json.dumps(without_secrets(spec), sort_keys=True),
                self.keys.secret: secret,
                self.keys.state: StateRecord("pending", time.time()).to_json(),
            },
        )
        if not ok:
            raise Conflict(f"job {self.job!r} was submitted concurrently")
        return spec["run_id"]

    def delete(self) -> None:
        """Remove every record of the job (a finished one being replaced, or one whose launch
        failed before anything ran)."""
        for prefix in (self.keys.prefix, self.keys.progress_prefix, self.keys.events_prefix,
                       self.keys.rdzv_prefix):
            self.store.delete_prefix(prefix)

    def register_node(self, node: Node, lease: Lease) -> None:
        self.store.put(self.keys.node(node.name), node.to_json(), lease=lease)

    def report(self, rep: Report) -> None:
        self.store.put(self.keys.report(rep.node, rep.rank), rep.to_json())

    def mark_done(self, rank: int, epoch: int, step: int) -> None:
        self.store.put(self.keys.done(rank), json.dumps({"epoch": epoch, "step": step}))

    def put_progress(self, pr: Progress) -> None:
        self.store.put(self.keys.progress(pr.rank), pr.to_json())

    def request_cancel(self) -> None:
        self.store.put(self.keys.cancel, str(time.time()))

    def event(self, kind: EventKind | str, source: str, message: str = "", /, **data: object) -> Event:
        """Write an event of any kind now (the typed constructors are in :mod:`.events`)."""
        ev = events.make(kind, source, message, **data)
        self.put_event(ev)
        return ev

    def put_event(self, ev: Event) -> None:
        """Write one timeline event, keyed by its own time (a queued event keeps its order)."""
        self.store.put(self.keys.event(int(ev.time * 1e9)), ev.to_json())

    def request_checkpoint(self, step: int) -> None:
        """Ask every agent to persist replication point ``step`` out of schedule."""
        self.store.put(self.keys.checkpoint, json.dumps({"step": int(step)}))

    def fire_once(self, index: int) -> bool:
        """Claim scheduled chaos entry ``index``: True for exactly one caller, ever (a step
        recomputed after a rollback must not fire its failure again)."""
        return self.store.create(self.keys.fired(index), str(time.time()))

    def node_registered(self, node: str) -> bool:
        """Whether ``node``'s agent is registered (its key is there: its lease has not expired)."""
        return self.store.get(self.keys.node(node)) is not None

    def deregister_node(self, node: str) -> None:
        """Remove an agent's node key now (a clean exit), instead of when its lease expires."""
        self.store.delete(self.keys.node(node))

    def try_lead(self, ident: str, lease: Lease, seen: JobSnapshot | None = None) -> tuple[bool, bool]:
        """(leading, just_took): whether ``ident`` holds the job's leader key, and whether
        this call created it. The key lives under ``lease``: a dead leader's key expires and
        a standby's next call takes it. ``seen``: a snapshot just read, whose leader is taken
        instead of reading the key again (whatever a leader writes is fenced on the key)."""
        if seen is not None:
            holder = seen.leader
        else:
            kv = self.store.get(self.keys.leader)
            holder = kv.value.decode() if kv is not None else None
        if holder is not None:
            return holder == ident, False
        took = self.store.create(self.keys.leader, ident, lease=lease)
        return took, took

    def set_state(self, state: JobState, message: str, *, leader: str,
                  clear_reports: Iterable[tuple[str, int]] = (), error: str = "",
                  failures: Iterable[Failure] | None = None) -> bool:
        """Record a final state (its sentence, and ``error``: the evidence), only while
        ``leader`` still leads (CAS on the leader key), deleting the reports
        ``clear_reports`` names (``(node, rank)``) and writing ``failures`` (the whole
        history, when given) in the same txn."""
        puts: dict[str, bytes | str] = {
            self.keys.state: StateRecord(state.value, time.time(), message, error).to_json()}
        if failures is not None:
            puts[self.keys.failures] = _failures_json(failures)
        return self.store.txn([self._leader_guard(leader)], puts=puts,
                              deletes=self._report_keys(clear_reports))

    # -- decisions: compare-and-set on what the decision was based on ---------------------
    def commit_decision(self, snap: JobSnapshot, world: World, *, leader: str,
                        state: JobState | None = None,
                        clear_reports: Iterable[tuple[str, int]] = (),
                        failures: Iterable[Failure] | None = None) -> bool:
        """Make ``world`` the current one (epoch key and world record in one txn), optionally
        set the job's ``state``, delete reports ``(node, rank)`` it handled and write the
        failure history ``failures`` (the whole of it: the snapshot's plus the new ones).
        The world :data:`KEEP_WORLDS` epochs older is deleted.

        Fenced twice: on the epoch key's revision read in ``snap`` (a decision based on a
        world that has moved on since is refused, so two controllers can never both write
        the next epoch) and on ``leader`` still holding the job's leader key. False when
        refused: re-read and decide again."""
        puts: dict[str, bytes | str] = {
            self.keys.epoch: str(world.epoch),
            self.keys.world(world.epoch): world.to_json(),
            self.keys.world_change: WorldChange.between(snap.world if snap.world and snap.world.epoch == snap.epoch
                                                        else None, snap.epoch_mod, world).to_json(),
        }
        if state is not None:
            puts[self.keys.state] = StateRecord(state.value, time.time()).to_json()
        if failures is not None:
            puts[self.keys.failures] = _failures_json(failures)
        old = [self.keys.world(world.epoch - KEEP_WORLDS)] if world.epoch > KEEP_WORLDS else []
        return self.store.txn(self._decision_fence(snap, leader), puts=puts,
                              deletes=self._report_keys(clear_reports) + old)

    def clear_reports(self, snap: JobSnapshot, reports: Iterable[tuple[str, int]], *,
                      leader: str) -> bool:
        """Delete reports ``(node, rank)`` that a decision found stale or handled without a
        new world, under the same fence as :meth:`commit_decision`: only the leader, and only
        while the world is still the one the decision judged them against. True if there was
        nothing to delete."""
        keys = self._report_keys(reports)
        if not keys:
            return True
        return self.store.txn(self._decision_fence(snap, leader), deletes=keys)

    def _decision_fence(self, snap: JobSnapshot, leader: str) -> list[Compare]:
        epoch_guard = (
            Compare(self.keys.epoch, "mod", "==", snap.epoch_mod)
            if snap.epoch_mod
            else Compare(self.keys.epoch, "create", "==", 0)
        )
        return [epoch_guard, self._leader_guard(leader)]

    def _leader_guard(self, leader: str) -> Compare:
        return Compare(self.keys.leader, "value", "==", leader.encode())

    def _report_keys(self, reports: Iterable[tuple[str, int]]) -> list[str]:
        return [self.keys.report(node, rank) for node, rank in reports]

    def events(self) -> list[Event]:
        """The job's timeline, oldest first; an event that does not parse is skipped (logged)."""
        return self.events_since(0)[0]

    def events_since(self, revision: int) -> tuple[list[Event], int]:
        """The events written after etcd ``revision`` (0: all), oldest first, and the
        revision read at: a follower passes it back and reads only what is new (by revision,
        not by key: an event queued through an outage keeps its older time, and key)."""
        kvs, rev = self.store.get_prefix(self.keys.events_prefix, since=revision)
        out = []
        for kv in kvs:
            try:
                out.append(Event.from_json(kv.value))
            except PARSE_ERRORS as e:
                log_bad_once(kv, f"{type(e).__name__}: {e}")
        out.sort(key=lambda e: e.time)
        return out, rev

    def send_chaos(self, node: str, command: dict) -> str:
        cid = f"{time.time_ns():020d}-{os.urandom(2).hex()}"
        self.store.put(self.keys.chaos(node, cid), json.dumps(command))
        return cid

    def take_chaos(self, node: str) -> list[dict]:
        """Pop every pending chaos command for ``node`` (each is executed once)."""
        kvs, _ = self.store.get_prefix(self.keys.chaos_node_prefix(node))
        out = []
        for kv in kvs:
            if self.store.txn(
                [Compare(kv.key, "mod", "==", kv.mod_revision)], deletes=[kv.key]
            ):
                try:
                    cmd = json.loads(kv.value)
                except ValueError as e:
                    cmd = e
                if isinstance(cmd, dict):
                    out.append(cmd)
                else:  # taken (deleted) all the same: a bad command is not retried forever
                    log_bad_once(kv, f"not a chaos command: {cmd}")
        return out


#: The most failures the history keeps (the oldest go first): the guards look at a window.
FAILURE_HISTORY = 200


def _failures_json(failures: Iterable[Failure]) -> str:
    kept = list(failures)[-FAILURE_HISTORY:]
    return json.dumps([json.loads(f.to_json()) for f in kept], sort_keys=True)


def new_run_id() -> str:
    """A run id: sortable by submission time, unique (``20261203-154330-3fa2``)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(2).hex()


def without_secrets(spec: dict) -> dict:
    """The spec as it may be stored: every reader of etcd sees the spec, so the etcd password
    is dropped (processes get it from their environment, see docs/security.md)."""
    etcd = spec.get("etcd")
    if isinstance(etcd, dict) and etcd.get("password") is not None:
        spec = {**spec, "etcd": {**etcd, "password": None}}
    return spec


def list_runs(store: Store) -> dict[str, str]:
    """Each job in this etcd -> the run id of its current submission ("" for a job submitted
    before run ids); one read of the job prefixes, like :func:`list_jobs`."""
    kvs, _ = store.get_prefix("/hotspare/")
    runs = {}
    for kv in kvs:
        parts = kv.key.split("/")
        if len(parts) == 4 and parts[3] == "spec":
            try:
                runs[parts[2]] = str(json.loads(kv.value).get("run_id") or "")
            except (ValueError, AttributeError):
                runs[parts[2]] = ""
    return runs


def list_jobs(store: Store) -> list[str]:
    """Names of all jobs in this etcd (one key read per job: its spec)."""
    kvs, _ = store.get_prefix("/hotspare/")
    names = []
    for kv in kvs:
        parts = kv.key.split("/")
        if len(parts) == 4 and parts[3] == "spec":
            names.append(parts[2])
    return names
