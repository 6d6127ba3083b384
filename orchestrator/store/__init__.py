"""The only code in hotspare that talks to etcd.

Public surface: :class:`Store` (connection), :class:`JobStore` (one job's typed keys),
the records, and the error hierarchy.
"""

from .client import KV, Compare, Lease, Store, parse_endpoint, wait_until
from .errors import Conflict, LeaseLost, StoreError, StoreUnavailable
from .job import JobKeys, JobSnapshot, JobStore, list_jobs, parse_snapshot
from .records import Event, JobState, Node, Progress, Report, Seat, World

__all__ = [
    "KV",
    "Compare",
    "Conflict",
    "Event",
    "JobKeys",
    "JobSnapshot",
    "JobState",
    "JobStore",
    "Lease",
    "LeaseLost",
    "Node",
    "Progress",
    "Report",
    "Seat",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "World",
    "list_jobs",
    "parse_endpoint",
    "parse_snapshot",
    "wait_until",
]
