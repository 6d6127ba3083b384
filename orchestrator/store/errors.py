"""One error hierarchy for everything that can go wrong talking to etcd.

gRPC and etcd3 client exceptions are translated here, at the boundary, so callers handle
three meaningful cases instead of a zoo of transport errors.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store failure."""


class StoreUnavailable(StoreError):
    """etcd could not be reached (down, partitioned, or timed out). Retry later."""


class Conflict(StoreError):
    """A compare-and-set lost: someone else changed the state first. Re-read and decide again."""


class LeaseLost(StoreError):
    """Our lease expired or was revoked: keys written under it are gone, we are fenced out."""
