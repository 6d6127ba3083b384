"""All controller policy, as one pure function: ``decide(observed) -> Decision``.

No etcd, no clocks, no I/O: the controller reads a :class:`JobSnapshot`, calls
:func:`decide`, and applies what comes back in one fenced transaction. Every branch is
unit-tested without a server (tests/unit/test_decide.py). ``str(decision)`` is the
sentence the controller logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec import JobSpec
from .store.job import JobSnapshot
from .store.records import JobState, Node, Seat, World


@dataclass(frozen=True)
class Loss:
    """A rank that must be replaced, and why."""

    rank: int
    node: str
    kind: str  # "exit", "hang", "node-loss", "straggler", "fatal" (its state is gone everywhere)
    detail: str = ""
    detected: float = 0.0  # when an agent saw it (0: seen now, by the controller)


@dataclass(frozen=True)
class Decision:
    action: str  # none | wait | place | swap | shrink | grow | succeed | fail | cancel
    reason: str
    world: World | None = None
    losses: tuple[Loss, ...] = ()
    spares: tuple[str, ...] = ()  # node chosen for each loss, same order (swap); new seats (grow)
    clear_reports: tuple[tuple[str, int], ...] = field(default=())  # handled or stale reports

    def __str__(self) -> str:
        return self.reason

    @property
    def changes_world(self) -> bool:
        return self.world is not None

    @property
    def final_state(self) -> JobState | None:
        return {
            "succeed": JobState.SUCCEEDED,
            "fail": JobState.FAILED,
            "cancel": JobState.CANCELLED,
        }.get(self.action)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def decide(obs: JobSnapshot) -> Decision:
    spec = obs.spec
    if spec is None:
        return Decision("none", f"job {obs.job}: no spec (not submitted)")
    if obs.state.terminal:
        return Decision("none", f"job {obs.job} is {obs.state.value}: nothing to do")
    if obs.cancel:
        return Decision("cancel", f"job {obs.job} cancelled on request")
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
            "wait",
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
            "wait", f"waiting for capacity: {len(seats)} of {ranks} rank slots on live nodes"
        )
    world = World(epoch=1, seats=tuple(seats), reason="initial placement")
    used = sorted({s.node for s in seats})
    idle = [n.name for n in nodes if n.name not in used]
    return Decision(
        "place",
        f"placing {_plural(ranks, 'rank')} on {', '.join(used)}"
        + (f"; spares: {', '.join(idle)}" if idle else "; no spare node registered"),
        world=world,
    )


# -- running job ------------------------------------------------------------------------
def find_losses(obs: JobSnapshot, world: World) -> tuple[list[Loss], list[tuple[str, int]]]:
    """Ranks of ``world`` that are gone, and reports that no longer matter (stale)."""
    losses: dict[int, Loss] = {}
    for r, seat in enumerate(world.seats):
        if _finished(obs, r, seat):
            continue
        node = obs.nodes.get(seat.node)
        if node is None:
            losses[r] = Loss(r, seat.node, "node-loss", f"node {seat.node} lost its lease")
        elif node.incarnation != seat.incarnation:
            losses[r] = Loss(r, seat.node, "node-loss", f"agent on {seat.node} restarted")
    stale: list[tuple[str, int]] = []
    for rep in obs.reports:
        seat = world.seats[rep.rank] if 0 <= rep.rank < world.size else None
        if seat is None or seat.node != rep.node or rep.epoch < seat.since:
            stale.append((rep.node, rep.rank))
            continue
        if rep.rank not in losses:
            how = f"signal {rep.signal}" if rep.signal else f"exit code {rep.exit_code}"
            detail = rep.message or (
                "worker hung (no heartbeat), killed" if rep.kind == "hang" else f"worker died ({how})"
            )
            losses[rep.rank] = Loss(rep.rank, rep.node, rep.kind, detail, rep.time)
    return [losses[r] for r in sorted(losses)], stale


def straggler_scores(obs: JobSnapshot, world: World) -> dict[int, float]:
    """Each rank's compute time per step (outside collectives) over the median of all
    ranks. In synchronous training every rank's *step* time is the slowest rank's, so
    only the compute share tells who makes the others wait."""
    times = {
        r: p.compute_time
        for r, p in obs.progress.items()
        if r < world.size and p.epoch >= world.seats[r].since and p.compute_time > 0
    }
    if len(times) < max(2, world.size // 2 + 1):
        return {}
    ordered = sorted(times.values())
    median = ordered[len(ordered) // 2]
    return {r: t / median for r, t in times.items()} if median > 0 else {}


def stragglers(obs: JobSnapshot, world: World, threshold: float) -> list[Loss]:
    return [
        Loss(r, world.seats[r].node, "straggler", f"straggler: {score:.1f}x the median compute time per step")
        for r, score in sorted(straggler_scores(obs, world).items())
        if score >= threshold
    ]


def _finished(obs: JobSnapshot, rank: int, seat: Seat) -> bool:
    d = obs.done.get(rank)
    return d is not None and d.get("epoch", 0) >= seat.since


def _reconcile(obs: JobSnapshot, spec: JobSpec, world: World) -> Decision:
    # A rank marks itself done only after the final barrier completed, which needs every
    # rank to have finished its last step: one done rank means the job is complete, even
    # if another rank dies before it could write its own mark.
    finished = [r for r, s in enumerate(world.seats) if _finished(obs, r, s)]
    if finished:
        return Decision(
            "succeed",
            f"all {_plural(world.size, 'rank')} finished {spec.steps} steps",
            clear_reports=tuple((rep.node, rep.rank) for rep in obs.reports),
        )
    losses, stale = find_losses(obs, world)
    if not losses and spec.on_straggler == "replace":
        slow = stragglers(obs, world, spec.straggler_threshold)
        if slow and _choose_spares(obs, world, slow, {lo.node for lo in slow}, {lo.rank for lo in slow}):
            losses = slow  # replace them like failures; without a spare they are only reported
    if not losses:
        grow = _grow(obs, spec, world, tuple(stale))
        if grow is not None:
            return grow
        short = spec.ranks - world.size
        return Decision(
            "none",
            f"epoch {world.epoch}: {_plural(world.size, 'rank')} healthy"
            + (f" ({short} below ranks={spec.ranks}; growing back once a warm worker is free)"
               if short > 0 else ""),
            clear_reports=tuple(stale),
        )

    handled = tuple(stale) + tuple((lo.node, lo.rank) for lo in losses)
    fatal = [lo for lo in losses if lo.kind == "fatal"]
    if fatal:  # every member hit it: a spare would only restore nothing again
        return Decision(
            "fail",
            "; ".join(f"rank {lo.rank} on {lo.node}: {lo.detail}" for lo in fatal)
            + "; the job cannot continue from any copy of its state",
            losses=tuple(losses),
            clear_reports=handled,
        )
    failed_nodes = {lo.node for lo in losses}
    lost_ranks = {lo.rank for lo in losses}
    chosen = _choose_spares(obs, world, losses, failed_nodes, lost_ranks)
    what = "; ".join(f"rank {lo.rank} on {lo.node}: {lo.detail}" for lo in losses)
    if chosen is not None:
        seats = list(world.seats)
        for lo, name in zip(losses, chosen, strict=True):
            seats[lo.rank] = Seat(name, obs.nodes[name].incarnation, world.epoch + 1,
                                  _sid(world, lo.rank, lo.rank))  # the spare restores the lost state
        new = World(
            epoch=world.epoch + 1,
            seats=tuple(seats),
            reason=what,
            lost=tuple(sorted(lost_ranks)),
        )
        moves = ", ".join(f"rank {lo.rank} -> {n}" for lo, n in zip(losses, chosen, strict=True))
        return Decision(
            "swap",
            f"{what}; swapping in spare ({moves}) at epoch {new.epoch}",
            world=new,
            losses=tuple(losses),
            spares=tuple(chosen),
            clear_reports=handled,
        )

    policy = spec.on_no_spare
    free = _free_capacity(obs, world, failed_nodes, lost_ranks)
    have = sum(free.values())
    short = f"{what}; no spare left ({have} free slot(s) for {len(losses)} lost rank(s))"
    if policy == "fail":
        return Decision(
            "fail",
            f"{short}; on_no_spare=fail, so the job fails. Add spare nodes (spares: N) or use "
            "on_no_spare: wait|shrink to keep it alive",
            losses=tuple(losses),
            clear_reports=handled,
        )
    if policy == "shrink":
        survivors = [s for r, s in enumerate(world.seats) if r not in lost_ranks]
        min_ranks = spec.min_ranks
        if len(survivors) < min_ranks:
            return Decision(
                "fail",
                f"{short}; shrinking would leave {len(survivors)} rank(s) < min_ranks={min_ranks}",
                losses=tuple(losses),
                clear_reports=handled,
            )
        # a survivor whose rank number changes holds a new rank from the new epoch on, so
        # reports about the old holder of that number are recognised as stale
        first_lost = min(lost_ranks)
        kept = [r for r in range(world.size) if r not in lost_ranks]
        seats = tuple(
            Seat(s.node, s.incarnation, s.since if i < first_lost else world.epoch + 1,
                 _sid(world, old, i))  # a renumbered survivor keeps its state's name
            for i, (old, s) in enumerate(zip(kept, survivors, strict=True))
        )
        new = World(
            epoch=world.epoch + 1,
            seats=seats,
            reason=what,
            lost=tuple(sorted(lost_ranks)),
            shrunk_from=world.size,
        )
        return Decision(
            "shrink",
            f"{short}; shrinking to {_plural(new.size, 'rank')} at epoch {new.epoch}",
            world=new,
            losses=tuple(losses),
            clear_reports=handled,
        )
    return Decision(
        "wait",
        f"{short}; waiting for a spare node to join (on_no_spare=wait)",
        losses=tuple(losses),
    )


def _sid(world: World, old_rank: int, new_rank: int) -> int:
    """The sid a seat moving from ``old_rank`` to ``new_rank`` keeps (-1: equal to the rank)."""
    sid = world.sid(old_rank)
    return -1 if sid == new_rank else sid


def _grow(obs: JobSnapshot, spec: JobSpec, world: World, stale: tuple) -> Decision | None:
    """A healthy world below ``ranks`` (after a shrink) grows back onto warm free workers.

    Only warm workers are taken, so the members wait for the newcomers' rendezvous, not
    for their interpreter start; a partial grow is fine (each joins when warm). New seats
    go at the end (no survivor is renumbered) with fresh sids: they have no state of their
    own and take a member's (data-parallel replicas are identical), see recovery/session.py.
    """
    missing = spec.ranks - world.size
    if missing <= 0:
        return None
    free = _free_capacity(obs, world, set(), set())
    warm = {name: obs.nodes[name].warm for name in free}
    chosen: list[str] = []
    for _ in range(missing):
        cands = sorted(
            (obs.nodes[n] for n, f in free.items() if f > 0 and warm[n] > 0),
            key=lambda n: (n.role != "spare", -free[n.name], n.name),
        )
        if not cands:
            break
        pick = cands[0].name
        free[pick] -= 1
        warm[pick] -= 1
        chosen.append(pick)
    if not chosen:
        return None
    epoch = world.epoch + 1
    new_seats = tuple(
        # unique for the job's life: initial sids are < ranks, and each epoch has its own range
        Seat(name, obs.nodes[name].incarnation, epoch, epoch * spec.ranks + i)
        for i, name in enumerate(chosen)
    )
    new = World(
        epoch=epoch,
        seats=world.seats + new_seats,
        reason=f"growing back towards {spec.ranks} ranks",
        grown_from=world.size,
    )
    moves = ", ".join(f"rank {world.size + i} -> {n}" for i, n in enumerate(chosen))
    return Decision(
        "grow",
        f"epoch {world.epoch}: {_plural(world.size, 'rank')} of {spec.ranks}; growing to "
        f"{_plural(new.size, 'rank')} ({moves}) at epoch {epoch}",
        world=new,
        spares=tuple(chosen),
        clear_reports=stale,
    )


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


def _choose_spares(
    obs: JobSnapshot,
    world: World,
    losses: list[Loss],
    failed_nodes: set[str],
    lost_ranks: set[int],
) -> list[str] | None:
    """One node per loss, never a failed node; prefer spare-role, warm, emptier nodes."""
    free = _free_capacity(obs, world, failed_nodes, lost_ranks)

    warm = {name: obs.nodes[name].warm for name in free}

    def rank_key(n: Node) -> tuple:
        return (n.role != "spare", warm[n.name] <= 0, -free.get(n.name, 0), n.name)

    chosen: list[str] = []
    for _ in losses:
        cands = sorted((obs.nodes[name] for name, f in free.items() if f > 0), key=rank_key)
        if not cands:
            return None
        pick = cands[0].name
        free[pick] -= 1
        warm[pick] -= 1  # its warm worker is taken by this pick
        chosen.append(pick)
    return chosen
