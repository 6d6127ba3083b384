"""Typed records for what lives in etcd, built from raw JSON values.

Records are small immutable dataclasses with ``to_json``/``from_json``; nothing but
JSON crosses the store boundary.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class BadRecord(ValueError):
    """A record in etcd that does not parse (not JSON, not an object, a field missing or of
    the wrong type) and that a job cannot be judged without: its spec, state, epoch or current
    world. Other bad records are skipped (:attr:`JobSnapshot.bad`). ``key`` names the record,
    ``error`` says what is wrong with it."""

    def __init__(self, key: str, error: str) -> None:
        super().__init__(f"record {key} does not parse ({error})")
        self.key = key
        self.error = error


class JobState(str, Enum):
    """Life cycle of a job: pending -> running -> one of the terminal states."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class _Record:
    """JSON in and out for the flat record dataclasses below."""

    def to_json(self) -> bytes:
        return _dump(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, raw: bytes):  # noqa: ANN206 - returns cls
        """Tolerant of fields a newer writer added (like Patroni's ``Member.from_node``): an
        older reader keeps working during a rolling upgrade; unknown fields are dropped."""
        return cls(**_known(cls, json.loads(raw)))


def _known(cls: type, d: object) -> dict:
    """The fields of ``cls`` in ``d`` (others dropped), each checked against the field's type:
    a record written by anyone who can write etcd is input, and a wrong type caught here is
    one record skipped, not an error deep in a decision. Raises TypeError."""
    if not isinstance(d, dict):
        raise TypeError(f"a {cls.__name__} record must be a JSON object, not {type(d).__name__}")
    accepts = _json_types(cls)
    out = {}
    for k, v in d.items():
        if k not in accepts:
            continue
        ok = accepts[k]
        if ok is not None and not isinstance(v, ok):
            raise TypeError(f"{cls.__name__}.{k} is {v!r} ({type(v).__name__}), not "
                            + " or ".join(t.__name__ for t in ok))
        out[k] = v
    return out


_JSON_TYPES: dict[type, dict[str, tuple[type, ...] | None]] = {}


def _json_types(cls: type) -> dict[str, tuple[type, ...] | None]:
    """Field name -> the JSON value types it accepts (None: not checked), per class."""
    got = _JSON_TYPES.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = _JSON_TYPES[cls] = {f.name: _accepts(hints.get(f.name)) for f in fields(cls)}
    return got


def _accepts(hint: object) -> tuple[type, ...] | None:
    if hint is float:
        return (int, float)
    if hint in (int, str, bool):
        return (hint,)  # type: ignore[return-value]
    if hint is type(None):
        return (type(None),)
    origin = typing.get_origin(hint)
    if origin is dict:
        return (dict,)
    if origin in (list, tuple):
        return (list,)
    if origin in (typing.Union, types.UnionType):
        parts = [_accepts(a) for a in typing.get_args(hint)]
        return None if any(p is None for p in parts) else tuple(t for p in parts for t in p)  # type: ignore[union-attr]
    return None


@dataclass(frozen=True)
class Node(_Record):
    """A live agent. Exists only while the agent's lease is alive."""

    name: str
    incarnation: str  # changes every time an agent (re)registers: fences old workers
    role: str  # "active" or "spare": placement preference, not a hard rule
    slots: int
    host: str = "127.0.0.1"
    replica_port: int = 0
    pid: int = 0
    warm: int = 0  # warm workers ready for an assignment right now


@dataclass(frozen=True)
class Seat:
    """One rank's place in a world: which node (incarnation) runs it since which epoch.

    ``sid`` names the seat's *state* (its snapshot files and replicas) independently of
    its rank number, which a shrink renumbers: a swap keeps the lost seat's sid, a shrink
    keeps every survivor's, a grow gives new seats fresh ones. -1 means "the rank"."""

    node: str
    incarnation: str
    since: int
    sid: int = -1


#: World.from_json's last results, by record bytes, and WorldChange.apply's (oldest first)
_PARSED_WORLDS: dict[bytes, World] = {}
_APPLIED: dict[tuple, tuple[World, World]] = {}


def _remember(cache: dict, key: object, value: object, keep: int = 4) -> None:
    """``cache[key] = value``, dropping the oldest entries beyond ``keep``; any thread."""
    try:
        while len(cache) >= keep:
            cache.pop(next(iter(cache)), None)
    except (RuntimeError, StopIteration):  # another thread trimmed it meanwhile
        pass
    cache[key] = value


@dataclass(frozen=True)
class World:
    """The rank -> node table of one epoch. Written with the epoch in one fenced txn."""

    epoch: int
    seats: tuple[Seat, ...]
    reason: str = ""
    lost: tuple[int, ...] = ()  # ranks that were replaced (or dropped) to make this world
    shrunk_from: int = 0  # previous world size when this world is a shrink
    grown_from: int = 0  # previous world size when this world is a grow (new seats at the end)

    @property
    def size(self) -> int:
        return len(self.seats)

    def sid(self, rank: int) -> int:
        """The state id of ``rank``'s seat (see :class:`Seat`)."""
        s = self.seats[rank].sid
        return rank if s < 0 else s

    def successors(self, node: str, limit: int | None = None) -> list[str]:
        """The other nodes of this world in ring order (nodes in seat order), starting after
        ``node`` (the first ``limit`` of them): a node's replica buddies are the first live
        ones. Empty if it holds no seat. O(limit) after the first call on this world."""
        ring, at = self._ring
        i = at.get(node)
        if i is None:
            return []
        n = len(ring) - 1 if limit is None else min(limit, len(ring) - 1)
        return [ring[(i + j) % len(ring)] for j in range(1, n + 1)]

    def incarnation_of(self, node: str) -> str | None:
        """The incarnation ``node`` holds its (first) seat as, or None if it holds none."""
        ring, at = self._ring
        i = at.get(node)
        return None if i is None else self._incarnations[i]

    @functools.cached_property
    def _ring(self) -> tuple[list[str], dict[str, int]]:
        ring = list(dict.fromkeys(s.node for s in self.seats))
        return ring, {n: i for i, n in enumerate(ring)}

    @functools.cached_property
    def _incarnations(self) -> list[str]:
        first: dict[str, str] = {}
        for s in self.seats:
            first.setdefault(s.node, s.incarnation)
        return list(first.values())  # in ring order: dicts keep insertion order

    def ranks_on(self, node: str, incarnation: str | None = None) -> list[int]:
        return [
            r
            for r, s in enumerate(self.seats)
            if s.node == node and (incarnation is None or s.incarnation == incarnation)
        ]

    def to_json(self) -> bytes:
        return _dump(
            {
                "epoch": self.epoch,
                "seats": [asdict(s) for s in self.seats],
                "reason": self.reason,
                "lost": list(self.lost),
                "shrunk_from": self.shrunk_from,
                "grown_from": self.grown_from,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> World:
        """The world in ``raw``. The last few parsed are kept (a world is immutable): a
        process that reads the same record again -- the controller every round, an agent at
        each safety read, simulated agents sharing a process (benchmarks/scale.py) -- gets the
        same object back instead of another N seats."""
        raw = bytes(raw)
        hit = _PARSED_WORLDS.get(raw)
        if hit is not None:
            return hit
        world = cls._from_json(raw)
        _remember(_PARSED_WORLDS, raw, world)
        return world

    @classmethod
    def _from_json(cls, raw: bytes) -> World:
        d = json.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("epoch"), int) or not isinstance(d.get("seats"), list):
            raise TypeError("a World record is a JSON object with an integer epoch and a list of seats")
        return cls(
            epoch=d["epoch"],
            seats=tuple(Seat(**_known(Seat, s)) for s in d["seats"]),
            reason=d.get("reason", ""),
            lost=tuple(d.get("lost", ())),
            shrunk_from=d.get("shrunk_from", 0),
            grown_from=d.get("grown_from", 0),
        )


#: The most of a traceback a report, a failure record or the job's final state carries (its
#: end: the exception's own line is last). The whole one is in the rank's log.
TRACEBACK_LIMIT = 4000


def traceback_tail(text: str, limit: int = TRACEBACK_LIMIT) -> str:
    """The last ``limit`` characters of ``text``, cut at a line start when it is cut at all."""
    text = text.rstrip()
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    nl = cut.find("\n")
    return "..." + (cut[nl:] if 0 <= nl < len(cut) - 1 else cut)


def last_line(text: str) -> str:
    """A traceback's last non-empty line (``ValueError: boom``), or ""."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class WorldChange:
    """How the world of ``epoch`` differs from the one it replaced (``base``, whose epoch key
    was written at revision ``base_rev``): the seats that changed, by rank, and the new size.
    The controller writes it with the world, in the same txn, so that an agent holding the
    base world learns the new one from a record of O(changed seats) instead of reading and
    parsing all N seats -- at 1,000 nodes every agent read a 68 KB world per decision
    (benchmarks/scale.py). ``base`` 0: no usable base (the first world, or one where most seats
    changed, e.g. a shrink): read the world record."""

    epoch: int
    base: int = 0
    base_rev: int = 0
    size: int = 0
    seats: dict[int, Seat] = field(default_factory=dict)
    reason: str = ""
    lost: tuple[int, ...] = ()
    shrunk_from: int = 0
    grown_from: int = 0

    #: above this share of changed seats the change is not written (the world is as cheap)
    MOST = 0.25

    @classmethod
    def between(cls, old: World | None, old_rev: int, new: World) -> WorldChange:
        if old is None or not old_rev:
            return cls(epoch=new.epoch)
        changed = {r: s for r, s in enumerate(new.seats) if r >= old.size or old.seats[r] != s}
        if len(changed) > max(1, cls.MOST * new.size):
            return cls(epoch=new.epoch)
        return cls(epoch=new.epoch, base=old.epoch, base_rev=old_rev, size=new.size, seats=changed,
                   reason=new.reason, lost=new.lost, shrunk_from=new.shrunk_from,
                   grown_from=new.grown_from)

    def applies_to(self, old: World | None, old_rev: int) -> bool:
        return bool(self.base) and old is not None and (old.epoch, old_rev) == (self.base, self.base_rev)

    def apply(self, old: World) -> World:
        """The world of :attr:`epoch`, built from ``old`` (which :meth:`applies_to`). The last
        few results are kept, as :meth:`World.from_json` keeps its own: simulated agents that
        share a process (benchmarks/scale.py) share one world per epoch."""
        key = (self.epoch, self.base, self.base_rev, self.size, tuple(self.seats.items()),
               self.reason, self.lost, self.shrunk_from, self.grown_from)
        hit = _APPLIED.get(key)
        if hit is not None and (hit[0] is old or hit[0] == old):
            return hit[1]
        new = self._apply(old)
        _remember(_APPLIED, key, (old, new))
        return new

    def _apply(self, old: World) -> World:
        seats = list(old.seats[: self.size])
        grown = self.size - len(seats)
        seats += [None] * grown  # type: ignore[list-item]
        for r, s in self.seats.items():
            seats[r] = s
        if grown > 0 and any(s is None for s in seats[-grown:]):
            raise ValueError(f"world change {self.base} -> {self.epoch} leaves seats unset")
        return World(epoch=self.epoch, seats=tuple(seats), reason=self.reason, lost=self.lost,
                     shrunk_from=self.shrunk_from, grown_from=self.grown_from)

    def to_json(self) -> bytes:
        return _dump({"epoch": self.epoch, "base": self.base, "base_rev": self.base_rev,
                      "size": self.size, "seats": {str(r): asdict(s) for r, s in self.seats.items()},
                      "reason": self.reason, "lost": list(self.lost),
                      "shrunk_from": self.shrunk_from, "grown_from": self.grown_from})

    @classmethod
    def from_json(cls, raw: bytes) -> WorldChange:
        d = json.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("epoch"), int):
            raise TypeError("a WorldChange record is a JSON object with an integer epoch")
        seats = {int(r): Seat(**_known(Seat, s)) for r, s in d.get("seats", {}).items()}
        size = int(d.get("size", 0))
        if any(not 0 <= r < size for r in seats):
            raise ValueError(f"a WorldChange record names a seat outside its size {size}")
        return cls(epoch=d["epoch"], base=int(d.get("base", 0)), base_rev=int(d.get("base_rev", 0)),
                   size=size, seats=seats, reason=d.get("reason", ""), lost=tuple(d.get("lost", ())),
                   shrunk_from=d.get("shrunk_from", 0), grown_from=d.get("grown_from", 0))


#: The kind of a rank -1 :class:`Report` that a node's agent could not start (the agent wrote
#: it, or, for a local agent that died before it reached etcd, `hotspare run` on its behalf).
AGENT_FAILED = "agent"


@dataclass(frozen=True)
class Report(_Record):
    """An agent's fast report that a worker holding ``rank`` is gone.

    ``rank`` is -1 for a warm worker that could not start the job at all (``kind`` "error":
    the entrypoint does not import): no seat is lost, the job cannot run anywhere."""

    node: str
    rank: int
    epoch: int  # the epoch the worker was in when it died
    kind: str  # a decide.LossKind value: "error", "signal", "exit", "hang", "oom", "fenced", "fatal"
    exit_code: int | None = None
    signal: int | None = None
    time: float = 0.0
    message: str = ""
    step: int = -1  # the step it was computing (its heartbeat's), -1 before its first step
    traceback: str = ""  # the end of the Python traceback of a code error (traceback_tail)


@dataclass(frozen=True)
class Failure(_Record):
    """One handled failure, kept for the job's life in ``/hotspare/<job>/failures``: what the
    crash-loop guards and the code-error retry budget count (they survive a controller
    failover because they are in etcd, not in a controller's memory)."""

    time: float
    rank: int
    sid: int  # the seat's state id: a crash loop follows the state, not the rank number
    node: str
    kind: str
    step: int = -1
    epoch: int = 0


@dataclass(frozen=True)
class Progress(_Record):
    """Last completed step of a rank, published every few seconds off the step path."""

    rank: int
    step: int
    epoch: int
    node: str
    time: float
    step_time: float = 0.0
    compute_time: float = 0.0  # seconds per step outside collectives (EWMA): straggler score
    metrics: dict[str, float] = field(default_factory=dict)


class EventKind(str, Enum):
    """Every kind of line in a job's timeline (``hotspare events``), and who writes it.
    A ``str`` enum: the stored form is the plain name, so older readers see no change."""

    SUBMITTED = "submitted"  # CLI / controller --register
    LEADER = "leader"  # controller took the job's leader key
    WAITING = "waiting"  # controller: a decision to wait, with its reason
    PLACED = "placed"  # controller: first world
    FAILURE = "failure"  # controller: a rank is lost (rank, node, kind, detected, spare)
    SWAP = "swap"  # controller: lost ranks went to spares
    SHRINK = "shrink"  # controller: survivors renumbered
    GROW = "grow"  # controller: seats added back
    SUCCEEDED = "succeeded"  # controller: final states
    FAILED = "failed"
    CANCELLED = "cancelled"
    NODE_JOINED = "node-joined"  # agent registered
    ASSIGNED = "assigned"  # agent handed a rank to a worker
    WORKER_EXIT = "worker-exit"  # agent saw a worker exit or hang
    PERSISTED = "persisted"  # agent's persister completed a checkpoint
    PERSIST_FAILED = "persist-failed"
    CHAOS = "chaos"  # whoever injected or executed a failure
    ETCD_RESTARTED = "etcd-restarted"  # CLI: chaos restart-etcd is over
    REBUILT = "rebuilt"  # worker: joined an epoch's group
    RESTORED = "restored"  # worker: restored its state (source, bytes)
    RESUMED = "resumed"  # worker: completed its first step after a recovery
    FINISHED = "finished"  # worker: wrote its final state
    CHECKPOINT_UNUSABLE = "checkpoint-unusable"  # worker: refused a persisted file
    CORRUPTED = "corrupted"  # worker: chaos corrupt-checkpoint did its damage
    BAD_RECORD = "bad-record"  # controller: a record under the job's prefix does not parse (skipped)
    RECONCILE_FAILED = "reconcile-failed"  # controller: one cycle for this job raised (the others go on)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StateRecord(_Record):
    """``/hotspare/<job>/state``: where the job is in its life cycle, and why."""

    state: str
    time: float = 0.0
    message: str = ""  # the one sentence: what ended the job
    error: str = ""  # the evidence of a failure: the failing rank's traceback_tail, if any

    @property
    def job_state(self) -> JobState:
        return JobState(self.state)


@dataclass(frozen=True)
class Event(_Record):
    """One line of a job's timeline."""

    time: float
    kind: str  # an EventKind value (kept a str: a newer writer's kind must not break us)
    source: str
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)
