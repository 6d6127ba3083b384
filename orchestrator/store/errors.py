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


#: What to do about etcd's space quota (its NOSPACE alarm), said wherever hotspare meets it.
QUOTA_FIX = ("compact and defragment etcd and disarm the alarm (`etcdctl compact <revision>`, "
             "`etcdctl defrag`, `etcdctl alarm disarm`), or restart it with a larger --quota-backend-bytes")


class StoreFull(StoreError):
    """etcd's space quota is exhausted (its NOSPACE alarm): it answers reads, deletes and
    keepalives but refuses every write until an operator frees space and disarms the alarm.
    Not an outage: retrying helps only once someone has acted, so say so once, then wait."""
