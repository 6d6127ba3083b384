"""Typed records for what lives in etcd, built from raw JSON values.

Records are small immutable dataclasses with ``to_json``/``from_json``; nothing but
JSON crosses the store boundary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


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
        return cls(**json.loads(raw))


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
        d = json.loads(raw)
        return cls(
            epoch=d["epoch"],
            seats=tuple(Seat(**s) for s in d["seats"]),
            reason=d.get("reason", ""),
            lost=tuple(d.get("lost", ())),
            shrunk_from=d.get("shrunk_from", 0),
            grown_from=d.get("grown_from", 0),
        )


@dataclass(frozen=True)
class Report(_Record):
    """An agent's fast report that a worker holding ``rank`` is gone."""

    node: str
    rank: int
    epoch: int  # the epoch the worker was in when it died
    kind: str  # "exit", "hang", "fatal" (its rank's state cannot be restored from anywhere)
    exit_code: int | None = None
    signal: int | None = None
    time: float = 0.0
    message: str = ""


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


@dataclass(frozen=True)
class Event(_Record):
    """One line of a job's timeline."""

    time: float
    kind: str
    source: str
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)
