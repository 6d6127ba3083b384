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

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from hotspare.orchestrator.spec import JobSpec

from . import events
from .client import KV, Compare, Lease, Store
from .errors import Conflict
from .records import (
    BadRecord,
    Event,
    EventKind,
    Failure,
    JobState,
    Node,
    Progress,
    Report,
    StateRecord,
    World,
)

log = logging.getLogger("hotspare.store")

#: The chaos "node" name of the leader controller (``hotspare chaos --action kill-controller``).
CONTROLLER = "_controller"


@dataclass(frozen=True)
class JobKeys:
    job: str

    @property
    def prefix(self) -> str:
        return f"/hotspare/{self.job}/"

    @property
    def spec(self) -> str:
        return self.prefix + "spec"

    @property
    def secret(self) -> str:
        return self.prefix + "secret"

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def cancel(self) -> str:
        return self.prefix + "cancel"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def epoch(self) -> str:
        return self.prefix + "epoch"

    @property
    def checkpoint(self) -> str:
        return self.prefix + "checkpoint"

    @property
    def failures(self) -> str:
        return self.prefix + "failures"

    def world(self, epoch: int) -> str:
        return f"{self.prefix}world/{epoch:08d}"

    def node(self, node: str) -> str:
        return f"{self.prefix}nodes/{node}"

    def report(self, node: str, rank: int) -> str:
        return f"{self.prefix}reports/{node}/{rank}"

    def done(self, rank: int) -> str:
        return f"{self.prefix}done/{rank}"

    def progress(self, rank: int) -> str:
        return f"{self.progress_prefix}{rank}"

    @property
    def progress_prefix(self) -> str:
        return f"/hotspare-progress/{self.job}/"

    def chaos(self, node: str, cid: str) -> str:
        return f"{self.prefix}chaos/{node}/{cid}"

    def chaos_node_prefix(self, node: str) -> str:
        return f"{self.prefix}chaos/{node}/"

    def fired(self, index: int) -> str:
        return f"{self.prefix}fired/{index}"

    def event(self, t_ns: int) -> str:
        return f"{self.events_prefix}{t_ns:020d}-{os.urandom(3).hex()}"

    @property
    def events_prefix(self) -> str:
        return f"/hotspare-events/{self.job}/"

    @property
    def rdzv_prefix(self) -> str:
        return f"/hotspare-rdzv/{self.job}/"


@dataclass
class JobSnapshot:
    """Everything the controller needs about one job, read at one etcd revision."""

    job: str
    revision: int
    spec: JobSpec | None = None
    state: JobState = JobState.PENDING
    state_message: str = ""
    state_error: str = ""  # the final state's evidence (a traceback's end), if any
    cancel: bool = False
    leader: str | None = None
    epoch: int = 0
    epoch_mod: int = 0  # mod_revision of the epoch key (0: absent): the fence for decisions
    world: World | None = None
    nodes: dict[str, Node] = field(default_factory=dict)
    reports: list[Report] = field(default_factory=list)
    done: dict[int, dict] = field(default_factory=dict)
    progress: dict[int, Progress] = field(default_factory=dict)
    chaos: dict[str, list[str]] = field(default_factory=dict)
    checkpoint: int | None = None  # step `hotspare checkpoint` asked to persist
    failures: tuple[Failure, ...] = ()  # handled failures of this run, oldest first
    #: when it was read (the controller stamps time.time() after reading; 0: not stamped):
    #: the failure-rate guard's clock, so that decide() stays a pure function
    now: float = 0.0
    #: records under the job's prefix that did not parse and were skipped: key -> what is
    #: wrong (the ones the job cannot be judged without raise :class:`BadRecord` instead)
    bad: dict[str, str] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        """The submission this snapshot is of ("" for a job submitted before run ids)."""
        return self.spec.run_id if self.spec is not None else ""


#: records without which a job cannot be judged: one that does not parse fails the snapshot
#: (:class:`BadRecord`) instead of being skipped -- a job without its state or world read as
#: "no state" or "no world" would be placed again from scratch
CRITICAL = ("spec", "state", "epoch")
#: what a record that does not parse raises in its parser (JSON and UTF-8 errors are ValueErrors)
PARSE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError)


def parse_snapshot(job: str, kvs: list[KV], revision: int) -> JobSnapshot:
    """The job's snapshot from its keys. A record that does not parse is skipped and named in
    :attr:`JobSnapshot.bad` (and logged once per write of it), so that one bad record under
    a job's prefix -- written by a newer or buggy writer, or by anyone with write access to
    etcd -- costs nothing but itself; a bad spec, state, epoch or current world raises
    :class:`BadRecord`."""
    keys = JobKeys(job)
    snap = JobSnapshot(job=job, revision=revision)
    worlds: dict[int, World] = {}
    bad_worlds: dict[str, str] = {}
    p = keys.prefix
    for kv in kvs:
        try:
            _parse_record(snap, keys, kv, worlds)
        except PARSE_ERRORS as e:
            error = f"{type(e).__name__}: {e}"
            rel = kv.key[len(p):] if kv.key.startswith(p) else ""
            if rel in CRITICAL:
                raise BadRecord(kv.key, error) from e
            snap.bad[kv.key] = error
            if rel.startswith("world/"):
                bad_worlds[kv.key] = error
            _log_bad_once(kv, error)
    if snap.epoch and keys.world(snap.epoch) in bad_worlds:
        raise BadRecord(keys.world(snap.epoch), bad_worlds[keys.world(snap.epoch)])
    snap.world = worlds.get(snap.epoch)
    return snap


def _parse_record(snap: JobSnapshot, keys: JobKeys, kv: KV, worlds: dict[int, World]) -> None:
    if kv.key.startswith(keys.progress_prefix):
        pr = Progress.from_json(kv.value)
        snap.progress[pr.rank] = pr
        return
    rel = kv.key[len(keys.prefix):]
    head, _, rest = rel.partition("/")
    if rel == "spec":
        snap.spec = JobSpec.from_json(kv.value)
    elif rel == "state":
        rec = StateRecord.from_json(kv.value)
        snap.state = rec.job_state
        snap.state_message = rec.message
        snap.state_error = rec.error
    elif rel == "cancel":
        snap.cancel = True
    elif rel == "leader":
        snap.leader = kv.value.decode()
    elif rel == "checkpoint":
        snap.checkpoint = int(json.loads(kv.value)["step"])
    elif rel == "failures":
        snap.failures = tuple(Failure.from_json(json.dumps(f).encode())
                              for f in json.loads(kv.value))
    elif rel == "epoch":
        snap.epoch = int(kv.value)
        snap.epoch_mod = kv.mod_revision
    elif head == "world":
        w = World.from_json(kv.value)
        worlds[w.epoch] = w
    elif head == "nodes":
        n = Node.from_json(kv.value)
        snap.nodes[n.name] = n
    elif head == "reports":
        snap.reports.append(Report.from_json(kv.value))
    elif head == "done":
        snap.done[int(rest)] = json.loads(kv.value)
    elif head == "chaos":
        node, _, cid = rest.partition("/")
        snap.chaos.setdefault(node, []).append(cid)


#: (key, mod_revision) of the bad records already logged by this process (bounded)
_LOGGED_BAD: dict[tuple[str, int], None] = {}


def _log_bad_once(kv: KV, error: str) -> None:
    """Log a skipped record once per write of it, not on every read of the job."""
    mark = (kv.key, kv.mod_revision)
    if mark in _LOGGED_BAD:
        return
    if len(_LOGGED_BAD) >= 1024:
        _LOGGED_BAD.pop(next(iter(_LOGGED_BAD)))
    _LOGGED_BAD[mark] = None
    log.warning("skipping record %s: it does not parse (%s)", kv.key, error)


class MissingSecret(RuntimeError):
    """The job's secret is missing from etcd, or too short to be a key."""


class JobStore:
    """Typed operations on one job's keys."""

    def __init__(self, store: Store, job: str) -> None:
        self.store = store
        self.job = job
        self.keys = JobKeys(job)

    def snapshot(self, progress: bool = True) -> JobSnapshot:
        """The control state at one revision, plus (unless asked not to) the ranks' latest
        progress records, read right after it."""
        kvs, rev = self.store.get_prefix(self.keys.prefix)
        if progress:
            kvs += self.store.get_prefix(self.keys.progress_prefix)[0]
        return parse_snapshot(self.job, kvs, rev)

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

    def deregister_node(self, node: str) -> None:
        """Remove an agent's node key now (a clean exit), instead of when its lease expires."""
        self.store.delete(self.keys.node(node))

    def try_lead(self, ident: str, lease: Lease) -> tuple[bool, bool]:
        """(leading, just_took): whether ``ident`` holds the job's leader key, and whether
        this call created it. The key lives under ``lease``: a dead leader's key expires and
        a standby's next call takes it."""
        kv = self.store.get(self.keys.leader)
        if kv is not None:
            return kv.value.decode() == ident, False
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

        Fenced twice: on the epoch key's revision read in ``snap`` (a decision based on a
        world that has moved on since is refused, so two controllers can never both write
        the next epoch) and on ``leader`` still holding the job's leader key. False when
        refused: re-read and decide again."""
        puts: dict[str, bytes | str] = {
            self.keys.epoch: str(world.epoch),
            self.keys.world(world.epoch): world.to_json(),
        }
        if state is not None:
            puts[self.keys.state] = StateRecord(state.value, time.time()).to_json()
        if failures is not None:
            puts[self.keys.failures] = _failures_json(failures)
        return self.store.txn(self._decision_fence(snap, leader), puts=puts,
                              deletes=self._report_keys(clear_reports))

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
        kvs, _ = self.store.get_prefix(self.keys.events_prefix)
        out = []
        for kv in kvs:
            try:
                out.append(Event.from_json(kv.value))
            except PARSE_ERRORS as e:
                _log_bad_once(kv, f"{type(e).__name__}: {e}")
        return out

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
                    _log_bad_once(kv, f"not a chaos command: {cmd}")
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
