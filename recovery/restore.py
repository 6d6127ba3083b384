"""Where a member's state comes from after a failure, and how the members agree on it.

After every (re)join, the members of the epoch agree on the newest step all of them can
restore, then restore it: two small allreduces (:class:`RestoreAgreement`). What a member can
restore from is a :class:`StateSource` -- torchft's ``CheckpointTransport`` shape: the steps
it offers, and loading one of them into the tracked state:

* :class:`LocalSlots` -- the member's own snapshot slots (a survivor: no copy at all);
* :class:`PeerReplicas` -- the replica holders of its sid on other nodes (a spare that took
  a lost rank's seat);
* :class:`PersistentTier` -- the persisted checkpoints, when some lost rank has no replica
  left (every member rolls back to one);
* :class:`DonorBroadcast` -- another member's state, broadcast to the seats a grow added
  (they hold nothing of their own).

A fifth source (say, a GPU peer-to-peer copy) is one more class with ``offer`` and ``load``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from hotspare.orchestrator.store import EventKind, JobStore, Node

from .errors import Unrecoverable
from .final import load_rank
from .persist import checkpoint_path, complete_steps, read_manifest
from .process_group import ReconfigurableProcessGroup
from .replica_client import fetch_first, list_points
from .slot_receipt import SlotReceipt
from .snapshot import SnapshotEngine, restore, tensors_from_bytes
from .state import reseed

log = logging.getLogger(__name__)

WINDOW = 64  # steps considered when agreeing on a common snapshot (newest - 63 .. newest)

Holder = tuple[str, str, int]  # (node, host, replica port)


class StepFailed(Exception):
    """A collective of the recovery protocol failed: wait for the next epoch."""


class _AskWider(Exception):
    """No step is common and some member has wider sources: every member agrees once more
    with them added (:meth:`RestoreAgreement.run`)."""


@dataclass(frozen=True)
class Membership:
    """This member's place in the epoch being joined."""

    rank: int
    size: int
    epoch: int


class Loaded(NamedTuple):
    """What a source restored: the step (the one asked for, or for the persisted tier
    possibly an older one), how the ``restored`` event names the source, the bytes moved."""

    step: int
    source: str
    nbytes: int


class StateSource(Protocol):
    """One place this member's state of some steps can be restored from."""

    def offer(self) -> set[int]:
        """The steps this source can restore (asked once per agreement)."""
        ...

    def load(self, step: int) -> Loaded:
        """Restore ``step`` into the tracked state (and the member's snapshot slots, so it is
        a local step from now on)."""
        ...


@dataclass(frozen=True)
class Restored:
    """The outcome of one agreement, for the session's ``restored`` event."""

    step: int
    source: str
    nbytes: int
    seconds: float
    seated: bool = False  # this member holds state of its own now (it was a fresh start or a grown seat)
    clean: bool = True  # the tracked state is exactly the snapshot of ``step``

    def info(self) -> dict:
        return {"source": self.source, "bytes": self.nbytes, "seconds": self.seconds}


#: "no timeline to compare" in the restore agreement (a fresh seat; a holder too old to say)
UNKNOWN = 2**62


def timeline_of(source: object, step: int) -> int | None:
    """The timeline of ``source``'s copy of ``step`` (None: unknown or not a snapshot source)."""
    fn = getattr(source, "timeline", None)
    return fn(step) if callable(fn) else None


class LocalSlots:
    """The member's own snapshot slots. ``live_step``: the step the tracked state still
    equals (no optimizer step since that snapshot), or None; restoring that very step reloads
    only the small state (RNG, data position...), since the rest is already right."""

    def __init__(self, engine: SnapshotEngine, live_step: int | None) -> None:
        self.engine = engine
        self.live_step = live_step
        self._steps: set[int] | None = None

    def offer(self) -> set[int]:
        if self._steps is None:
            self._steps = set(self.engine.available())
        return self._steps

    def timeline(self, step: int) -> int | None:
        return self.engine.timeline_of(step)

    def load(self, step: int) -> Loaded:
        skip = {n for n, p in self.engine.providers if p.async_ok} if step == self.live_step else set()
        self.engine.load_local(step, skip=skip)
        self.engine.invalidate_after(step)  # newer snapshots are another future now
        return Loaded(step, "own snapshot" + (" (small state only)" if skip else ""), 0)


class PeerReplicas:
    """The agents that hold replicas of this seat's sid (its lost predecessor's points)."""

    def __init__(self, js: JobStore, sid: int, engine: SnapshotEngine, replicas: int = 1) -> None:
        self.js = js
        self.sid = sid
        self.engine = engine
        self.replicas = replicas
        self._secret = b""
        self._holders: dict[int, list[Holder]] = {}
        self.asked = 0  # agents asked by the last offer() (what benchmarks/scale.py counts)
        self._timeline: dict[int, dict[int | None, list[str]]] = {}  # step -> timeline -> holders

    #: how many epochs back :meth:`likely_holders` looks for the node that last ran this sid
    LOOKBACK = 8

    def likely_holders(self) -> list[str]:
        """Each node that ran this sid in the last :attr:`LOOKBACK` epochs, newest first (it
        keeps a crashed worker's slots), followed by its next few ring successors in that
        world (they got its points). Not only the newest: a seat whose worker crashed and
        whose spare was lost before it replicated a point of its own (or a survivor in that
        seat, asking after a second failure) finds its points with the node before. Empty
        when no earlier world ran this sid (a fresh job)."""
        epoch = self.js.epoch()
        out: list[str] = []
        for e in range(epoch - 1, max(epoch - 1 - self.LOOKBACK, 0), -1):
            world = self.js.world(e)
            if world is None:
                continue
            prev = [world.seats[r].node for r in range(world.size) if world.sid(r) == self.sid]
            if prev and prev[0] not in out:
                near = [prev[0], *world.successors(prev[0])[: 2 * self.replicas + 2]]
                out += [n for n in near if n not in out]
        return out

    def offer(self) -> set[int]:
        """Asks the likely holders (:meth:`likely_holders`) which steps they hold, and every
        live agent only when none of those has any: O(replicas) agents, not O(nodes). The
        answer is kept for :meth:`load`."""
        if not self._secret:
            self._secret = self.js.secret()
        self._timeline = {}
        names = self.likely_holders()
        found = self._ask(self.js.nodes(names).values()) if names else {}
        if not found:
            found = self._ask(self.js.snapshot(progress=False).nodes.values())
        self._holders = found
        return set(found)

    def _ask(self, nodes: Iterable[Node]) -> dict[int, list[Holder]]:
        found: dict[int, list[Holder]] = {}
        for n in nodes:
            if not n.replica_port:
                continue
            self.asked += 1
            try:
                for s, tl in list_points(n.host, n.replica_port, self._secret, self.sid).items():
                    found.setdefault(s, []).append((n.name, n.host, n.replica_port))
                    self._timeline.setdefault(s, {}).setdefault(tl, []).append(n.name)
            except Exception as e:  # noqa: BLE001 - a dead or partitioned holder
                log.info("replica holder %s unreachable: %s", n.name, e)
        return found

    def _of_timeline(self, step: int) -> list[Holder]:
        """The holders of ``step`` in :meth:`timeline`'s timeline (or whose holder cannot say)."""
        tl, by = self.timeline(step), self._timeline.get(step, {})
        ok = set(by.get(tl, ())) | set(by.get(None, ()))
        return [h for h in self._holders[step] if tl is None or h[0] in ok]

    def timeline(self, step: int) -> int | None:
        """The newest timeline held of ``step`` (copies of an older one are left out of
        :meth:`load`): a pre-rollback copy never wins over the recomputed one."""
        known = [t for t in self._timeline.get(step, {}) if t is not None]
        return max(known) if known else None

    def load(self, step: int) -> Loaded:
        """The first usable holder's copy, received straight into one of this member's snapshot
        slots (:class:`~hotspare.recovery.slot_receipt.SlotReceipt`: the only copy held here), then
        restored from it; the slot is this member's snapshot of ``step`` from then on."""
        with SlotReceipt(self.engine, step) as slot:
            _, body, holder = fetch_first(self._of_timeline(step), self._secret, self.sid, step, into=slot.buffer)
            nbytes = len(body)
            slot.complete()
        return Loaded(step, f"replica on {holder}", nbytes)


class PersistentTier:
    """The persisted checkpoints of this world size under ``root``: the fallback when no
    step is held by every member.

    It offers its newest complete checkpoint. Loading is collective: each member first reads
    and verifies its own file; only if every member could (a MIN allreduce of an ok flag) do
    they restore it. Otherwise they all move on to the next older complete checkpoint, so one
    corrupt, truncated or pruned file never leaves the others waiting in a collective. None
    left: :class:`Unrecoverable`, in every member.
    """

    def __init__(self, root: str, engine: SnapshotEngine, pg: ReconfigurableProcessGroup,
                 me: Membership, event: Callable[..., None]) -> None:
        self.root = root
        self.engine = engine
        self.pg = pg
        self.me = me
        self.event = event

    def newest(self, below: int | None = None) -> int:
        """Newest complete checkpoint of this world size (older than ``below``), or -1."""
        try:  # never let the fallback's lookup break a recovery that may not need it
            for step in reversed(complete_steps(self.root)):
                if below is not None and step >= below:
                    continue
                if int(read_manifest(self.root, step)["world_size"]) == self.me.size:
                    return step
        except Exception as e:  # noqa: BLE001 - CheckpointError, fsspec/object-store errors
            log.warning("persisted checkpoints in %s not usable: %s", self.root, e)
        return -1

    def offer(self) -> set[int]:
        step = self.newest()
        return {step} if step >= 0 else set()

    def load(self, step: int) -> Loaded:
        """``step`` or, if some member cannot read its file of it, the newest older complete
        checkpoint every member can read."""
        refused: list[str] = []
        while step >= 0:
            got = self._read(step)
            flag = torch.tensor([0 if got is None else 1, self.newest(below=step)], dtype=torch.int64)
            if not self.pg.allreduce_(flag, dist.ReduceOp.MIN):
                raise StepFailed()
            if flag[0].item() == 1:
                assert got is not None  # every member read its file, this one included
                nbytes = self._apply(step, *got)
                return Loaded(step, f"persisted checkpoint {checkpoint_path(self.root, step)}"
                              + (f" (step(s) {', '.join(refused)} unusable)" if refused else ""), nbytes)
            refused.append(str(step))
            step = int(flag[1].item())  # the newest older one every member sees
        raise Unrecoverable(
            f"no usable persisted checkpoint in {self.root}: step(s) {', '.join(refused)} could not be read by "
            "every member (see the checkpoint-unusable events) and no older complete one exists"
        )

    def resume(self) -> Loaded:
        """Collective: restore the newest checkpoint every member sees (a run's start with
        ``resume_from``). None at all: :class:`Unrecoverable`, in every member (asked to
        resume, the run does not silently start from scratch)."""
        newest = torch.tensor([self.newest()], dtype=torch.int64)
        if not self.pg.allreduce_(newest, dist.ReduceOp.MIN):
            raise StepFailed()
        step = int(newest.item())
        if step < 0:
            raise Unrecoverable(f"cannot resume: no complete checkpoint of {self.me.size} ranks in {self.root} "
                                "is readable by every rank; run without --resume to start from step 0")
        return self.load(step)

    def _read(self, step: int) -> tuple[dict[str, torch.Tensor], dict, dict] | None:
        """(tensors, meta, manifest) of this member's file of ``step``; None if unusable."""
        try:
            m = read_manifest(self.root, step)
            tensors, meta = load_rank(self.root, step, self.me.rank, m)
            return tensors, meta, m
        except Exception as e:  # noqa: BLE001 - CheckpointError names the file; object-store errors
            log.error("persisted checkpoint of step %d unusable here: %s", step, e)
            self.event(EventKind.CHECKPOINT_UNUSABLE, f"rank {self.me.rank}: {e}", rank=self.me.rank,
                       step=step, epoch=self.me.epoch)
            return None

    def _apply(self, step: int, tensors: dict[str, torch.Tensor], meta: dict, manifest: dict) -> int:
        restore(self.engine.providers, tensors, meta)
        self.engine.invalidate_after(-2)
        timelines = {rec.get("timeline") for rec in manifest["files"].values()}
        self.engine.capture(step, timeline=timelines.pop() if len(timelines) == 1 else None)
        self.engine.wait()
        return sum(t.numel() * t.element_size() for t in tensors.values())


class DonorBroadcast:
    """Seats added by a grow have no state of their own: the lowest-ranked member that has
    some broadcasts its restored snapshot of the agreed step (data-parallel replicas hold
    identical parameters, optimizer, scheduler and data position). A fresh rank keeps all of
    it but the RNGs, which it seeds from the donor's RNG state and its own rank:
    deterministic, and distinct per rank. Its data shard follows from the shared global
    position and its rank (e.g. :class:`hotspare.recovery.sampler.ElasticSampler`)."""

    def __init__(self, engine: SnapshotEngine, pg: ReconfigurableProcessGroup, me: Membership,
                 fresh_ranks: Sequence[int]) -> None:
        self.engine = engine
        self.pg = pg
        self.me = me
        self.fresh_ranks = list(fresh_ranks)
        self.donor = min(r for r in range(me.size) if r not in self.fresh_ranks)

    def offer(self) -> set[int]:
        return set()  # a grown seat constrains nothing: it takes the step the others agree on

    def load(self, step: int) -> Loaded:
        """Collective: every member calls it. A fresh seat restores what the donor sent and
        says so; every other member gets an empty source back (it keeps its own)."""
        sizes = torch.zeros(2, dtype=torch.int64)
        payload = b""
        if self.me.rank == self.donor:
            header, body = self.engine.read(step)
            hb = json.dumps(header, separators=(",", ":")).encode()
            payload = hb + bytes(body)
            sizes[0], sizes[1] = len(hb), len(body)
        if not self.pg.broadcast_(sizes, self.donor):
            raise StepFailed()
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.zeros(int(sizes.sum().item()), dtype=torch.uint8)
        if not self.pg.broadcast_(buf, self.donor):
            raise StepFailed()
        if self.me.rank not in self.fresh_ranks:
            return Loaded(step, "", 0)
        hlen = int(sizes[0].item())
        raw = buf.numpy().tobytes()
        header = json.loads(raw[:hlen])
        restore(self.engine.providers, tensors_from_bytes(header, raw[hlen:]), header["meta"])
        digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + f"/{self.me.rank}".encode()).digest()
        reseed(int.from_bytes(digest[:8], "little") >> 1)
        self.engine.capture(step, timeline=header.get("timeline"))
        self.engine.wait()
        return Loaded(step, f"peer rank {self.donor} (grown seat)", len(raw) - hlen)


class RestoreAgreement:
    """Agree on the newest step every member can restore, then restore it.

    Survivors offer the steps in their own snapshot slots; a newcomer (spare) offers the steps
    replica holders have for its sid. Two small allreduces: MAX of each member's newest step
    (and of a flag per rank: "my seat is fresh from a grow"), then MIN of an availability mask
    over the ``WINDOW`` steps below it (plus each member's newest persisted checkpoint). A
    fresh seat constrains nothing; it receives a member's state once the others have restored
    (:class:`DonorBroadcast`). No common step: every member rolls back to the persisted tier.
    A third allreduce (MIN) says whether every member loaded the step: a member whose load
    failed (its replica holder died mid-fetch, say) withdraws that step from its offer and all
    of them agree again, so nobody trains on while one member is left without its state.

    A member may also bring ``wider`` sources, asked only when no step is common (the first
    allreduce carries whether any member has one): a spare that restored a ring step after a
    worker crash holds none of its seat's older points, but its seat's replica holders still
    do, and a second node loss soon after may need exactly those. Then every member agrees
    once more with its wider sources added, before anyone falls back to the persisted tier.

    ``phase(name, step)`` is called as a member reaches a phase of the restore (chaos
    entries scheduled ``during`` it; ``step``: the step training resumes at).
    """

    def __init__(self, pg: ReconfigurableProcessGroup, engine: SnapshotEngine, me: Membership,
                 phase: Callable[[str, int], None] = lambda name, step: None) -> None:
        self.pg = pg
        self.engine = engine
        self.me = me
        self.phase = phase
        self._failed: list[str] = []  # why this member's loads failed, for an Unrecoverable's sentence

    def run(self, sources: Sequence[StateSource], tier: PersistentTier, fresh: bool,
            started: float | None = None, resume: PersistentTier | None = None,
            wider: Sequence[StateSource] = ()) -> Restored:
        """``fresh``: this member's seat was added by a grow and holds nothing. ``started``:
        when the restore began (the ``seconds`` reported count from it; default now).
        ``resume``: the previous run's checkpoints (``hotspare run --resume``), restored
        instead of a fresh start when nobody holds any state yet. ``wider``: sources asked
        only if the members hold no common step."""
        t0 = time.time() if started is None else started
        sources = list(sources)
        refused: list[set[int]] = [set() for _ in sources]  # per source: steps it failed to load
        while True:
            try:
                done = self._round(sources, refused, tier, fresh, t0, resume, bool(wider))
            except _AskWider:
                sources += wider
                refused += [set() for _ in wider]
                wider = ()
                continue
            if done is not None:
                return done

    def _round(self, sources: Sequence[StateSource], refused: list[set[int]], tier: PersistentTier, fresh: bool,
               t0: float, resume: PersistentTier | None, wider: bool) -> Restored | None:
        """One agreement and load; None if some member could not load the agreed step;
        :class:`_AskWider` if no step is common and some member has wider sources."""
        offers = [s.offer() - no for s, no in zip(sources, refused, strict=True)]
        offer: set[int] = set().union(*offers)
        top, fresh_ranks, anyone_wider = self._newest(offer, fresh, wider)
        if top == -2 and resume is not None:  # nothing yet: start where the resumed run was
            got = resume.resume()
            return Restored(got.step, got.source, got.nbytes, round(time.time() - t0, 4), seated=True)
        if top == -2:  # nobody holds any state: a fresh start
            self.engine.capture(-1)
            self.engine.wait()
            return Restored(-1, "fresh start", 0, 0.0, seated=True, clean=False)
        timelines = {st: tl for src, o in zip(reversed(sources), reversed(offers), strict=True)
                     for st in o if (tl := timeline_of(src, st)) is not None}
        common, persisted = self._common(top, offer, fresh, tier, timelines)
        if not common and anyone_wider:
            log.info("rank %d: no step of %s is common; agreeing again with the seats' replica holders",
                     self.me.rank, sorted(offer)[-5:])
            raise _AskWider()
        if not common and persisted >= 0:
            self.phase("restore", persisted + 1)
            got = tier.load(persisted)  # maybe an older checkpoint than ``persisted``
            return Restored(got.step, got.source, got.nbytes, round(time.time() - t0, 4))
        if not common:
            raise Unrecoverable(
                f"rank {self.me.rank}: no snapshot step is held by every member of epoch {self.me.epoch} "
                f"(this rank offers {sorted(offer)[-5:]}, newest anywhere {top}) and there is no "
                f"complete persisted checkpoint in {tier.root}: the state of a lost rank "
                "and all its replicas is gone (set persist_every to survive this)"
                + (f"; loading failed here: {'; '.join(self._failed[-3:])}" if self._failed else "")
            )
        step = max(common)
        self.phase("restore", step + 1)
        got: Loaded | None = Loaded(step, "", 0)
        if not fresh:
            i = next(i for i, o in enumerate(offers) if step in o)
            got = self._load(sources[i], step)
            if got is None:
                refused[i].add(step)
        if not self._all_loaded(got is not None):
            return None  # some member could not load it: agree again without what failed
        assert got is not None
        if fresh_ranks:
            sent = DonorBroadcast(self.engine, self.pg, self.me, fresh_ranks).load(step)
            if fresh:  # filled in by the transfer
                got = sent
        return Restored(step, got.source, got.nbytes, round(time.time() - t0, 4), seated=fresh)

    def _load(self, source: StateSource, step: int) -> Loaded | None:
        """``source.load(step)``; None (logged) if it failed: a replica holder that died or
        answers garbage, a slot that cannot be read."""
        if isinstance(source, PeerReplicas):
            self.phase("fetch", step + 1)
        try:
            return source.load(step)
        except Unrecoverable:  # this node cannot hold the state at all (ShmTooSmall): the job ends with it
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke, the members agree again without it
            log.warning("restoring step %d from %s failed (%s: %s); agreeing on another step",
                        step, type(source).__name__, type(e).__name__, e)
            self._failed.append(f"step {step} from {type(source).__name__}: {e}")
            return None

    def _all_loaded(self, ok: bool) -> bool:
        """Third allreduce (MIN): whether every member loaded the agreed step."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        if not self.pg.allreduce_(flag, dist.ReduceOp.MIN):
            raise StepFailed()
        return bool(flag.item())

    def _newest(self, offer: set[int], fresh: bool, wider: bool) -> tuple[int, list[int], bool]:
        """First allreduce (MAX): the newest step anywhere (-2: none), the fresh seats, and
        whether any member has wider sources to ask should no step be common."""
        head = torch.zeros(2 + self.me.size, dtype=torch.int64)
        head[0] = max(offer) if offer else -2
        head[1 + self.me.rank] = int(fresh)
        head[-1] = int(wider)
        if not self.pg.allreduce_(head, dist.ReduceOp.MAX):
            raise StepFailed()
        fresh_ranks = [r for r in range(self.me.size) if head[1 + r].item()]
        return int(head[0].item()), fresh_ranks, bool(head[-1].item())

    def _common(self, top: int, offer: set[int], fresh: bool, tier: PersistentTier,
                timelines: dict[int, int] | None = None) -> tuple[list[int], int]:
        """Second allreduce (MIN): the steps below ``top`` every member holds *in one
        timeline*, and the newest persisted checkpoint every member sees (-1: none).

        A step computed again after a rollback is another state (another timeline): a
        buddy may still hold the lost rank's copy from before the rollback while the
        survivors hold the recomputed one, identical only where training is deterministic
        (security review F20). Each member adds, per step, its copy's timeline t and -t; the
        MIN of both gives the lowest and the highest, and a step whose copies differ is not
        common. A member with no constraint (a fresh seat; a copy whose timeline is unknown)
        adds ``UNKNOWN`` to both."""
        timelines = timelines or {}
        persisted = max(tier.offer(), default=-1)
        held = [1 if fresh or top - i in offer else 0 for i in range(WINDOW)]
        tl = [UNKNOWN if fresh else timelines.get(top - i, UNKNOWN) for i in range(WINDOW)]
        mask = torch.tensor(held + [persisted] + tl + [UNKNOWN if t == UNKNOWN else -t for t in tl],
                            dtype=torch.int64)
        if not self.pg.allreduce_(mask, dist.ReduceOp.MIN):
            raise StepFailed()
        low, high = mask[WINDOW + 1: 2 * WINDOW + 1], mask[2 * WINDOW + 1:]

        def one_timeline(i: int) -> bool:
            lo, neg_hi = int(low[i].item()), int(high[i].item())
            return lo == UNKNOWN or neg_hi == UNKNOWN or lo == -neg_hi

        return ([top - i for i in range(WINDOW) if mask[i].item() == 1 and one_timeline(i)],
                int(mask[WINDOW].item()))
