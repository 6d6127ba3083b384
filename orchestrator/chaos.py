"""The chaos actions: one table that spec validation, ``hotspare chaos``, the agent, the
training process, the controller and the recovery timeline all read.

Adding an action is one row here plus its side effect in the process that executes it
(``executor``). Standard library only: every process imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Target(str, Enum):
    RANK = "rank"  # one training process; needs a rank
    NODE = "node"  # a whole node, named directly or through a rank it hosts
    CONTROL = "control"  # the control plane; no target


class Executor(str, Enum):
    WORKER = "worker"  # the training process (scheduled entries; it acts on itself)
    AGENT = "agent"  # the node agent, through /hotspare/<job>/chaos/<node>/
    CONTROLLER = "controller"  # the leader controller, through chaos/_controller/
    CLI = "cli"  # the CLI process (it owns the embedded etcd)


@dataclass(frozen=True)
class Action:
    name: str
    target: Target
    executor: Executor  # who carries it out when ``hotspare chaos`` sends it
    timed: bool = False  # ``seconds`` means something (a duration, or slow-rank's delay)
    default_seconds: float | None = None  # None: until recovery (or, partition: 2 lease TTLs)
    spec_only: bool = False  # only as a scheduled spec entry, not ``hotspare chaos``
    help: str = ""


ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        Action("kill-rank", Target.RANK, Executor.AGENT, help="SIGKILL one training process"),
        Action("kill-node", Target.NODE, Executor.AGENT,
               help="SIGKILL a node's agent and every worker on it (a lost machine)"),
        Action("hang-rank", Target.RANK, Executor.AGENT, timed=True,
               help="SIGSTOP one training process (the agent's watchdog must catch it)"),
        Action("slow-rank", Target.RANK, Executor.AGENT, timed=True, default_seconds=0.5,
               help="add SECONDS of delay to every step of one rank (0 clears it)"),
        Action("partition-node", Target.NODE, Executor.AGENT, timed=True,
               help="cut a node off (no keepalives, no replica traffic) for SECONDS"),
        Action("kill-controller", Target.CONTROL, Executor.CONTROLLER,
               help="SIGKILL the leader controller (a standby takes over)"),
        Action("restart-etcd", Target.CONTROL, Executor.CLI, timed=True, default_seconds=5.0,
               help="stop the embedded etcd for SECONDS, then start it again"),
        Action("corrupt-checkpoint", Target.RANK, Executor.WORKER, spec_only=True,
               help="flip bytes in a rank's file of the newest complete checkpoint"),
    )
}

#: The phases of a recovery a scheduled entry can fire inside (``during:`` in the spec, never
#: ``hotspare chaos``), in the order a recovery passes them; what each is, for the docs.
PHASES: dict[str, str] = {
    "rendezvous": "a member is about to build the new epoch's process group (every member)",
    "restore": "the members agreed on the step to restore; this member is about to load it",
    "fetch": "this member is about to fetch its state from a replica holder (a spare in a lost seat)",
}
#: Actions that cannot fire inside a recovery: slow-rank delays every step, not a phase.
NOT_DURING: tuple[str, ...] = ("slow-rank",)

#: Names in the order above (the spelling used in YAML and on the command line).
NAMES: tuple[str, ...] = tuple(ACTIONS)
RANK_ACTIONS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if a.target is Target.RANK)
NODE_ACTIONS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if a.target is Target.NODE)
CONTROL_ACTIONS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if a.target is Target.CONTROL)
TIMED_ACTIONS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if a.timed)
#: What ``hotspare chaos --action`` accepts.
CLI_ACTIONS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if not a.spec_only)
#: What a node agent executes.
AGENT_ACTIONS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if a.executor is Executor.AGENT)
#: Actions that take a node (and every rank on it) down: the timeline matches them by node.
NODE_LOSS_ACTIONS: tuple[str, ...] = NODE_ACTIONS


def get(name: str) -> Action:
    """The action called ``name``; KeyError names the known ones."""
    try:
        return ACTIONS[name]
    except KeyError:
        raise KeyError(f"unknown chaos action {name!r}; known: {', '.join(NAMES)}") from None


def seconds_or_default(name: str, seconds: float | None) -> float | None:
    """``seconds`` as given, else the action's default (None: the action's own rule)."""
    return ACTIONS[name].default_seconds if seconds is None else float(seconds)
