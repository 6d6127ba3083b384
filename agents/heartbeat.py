"""Deprecated: the heartbeat is part of :mod:`hotspare.agents.worker_link` (the agent <-> worker
contract); this alias goes away in the next release."""

from .worker_link import FINISHED, RUNNING, SIZE, STARTING, STATE_NAMES, WARM, Heartbeat  # noqa: F401
