"""All controller policy, as one pure function: ``decide(observed) -> Decision``.

No etcd, no clocks, no I/O: the controller reads a :class:`JobSnapshot`, calls
:func:`decide`, and applies what comes back in one fenced transaction. Every branch is
unit-tested without a server (tests/unit/test_decide.py). ``str(decision)`` is the
sentence the controller logs.

A running job is one situation at a time, each a function that returns its decision with
its sentence (Patroni's ``process_*`` style): the job finished (:func:`_succeed`), nothing
is lost (:func:`_healthy_or_grow`), a loss nobody can recover from (:func:`_fail_fatal`),
a loss a guard ends the job over (code errors, crash loops, too many failures:
:mod:`.failure_guards`), losses a spare can take (:func:`_swap`), and losses no spare can
take (:func:`_on_no_spare`, which applies the spec's ``on_no_spare`` policy). A job whose
code cannot even start (a warm worker's start-up error) fails before anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from . import failure_guards as guards
from .spec import JobSpec
from .status import straggler_scores  # noqa: F401 - also importable from here, as before
from .store.job import JobSnapshot
from .store.records import JobState, Node, Report, Seat, World


class Action(str, Enum):
    """What a decision does. A ``str`` enum, so ``d.action == "swap"`` holds and it is
    written to events and logs as its plain name."""

    NONE = "none"  # nothing to do (may still clear stale reports)
    WAIT = "wait"  # something is missing (nodes, capacity, a spare); try again later
    PLACE = "place"  # the first world
    SWAP = "swap"  # lost ranks go to spare capacity; the world keeps its size
    SHRINK = "shrink"  # lost ranks are dropped; survivors are renumbered
    GROW = "grow"  # a shrunk world takes seats back on warm free workers
    SUCCEED = "succeed"  # final states
    FAIL = "fail"
    CANCEL = "cancel"

    def __str__(self) -> str:
        return self.value


class LossKind(str, Enum):
    """Why a rank must be replaced. The agents' report kinds (``error``, ``signal``, ``oom``,
    ``hang``, ``fenced``, ``exit``, ``fatal``: ``agents.node_workers.classify_exit``) are values
    of it; ``str`` so it compares and serialises as the plain name."""

    ERROR = "error"  # the training function raised: a code error (on_code_error decides)
    SIGNAL = "signal"  # the worker was killed by a signal
    OOM = "oom"  # the kernel's OOM killer killed it (out of memory)
    EXIT = "exit"  # the worker process exited otherwise (a crash, or raised not by its code)
    HANG = "hang"  # no heartbeat: the agent's watchdog killed it
    FENCED = "fenced"  # it left because its seat had moved on (usually a stale report)
    NODE_LOSS = "node-loss"  # the node's lease expired, or its agent restarted
    STRAGGLER = "straggler"  # too slow (on_straggler: replace)
    FATAL = "fatal"  # its state is gone everywhere: no spare can bring it back

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Loss:
    """A rank that must be replaced, and why."""

    rank: int
    node: str
    kind: LossKind | str  # a LossKind; a report kind from a newer agent stays a plain str
    detail: str = ""
    detected: float = 0.0  # when an agent saw it (0: seen now, by the controller)
    step: int = -1  # the step it was computing, if its agent knows (-1: not known, or before the first)
    traceback: str = ""  # the end of what the training function raised (a code error)


@dataclass(frozen=True)
class Decision:
    action: Action  # a plain string is accepted and converted
    reason: str
    world: World | None = None
    losses: tuple[Loss, ...] = ()
    spares: tuple[str, ...] = ()  # node chosen for each loss, same order (swap); new seats (grow)
    clear_reports: tuple[tuple[str, int], ...] = field(default=())  # handled or stale reports
    error: str = ""  # the evidence a failed job keeps with its sentence: a traceback's end

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action(self.action))

    def __str__(self) -> str:
        return self.reason

    @property
    def changes_world(self) -> bool:
        return self.world is not None

    @property
    def final_state(self) -> JobState | None:
        return _FINAL_STATES.get(self.action)


_FINAL_STATES = {
    Action.SUCCEED: JobState.SUCCEEDED,
    Action.FAIL: JobState.FAILED,
    Action.CANCEL: JobState.CANCELLED,
}

ReportRefs = tuple[tuple[str, int], ...]  # (node, rank) of the reports a decision clears


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def decide(obs: JobSnapshot) -> Decision:
    spec = obs.spec
    if spec is None:
        return Decision(Action.NONE, f"job {obs.job}: no spec (not submitted)")
    if obs.state.terminal:
        return Decision(Action.NONE, f"job {obs.job} is {obs.state.value}: nothing to do")
    if obs.cancel:
        return Decision(Action.CANCEL, f"job {obs.job} cancelled on request")
    startup = guards.startup_error(obs)
    if startup is not None:  # with or without a world: the code cannot start anywhere
        return Decision(Action.FAIL, startup.reason, error=startup.error,
                        clear_reports=tuple((r.node, r.rank) for r in obs.reports if r.rank < 0))
    if obs.world is None:
        return _place(obs, spec)
    return _reconcile(obs, spec, obs.world)


# -- initial placement ------------------------------------------------------------------
def _place(obs: JobSnapshot, spec: JobSpec) -> Decision:
    ranks, rpn, spares = spec.ranks, spec.ranks_per_node, spec.spares
    needed = spec.nodes
    nodes = sorted(obs.nodes.values(), key=lambda n: (n.role != "active", n.name))
    active = [n for n in nodes if n.role == "active"]
    if len(active) < needed and len(nodes) < needed + spares:
        return Decision(
            Action.WAIT,
            f"waiting for nodes: {len(active)} of {needed} active nodes registered"
            f" ({len(nodes)} in all, {needed + spares} expected)",
        )
    seats: list[Seat] = []
    for n in nodes:
        for _ in range(min(n.slots, rpn)):
            if len(seats) < ranks:
                seats.append(Seat(node=n.name, incarnation=n.incarnation, since=1))
    if len(seats) < ranks:
        return Decision(
            Action.WAIT, f"waiting for capacity: {len(seats)} of {ranks} rank slots on live nodes"
        )
    world = World(epoch=1, seats=tuple(seats), reason="initial placement")
    used = sorted({s.node for s in seats})
    idle = [n.name for n in nodes if n.name not in used]
    return Decision(
        Action.PLACE,
        f"placing {_plural(ranks, 'rank')} on {', '.join(used)}"
        + (f"; spares: {', '.join(idle)}" if idle else "; no spare node registered"),
        world=world,
    )


# -- what is lost -----------------------------------------------------------------------
def find_losses(obs: JobSnapshot, world: World) -> tuple[list[Loss], list[tuple[str, int]]]:
    """Ranks of ``world`` that are gone, and reports that no longer matter (stale)."""
    losses: dict[int, Loss] = {}
    for r, seat in enumerate(world.seats):
        if _finished(obs, r, seat):
            continue
        node = obs.nodes.get(seat.node)
        if node is None:
            losses[r] = Loss(r, seat.node, LossKind.NODE_LOSS, f"node {seat.node} lost its lease")
        elif node.incarnation != seat.incarnation:
            losses[r] = Loss(r, seat.node, LossKind.NODE_LOSS, f"agent on {seat.node} restarted")
    stale: list[tuple[str, int]] = []
    for rep in obs.reports:
        seat = world.seats[rep.rank] if 0 <= rep.rank < world.size else None
        if seat is None or seat.node != rep.node or rep.epoch < seat.since:
            stale.append((rep.node, rep.rank))
            continue
        if rep.rank not in losses:
            losses[rep.rank] = _reported_loss(rep)
    return [losses[r] for r in sorted(losses)], stale


def _reported_loss(rep: Report) -> Loss:
    how = f"signal {rep.signal}" if rep.signal else f"exit code {rep.exit_code}"
    detail = rep.message or (
        "worker hung (no heartbeat), killed" if rep.kind == "hang" else f"worker died ({how})"
    )
    try:
        kind: LossKind | str = LossKind(rep.kind)
    except ValueError:  # a kind a newer agent knows: handled like any other loss
        kind = rep.kind
    return Loss(rep.rank, rep.node, kind, detail, rep.time, rep.step, rep.traceback)


def stragglers(obs: JobSnapshot, world: World, threshold: float) -> list[Loss]:
    return [
        Loss(r, world.seats[r].node, LossKind.STRAGGLER,
             f"straggler: {score:.1f}x the median compute time per step")
        for r, score in sorted(straggler_scores(obs, world).items())
        if score >= threshold
    ]


def _finished(obs: JobSnapshot, rank: int, seat: Seat) -> bool:
    d = obs.done.get(rank)
    return d is not None and d.get("epoch", 0) >= seat.since


# -- running job: one function per situation ---------------------------------------------
def _reconcile(obs: JobSnapshot, spec: JobSpec, world: World) -> Decision:
    # A rank marks itself done only after the final barrier completed, which needs every
    # rank to have finished its last step: one done rank means the job is complete, even
    # if another rank dies before it could write its own mark.
    if any(_finished(obs, r, s) for r, s in enumerate(world.seats)):
        return _succeed(obs, spec, world)
    losses, stale = find_losses(obs, world)
    if not losses and spec.on_straggler == "replace":
        losses = _replaceable_stragglers(obs, spec, world)
    if not losses:
        return _healthy_or_grow(obs, spec, world, tuple(stale))
    handled = tuple(stale) + tuple((lo.node, lo.rank) for lo in losses)
    if any(lo.kind == LossKind.FATAL for lo in losses):
        return _fail_fatal(losses, handled)
    verdict = guards.verdict(obs, spec, world, losses)
    if verdict is not None:
        return _fail(verdict.reason, losses, handled, error=verdict.error)
    chosen = _choose_spares(obs, world, losses)
    if chosen is not None:
        return _swap(obs, world, losses, chosen, handled)
    return _on_no_spare(obs, spec, world, losses, handled)


def _succeed(obs: JobSnapshot, spec: JobSpec, world: World) -> Decision:
    return Decision(
        Action.SUCCEED,
        f"all {_plural(world.size, 'rank')} finished {spec.steps} steps",
        clear_reports=tuple((rep.node, rep.rank) for rep in obs.reports),
    )


def _replaceable_stragglers(obs: JobSnapshot, spec: JobSpec, world: World) -> list[Loss]:
    """Stragglers are replaced like failures, but only when spares can take them all:
    without one they are only reported (``hotspare status``), never shrunk away."""
    slow = stragglers(obs, world, spec.straggler_threshold)
    return slow if slow and _choose_spares(obs, world, slow) is not None else []


def _healthy_or_grow(obs: JobSnapshot, spec: JobSpec, world: World, stale: ReportRefs) -> Decision:
    grow = _grow(obs, spec, world, stale)
    if grow is not None:
        return grow
    short = spec.ranks - world.size
    return Decision(
        Action.NONE,
        f"epoch {world.epoch}: {_plural(world.size, 'rank')} healthy"
        + (f" ({short} below ranks={spec.ranks}; growing back once a warm worker is free)"
           if short > 0 else ""),
        clear_reports=stale,
    )


def _fail_fatal(losses: list[Loss], handled: ReportRefs) -> Decision:
    """Every member hit it: a spare would only restore nothing again."""
    fatal = [lo for lo in losses if lo.kind == LossKind.FATAL]
    return _fail(f"{_what(fatal)}; the job cannot continue from any copy of its state",
                 losses, handled)


def _swap(
    obs: JobSnapshot, world: World, losses: list[Loss], chosen: list[str], handled: ReportRefs, why: str = ""
) -> Decision:
    """Each lost rank to its chosen node (``why``: said when that is the node it failed on)."""
    seats = list(world.seats)
    for lo, name in zip(losses, chosen, strict=True):
        seats[lo.rank] = Seat(name, obs.nodes[name].incarnation, world.epoch + 1,
                              _sid(world, lo.rank, lo.rank))  # the spare restores the lost state
    what = _what(losses)
    moves = ", ".join(f"rank {lo.rank} -> {n}" for lo, n in zip(losses, chosen, strict=True))
    return _next_world(
        Action.SWAP, world, seats,
        f"{what}; {f'restarting on the same node(s), {why}' if why else 'swapping in spare'} "
        f"({moves}) at epoch {world.epoch + 1}",
        reason=what, lost=_lost_ranks(losses), losses=losses, spares=chosen, clear_reports=handled,
    )


def _on_no_spare(
    obs: JobSnapshot, spec: JobSpec, world: World, losses: list[Loss], handled: ReportRefs
) -> Decision:
    """No spare capacity for every loss: the spec's ``on_no_spare`` policy decides."""
    free = _free_capacity(obs, world, {lo.node for lo in losses}, set(_lost_ranks(losses)))
    short = (f"{_what(losses)}; no spare left ({sum(free.values())} free slot(s) for "
             f"{len(losses)} lost rank(s))")
    if spec.on_no_spare == "fail":
        return _fail(
            f"{short}; on_no_spare=fail, so the job fails. Add spare nodes (spares: N) or use "
            "on_no_spare: wait|shrink to keep it alive",
            losses,
            handled,
        )
    if spec.on_no_spare == "shrink":
        return _shrink(spec, world, losses, short, handled)
    # a lost node whose agent registered again is a node that joined: waiting for yet another
    # might be forever. A worker's crash or hang is a machine fault: never back to its node.
    faulty = {lo.node for lo in losses if lo.kind != LossKind.NODE_LOSS}
    back = _pick(obs, _free_capacity(obs, world, faulty, set(_lost_ranks(losses))), len(losses), warm_only=False)
    if len(back) == len(losses):
        return _swap(obs, world, losses, back, handled, why="its agent registered again and no other node has room")
    return _wait(short, losses)


def _fail(sentence: str, losses: list[Loss], handled: ReportRefs, error: str = "") -> Decision:
    return Decision(Action.FAIL, sentence, losses=tuple(losses), clear_reports=handled, error=error)


def _wait(short: str, losses: list[Loss]) -> Decision:
    """The reports stay: the losses are handled once a spare node joins."""
    return Decision(
        Action.WAIT,
        f"{short}; waiting for a spare node to join (on_no_spare=wait)",
        losses=tuple(losses),
    )


def _shrink(
    spec: JobSpec, world: World, losses: list[Loss], short: str, handled: ReportRefs
) -> Decision:
    lost = _lost_ranks(losses)
    kept = [r for r in range(world.size) if r not in lost]
    if len(kept) < spec.min_ranks:
        return _fail(
            f"{short}; shrinking would leave {len(kept)} rank(s) < min_ranks={spec.min_ranks}",
            losses,
            handled,
        )
    # a survivor whose rank number changes holds a new rank from the new epoch on, so
    # reports about the old holder of that number are recognised as stale
    first_lost = min(lost)
    seats = [
        Seat(world.seats[old].node, world.seats[old].incarnation,
             world.seats[old].since if new < first_lost else world.epoch + 1,
             _sid(world, old, new))  # a renumbered survivor keeps its state's name
        for new, old in enumerate(kept)
    ]
    return _next_world(
        Action.SHRINK, world, seats,
        f"{short}; shrinking to {_plural(len(seats), 'rank')} at epoch {world.epoch + 1}",
        reason=_what(losses), lost=lost, shrunk_from=world.size, losses=losses,
        clear_reports=handled,
    )


def _grow(obs: JobSnapshot, spec: JobSpec, world: World, stale: ReportRefs) -> Decision | None:
    """A healthy world below ``ranks`` (after a shrink) grows back onto warm free workers.

    Only warm workers are taken, so the members wait for the newcomers' rendezvous, not
    for their interpreter start; a partial grow is fine (each joins when warm). New seats
    go at the end (no survivor is renumbered) with fresh sids: they have no state of their
    own and take a member's (data-parallel replicas are identical), see recovery/session.py.
    """
    missing = spec.ranks - world.size
    if missing <= 0:
        return None
    chosen = _pick(obs, _free_capacity(obs, world, set(), set()), missing, warm_only=True)
    if not chosen:
        return None
    epoch = world.epoch + 1
    new_seats = [
        # unique for the job's life: initial sids are < ranks, and each epoch has its own range
        Seat(name, obs.nodes[name].incarnation, epoch, epoch * spec.ranks + i)
        for i, name in enumerate(chosen)
    ]
    size = world.size + len(chosen)
    moves = ", ".join(f"rank {world.size + i} -> {n}" for i, n in enumerate(chosen))
    return _next_world(
        Action.GROW, world, list(world.seats) + new_seats,
        f"epoch {world.epoch}: {_plural(world.size, 'rank')} of {spec.ranks}; growing to "
        f"{_plural(size, 'rank')} ({moves}) at epoch {epoch}",
        reason=f"growing back towards {spec.ranks} ranks", grown_from=world.size,
        spares=chosen, clear_reports=stale,
    )


# -- helpers ----------------------------------------------------------------------------
def _next_world(
    action: Action,
    world: World,
    seats: Sequence[Seat],
    sentence: str,
    *,
    reason: str,
    lost: tuple[int, ...] = (),
    shrunk_from: int = 0,
    grown_from: int = 0,
    losses: Iterable[Loss] = (),
    spares: Iterable[str] = (),
    clear_reports: ReportRefs = (),
) -> Decision:
    """A decision that writes the world of the next epoch (swap, shrink, grow)."""
    new = World(epoch=world.epoch + 1, seats=tuple(seats), reason=reason, lost=lost,
                shrunk_from=shrunk_from, grown_from=grown_from)
    return Decision(action, sentence, world=new, losses=tuple(losses), spares=tuple(spares),
                    clear_reports=clear_reports)


def _what(losses: Iterable[Loss]) -> str:
    return "; ".join(f"rank {lo.rank} on {lo.node}: {lo.detail}" for lo in losses)


def _lost_ranks(losses: Iterable[Loss]) -> tuple[int, ...]:
    return tuple(sorted({lo.rank for lo in losses}))


def _sid(world: World, old_rank: int, new_rank: int) -> int:
    """The sid a seat moving from ``old_rank`` to ``new_rank`` keeps (-1: equal to the rank)."""
    sid = world.sid(old_rank)
    return -1 if sid == new_rank else sid


def _free_capacity(
    obs: JobSnapshot, world: World, failed_nodes: set[str], lost_ranks: set[int]
) -> dict[str, int]:
    used: dict[str, int] = {}
    for r, s in enumerate(world.seats):
        if r not in lost_ranks:
            used[s.node] = used.get(s.node, 0) + 1
    return {
        n.name: n.slots - used.get(n.name, 0)
        for n in obs.nodes.values()
        if n.name not in failed_nodes and n.slots - used.get(n.name, 0) > 0
    }


def _choose_spares(obs: JobSnapshot, world: World, losses: list[Loss]) -> list[str] | None:
    """One node per loss, never a node where one of them failed -- unless every loss is a
    code error being retried (on_code_error: retry) and only those nodes have room: the
    machine is not to blame. None unless every loss gets one."""
    lost = {lo.rank for lo in losses}
    chosen = _pick(obs, _free_capacity(obs, world, {lo.node for lo in losses}, lost), len(losses), warm_only=False)
    if len(chosen) < len(losses) and all(lo.kind == LossKind.ERROR for lo in losses):
        chosen = _pick(obs, _free_capacity(obs, world, set(), lost), len(losses), warm_only=False)
    return chosen if len(chosen) == len(losses) else None


def _pick(obs: JobSnapshot, free: dict[str, int], count: int, *, warm_only: bool) -> list[str]:
    """Up to ``count`` nodes, one free slot at a time, greedily: spare-role first, then warm
    (a warm worker skips the interpreter start), then the emptiest, then by name. A node
    picked twice must have two free slots; each pick takes one of its warm workers.
    ``warm_only`` considers only nodes with a warm worker left. ``free`` is used up."""
    warm = {name: obs.nodes[name].warm for name in free}
    chosen: list[str] = []
    for _ in range(count):
        cands = [obs.nodes[n] for n, f in free.items() if f > 0 and (warm[n] > 0 or not warm_only)]
        if not cands:
            break
        pick = min(cands, key=lambda n: _preference(n, free, warm)).name
        free[pick] -= 1
        warm[pick] -= 1
        chosen.append(pick)
    return chosen


def _preference(n: Node, free: dict[str, int], warm: dict[str, int]) -> tuple:
    return (n.role != "spare", warm[n.name] <= 0, -free[n.name], n.name)
