"""The job's key layout (:class:`JobKeys`) and a consistent read of its control state
(:class:`JobSnapshot`, :func:`parse_snapshot`): what the controller, agents and CLI decide on.
The key table is in :mod:`hotspare.orchestrator.store.job`."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from hotspare.orchestrator.spec import JobSpec

from .client import KV
from .records import (
    BadRecord,
    Failure,
    JobState,
    Node,
    Progress,
    Report,
    StateRecord,
    World,
    WorldChange,
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

    @property
    def world_change(self) -> str:
        return self.prefix + "world_change"

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
    #: how the current world differs from the one before (:class:`WorldChange`), if read
    world_change: WorldChange | None = None
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
            log_bad_once(kv, error)
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
    elif rel == "world_change":
        snap.world_change = WorldChange.from_json(kv.value)
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


def log_bad_once(kv: KV, error: str) -> None:
    """Log a skipped record once per write of it, not on every read of the job."""
    mark = (kv.key, kv.mod_revision)
    if mark in _LOGGED_BAD:
        return
    if len(_LOGGED_BAD) >= 1024:
        _LOGGED_BAD.pop(next(iter(_LOGGED_BAD)))
    _LOGGED_BAD[mark] = None
    log.warning("skipping record %s: it does not parse (%s)", kv.key, error)
