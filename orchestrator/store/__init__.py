"""The only code in hotspare that talks to etcd.

Public surface: :class:`Store` (connection), :class:`JobStore` (one job's typed keys and
verbs), the records, :mod:`.events` (typed constructors for the timeline's events), and the
error hierarchy. (``c10d`` is the training side's rendezvous store adapter; it imports torch
and is not imported here.)
"""

from . import events
from .client import (
    ENV_OPTIONS,
    KV,
    PASSWORD_FILE_ENV,
    Compare,
    Lease,
    Store,
    TokenExpired,
    connect_error,
    parse_endpoint,
    store_options_from_env,
    wait_until,
)
from .errors import QUOTA_FIX, Conflict, LeaseLost, StoreError, StoreFull, StoreUnavailable
from .job import (
    CONTROLLER,
    JobKeys,
    JobSnapshot,
    JobStore,
    list_jobs,
    list_runs,
    new_run_id,
    parse_snapshot,
)
from .records import (
    Event,
    EventKind,
    Failure,
    JobState,
    Node,
    Progress,
    Report,
    Seat,
    StateRecord,
    World,
    WorldChange,
    last_line,
    traceback_tail,
)

__all__ = [
    "CONTROLLER",
    "Failure",
    "last_line",
    "new_run_id",
    "traceback_tail",
    "EventKind",
    "StateRecord",
    "ENV_OPTIONS",
    "KV",
    "PASSWORD_FILE_ENV",
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
    "StoreFull",
    "StoreUnavailable",
    "QUOTA_FIX",
    "TokenExpired",
    "World",
    "WorldChange",
    "connect_error",
    "events",
    "list_jobs",
    "list_runs",
    "parse_endpoint",
    "parse_snapshot",
    "store_options_from_env",
    "wait_until",
]
