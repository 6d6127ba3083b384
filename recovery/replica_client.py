"""The client side of the replica protocol: what a training process (or a tool) asks of the
agents that hold replicas. Torch-free; the server is :class:`hotspare.agents.replica.ReplicaServer`.

The wire field is called ``"rank"`` for compatibility with protocol ``HSP1`` (``HSP2`` keeps the
name); it carries a *sid* (the seat's state id, see :class:`hotspare.orchestrator.store.Seat`).
"""

from __future__ import annotations

import logging

from .wire import Channel, WireError, validate_snapshot

log = logging.getLogger("hotspare.replica")


def fetch(host: str, port: int, secret: bytes, sid: int, step: int,
          timeout: float = 30) -> tuple[dict, bytes | bytearray]:
    """Get and verify the snapshot of state id ``sid`` at step from one holder. Raises WireError if it is
    missing, malformed, fails a checksum, or was changed on the way (the frame's HMAC)."""
    ch = Channel.client(host, port, secret, timeout=timeout)
    try:
        ch.send({"op": "get", "rank": sid, "step": step})
        reply, body = ch.recv()
    finally:
        ch.close()
    if not reply.get("ok"):
        raise WireError(str(reply.get("error")))
    snap = reply.get("snapshot")
    if not isinstance(snap, dict):
        raise WireError("get reply without a snapshot header")
    validate_snapshot(snap, body)
    return snap, body


def list_steps(host: str, port: int, secret: bytes, sid: int, timeout: float = 5) -> list[int]:
    ch = Channel.client(host, port, secret, timeout=timeout)
    try:
        ch.send({"op": "list", "rank": sid})
        reply, _ = ch.recv()
    finally:
        ch.close()
    steps = reply.get("steps") if reply.get("ok") else None
    if not isinstance(steps, list) or not all(isinstance(s, int) for s in steps):
        raise WireError(f"bad list reply: {reply!r}")
    return steps


def fetch_first(
    holders: list[tuple[str, str, int]], secret: bytes, sid: int, step: int
) -> tuple[dict, bytes | bytearray, str]:
    """The first holder's copy that passes every check; each rejection is logged. Raises
    RuntimeError naming every holder and why, if none is usable."""
    errors = []
    for name, host, port in holders:
        try:
            header, body = fetch(host, port, secret, sid, step)
            return header, body, name
        except (OSError, WireError, ValueError, TypeError, KeyError) as e:
            log.warning("replica of sid %d step %d from %s rejected: %s", sid, step, name, e)
            errors.append(f"{name}: {e}")
    raise RuntimeError(f"no usable replica of sid {sid} at step {step}: " + "; ".join(errors))
