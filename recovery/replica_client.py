"""The client side of the replica protocol: what a training process (or a tool) asks of the
agents that hold replicas. Torch-free; the server is :class:`hotspare.agents.replica.ReplicaServer`.

The wire field is called ``"rank"`` for compatibility with protocol ``HSP1`` (``HSP2`` keeps the
name); it carries a *sid* (the seat's state id, see :class:`hotspare.orchestrator.store.Seat`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .wire import Channel, Growing, IntoBuffer, SnapshotCheck, WireError

log = logging.getLogger("hotspare.replica")

#: where a fetched body goes: given the snapshot header (its tensor table checked against the
#: body's length) and that length, a writable buffer of exactly that length
Into = Callable[[dict, int], memoryview]


def fetch(host: str, port: int, secret: bytes, sid: int, step: int,
          timeout: float = 30, into: Into | None = None) -> tuple[dict, Any]:
    """Get and verify the snapshot of state id ``sid`` at step from one holder. Raises WireError if it is
    missing, malformed, fails a checksum, or was changed on the way (the frame's HMAC).

    The body is received straight into ``into(header, length)`` if given (and returned, that
    buffer), else into a new ``bytearray``; its CRC32s are computed as it arrives. Until this
    returns, whatever ``into`` gave holds unverified bytes."""
    ch = Channel.client(host, port, secret, timeout=timeout)
    checks: list[SnapshotCheck] = []

    def sink(reply: dict, n: int) -> IntoBuffer | Growing | None:
        if not reply.get("ok"):
            return None
        snap = reply.get("snapshot")
        if not isinstance(snap, dict):
            raise WireError("get reply without a snapshot header")
        checks.append(SnapshotCheck(snap, n))  # the table against the length, before a byte is read
        if into is None:
            return Growing(n, observe=checks[0].update)
        return IntoBuffer(into(snap, n), observe=checks[0].update)

    try:
        ch.send({"op": "get", "rank": sid, "step": step})
        reply, body = ch.recv(into=sink)
    finally:
        ch.close()
    if not reply.get("ok"):
        raise WireError(str(reply.get("error")))
    checks[0].verify()
    return reply["snapshot"], body


def list_steps(host: str, port: int, secret: bytes, sid: int, timeout: float = 5) -> list[int]:
    return sorted(list_points(host, port, secret, sid, timeout))


def list_points(host: str, port: int, secret: bytes, sid: int, timeout: float = 5) -> dict[int, int | None]:
    """step -> timeline of each snapshot of ``sid`` the holder has (timeline None: a holder
    too old to say; the restore agreement then treats it as unknown)."""
    ch = Channel.client(host, port, secret, timeout=timeout)
    try:
        ch.send({"op": "list", "rank": sid})
        reply, _ = ch.recv()
    finally:
        ch.close()
    steps = reply.get("steps") if reply.get("ok") else None
    if not isinstance(steps, list) or not all(isinstance(s, int) for s in steps):
        raise WireError(f"bad list reply: {reply!r}")
    tls = reply.get("timelines") or {}
    if not isinstance(tls, dict):
        raise WireError(f"bad list reply: {reply!r}")
    out: dict[int, int | None] = {}
    for s in steps:
        tl = tls.get(str(s))
        out[s] = tl if isinstance(tl, int) else None
    return out


def fetch_first(
    holders: list[tuple[str, str, int]], secret: bytes, sid: int, step: int, into: Into | None = None
) -> tuple[dict, Any, str]:
    """The first holder's copy that passes every check; each rejection is logged. Raises
    RuntimeError naming every holder and why, if none is usable. ``into``: as for
    :func:`fetch` (each holder's attempt writes over the one before)."""
    errors = []
    for name, host, port in holders:
        try:
            header, body = fetch(host, port, secret, sid, step, into=into)
            return header, body, name
        except (OSError, WireError, ValueError, TypeError, KeyError) as e:
            log.warning("replica of sid %d step %d from %s rejected: %s", sid, step, name, e)
            errors.append(f"{name}: {e}")
    raise RuntimeError(f"no usable replica of sid {sid} at step {step}: " + "; ".join(errors))
