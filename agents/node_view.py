"""What the agent's background services may know of the agent's state.

The agent's main loop owns its state (workers, world, registration). The replicator and
the persister run on threads of their own and must not read that state while the loop
changes it, so the loop *publishes* a frozen :class:`NodeView` -- one attribute swap,
atomic under the GIL -- and the services read whichever view is current. A service sees
the state of the last publication as a whole, never half of an update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: A ring buddy: (node name, host, replica port).
Buddy = tuple[str, str, int]


@dataclass(frozen=True)
class NodeView:
    """One publication of the agent's state, for its services."""

    epoch: int = 0  # the current world's epoch (0 before the first world)
    world_size: int = 0
    buddies: tuple[Buddy, ...] = ()  # the nodes this node's points are pushed to
    checkpoint: int | None = None  # the step ``hotspare checkpoint`` asked for, if any
    #: sid -> current rank of each live local worker holding a seat. Slot files are named by
    #: sid; a shrink renumbers ranks, never sids. Built fresh for each view, never mutated.
    seats: Mapping[int, int] = field(default_factory=dict)

    @property
    def sids(self) -> frozenset[int]:
        """State ids of the live local workers: the names of their snapshot files."""
        return frozenset(self.seats)
