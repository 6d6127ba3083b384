"""The errors that end a job with one sentence instead of sending its rank to a spare.

An :class:`Unrecoverable` raised out of the training function makes the worker exit with
``EXIT_UNRECOVERABLE`` and its message (:func:`hotspare.agents.worker.run`); the agent reports a
*fatal* loss and the controller fails the job with that message. They live here, importing
nothing, so that the snapshot engine (which :mod:`hotspare.recovery.restore` imports) can raise
one too.
"""

from __future__ import annotations


class Unrecoverable(RuntimeError):
    """No copy of the state this rank needs is left (no common snapshot, no usable checkpoint)."""


class ShmTooSmall(Unrecoverable):
    """The snapshot directory (``/dev/shm``) cannot hold what this node's snapshots and replicas
    need: a spare on another node would not hold it either, and a swap loop would only hide
    it. The message gives the numbers and the fix
    (:func:`hotspare.recovery.shm_budget.check_room`)."""
