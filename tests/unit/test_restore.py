"""The restore agreement and its state sources, one member in a scripted group: the other
members' contributions to each collective are given, so every outcome of the three
allreduces (and of the persisted tier's ok-flag round) is reachable without processes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from hotspare.recovery.checkpoint_writer import write_rank
from hotspare.recovery.persist import try_finish
from hotspare.recovery.restore import (
    UNKNOWN,
    WINDOW,
    DonorBroadcast,
    Loaded,
    LocalSlots,
    Membership,
    PeerReplicas,
    PersistentTier,
    RestoreAgreement,
    StepFailed,
    Unrecoverable,
)
from hotspare.recovery.slotfile import open_slot
from hotspare.recovery.snapshot import SnapshotEngine


class ScriptedGroup:
    """A group whose other members contributed ``others``: one tensor per collective, in
    order (None: the collective fails)."""

    def __init__(self, *others: torch.Tensor | None) -> None:
        self.others = list(others)

    def _next(self) -> torch.Tensor | None:
        assert self.others, "a collective the test did not expect"
        return self.others.pop(0)

    def allreduce_(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> bool:
        other = self._next()
        if other is None:
            return False
        t.copy_(torch.maximum(t, other) if op == dist.ReduceOp.MAX else torch.minimum(t, other))
        return True

    def broadcast_(self, t: torch.Tensor, src: int) -> bool:
        other = self._next()
        if other is None:
            return False
        if other.numel():  # empty: this member is the source
            t.copy_(other)
        return True


class Weights:
    """A provider: one parameter-like tensor, copied lazily like a model's."""

    async_ok = True

    def __init__(self) -> None:
        self.t = torch.zeros(8)

    def tensors(self):
        return {"w": self.t}

    def meta(self):
        return {}

    def load(self, tensors, meta):
        self.t.copy_(tensors["w"])


def _engine(d, steps=(), every=10):
    eng = SnapshotEngine(d, sid=0, replicate_every=every, replication_timeout=0.01)
    w = Weights()
    eng.providers = [("m", w)]
    for s in steps:
        w.t.fill_(float(s))
        eng.capture(s)
        eng.wait()
    return eng, w


#: the other members' word in the third allreduce: every one of them loaded the agreed step
_LOADED = torch.tensor([1])


def _head(top: int, *fresh: int, wider: int = 0) -> torch.Tensor:
    """The other members' word in the first allreduce: their newest step, which seats are
    fresh, and whether any of them has wider sources to ask should no step be common."""
    return torch.tensor([top, *fresh, wider], dtype=torch.int64)


def _mask(steps_held: set[int], top: int, persisted: int, timelines: dict[int, int] | None = None) -> torch.Tensor:
    """The other members' word in the second allreduce: which steps they hold, their newest
    persisted step, and per step the timeline of their copy (t, then -t; UNKNOWN: no word)."""
    tl = [(timelines or {}).get(top - i, UNKNOWN) for i in range(WINDOW)]
    return torch.tensor([1 if top - i in steps_held else 0 for i in range(WINDOW)] + [persisted]
                        + tl + [UNKNOWN if t == UNKNOWN else -t for t in tl], dtype=torch.int64)


def _checkpoint(tmp_path, step: int, size: int) -> str:
    """A complete persisted checkpoint of ``step`` for ``size`` ranks (weights = step)."""
    eng, _ = _engine(tmp_path / f"ckpt-src{step}", steps=[-1, step])
    view = open_slot(eng.path(eng.nring + 1))  # point 1 holds ``step``
    root = tmp_path / "ckpt"
    for r in range(size):
        write_rank(view, root, rank=r, job="t", timeline=1, world_size=size)
    assert try_finish(root, step, size, "t")
    view.close()
    eng.close()
    return str(root)


def _damage(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_nobody_holding_state_is_a_fresh_start(tmp_path):
    eng, _ = _engine(tmp_path)
    me = Membership(rank=0, size=2, epoch=1)
    pg = ScriptedGroup(_head(-2, 0, 0))
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None)], tier, fresh=False)
    assert (r.step, r.source, r.seated, r.clean) == (-1, "fresh start", True, False)
    assert eng.available() == [-1]
    eng.close()


def test_a_survivor_restores_the_newest_step_every_member_holds(tmp_path):
    eng, w = _engine(tmp_path, steps=[-1, 1, 2, 3])  # ring: 2, 3; points: -1
    me = Membership(rank=0, size=2, epoch=2)
    # the other member is newer (step 4) but also holds 2: 2 is the newest common step
    pg = ScriptedGroup(_head(4, 0, 0), _mask({2, 4}, 4, -1), _LOADED)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, live_step=3)], tier, fresh=False)
    assert (r.step, r.source, r.nbytes) == (2, "own snapshot", 0)
    assert torch.equal(w.t, torch.full((8,), 2.0))
    assert eng.available() == [-1, 2], "step 3 is another future after the rollback"
    eng.close()


def test_restoring_the_step_the_state_still_equals_reloads_only_small_state(tmp_path):
    eng, w = _engine(tmp_path, steps=[-1, 1, 2])
    w.t.fill_(99.0)  # not what the snapshot holds: proves the big state is not reloaded
    me = Membership(rank=0, size=1, epoch=2)
    pg = ScriptedGroup(_head(2, 0), _mask({2}, 2, -1), _LOADED)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, live_step=2)], tier, fresh=False)
    assert r.source == "own snapshot (small state only)" and torch.equal(w.t, torch.full((8,), 99.0))
    eng.close()


def test_no_common_step_rolls_every_member_back_to_the_persisted_checkpoint(tmp_path):
    root = _checkpoint(tmp_path, 10, size=2)
    eng, w = _engine(tmp_path / "shm", steps=[-1, 20, 21])
    me = Membership(rank=1, size=2, epoch=3)
    events = []
    pg = ScriptedGroup(_head(30, 0, 0), _mask({30}, 30, 10), torch.tensor([1, -1]))
    tier = PersistentTier(root, eng, pg, me, lambda *a, **k: events.append(a))
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None)], tier, fresh=False)
    assert r.step == 10 and r.source == f"persisted checkpoint {root}/step00000010" and r.nbytes == 32
    assert torch.equal(w.t, torch.full((8,), 10.0)) and eng.available() == [10] and not events
    eng.close()


def test_a_member_that_cannot_read_its_file_makes_all_refuse_that_checkpoint(tmp_path):
    root = _checkpoint(tmp_path, 10, size=2)
    _damage(tmp_path / "ckpt" / "step00000010" / "rank1.safetensors")
    eng, _ = _engine(tmp_path / "shm", steps=[-1, 20])
    me = Membership(rank=1, size=2, epoch=3)
    events = []
    pg = ScriptedGroup(_head(30, 0, 0), _mask({30}, 30, 10), torch.tensor([1, -1]))
    tier = PersistentTier(root, eng, pg, me, lambda *a, **k: events.append((a, k)))
    with pytest.raises(Unrecoverable, match=r"step\(s\) 10 could not be read by every member"):
        RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None)], tier, fresh=False)
    [((kind, message), data)] = events
    assert kind == "checkpoint-unusable" and "rank1.safetensors: corrupt" in message
    assert data == {"rank": 1, "step": 10, "epoch": 3}
    eng.close()


def test_all_members_fall_back_to_the_next_older_checkpoint_one_of_them_can_read(tmp_path):
    _checkpoint(tmp_path, 10, size=2)
    root = _checkpoint(tmp_path, 20, size=2)
    _damage(tmp_path / "ckpt" / "step00000020" / "rank1.safetensors")
    eng, w = _engine(tmp_path / "shm", steps=[-1, 25])
    me = Membership(rank=1, size=2, epoch=3)
    events = []
    # the other member reads both of its files: ok flags (1, newest older 10), then (1, none)
    pg = ScriptedGroup(_head(30, 0, 0), _mask({30}, 30, 20), torch.tensor([1, 10]), torch.tensor([1, -1]))
    tier = PersistentTier(root, eng, pg, me, lambda *a, **k: events.append(a))
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None)], tier, fresh=False)
    assert r.step == 10 and r.source == f"persisted checkpoint {root}/step00000010 (step(s) 20 unusable)"
    assert torch.equal(w.t, torch.full((8,), 10.0)) and eng.available() == [10]
    assert [kind for kind, _ in events] == ["checkpoint-unusable"]
    eng.close()


def test_no_common_step_and_no_checkpoint_is_unrecoverable_saying_why(tmp_path):
    eng, _ = _engine(tmp_path, steps=[-1, 5])
    me = Membership(rank=0, size=2, epoch=4)
    pg = ScriptedGroup(_head(30, 0, 0), _mask({30}, 30, -1))
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    with pytest.raises(Unrecoverable, match=r"rank 0: no snapshot step is held by every member of epoch 4 "
                                            r"\(this rank offers \[-1, 5\], newest anywhere 30\)"):
        RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None)], tier, fresh=False)
    eng.close()


def test_a_failed_collective_means_waiting_for_the_next_epoch(tmp_path):
    eng, _ = _engine(tmp_path, steps=[-1])
    me = Membership(rank=0, size=2, epoch=2)
    for script in ([None], [_head(-1, 0, 0), None]):
        pg = ScriptedGroup(*script)
        tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
        with pytest.raises(StepFailed):
            RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None)], tier, fresh=False)
    eng.close()


def test_a_grown_seat_takes_the_agreed_step_from_its_donor(tmp_path):
    donor, _ = _engine(tmp_path / "donor", steps=[-1, 7])
    header, body = donor.read(7)
    donor.close()
    hb = json.dumps(header, separators=(",", ":")).encode()
    payload = torch.frombuffer(bytearray(hb + body), dtype=torch.uint8)
    eng, w = _engine(tmp_path / "fresh")
    me = Membership(rank=1, size=2, epoch=5)
    pg = ScriptedGroup(_head(7, 0, 0), _mask({7}, 7, -1), _LOADED, torch.tensor([len(hb), len(body)]), payload)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None)], tier, fresh=True)
    assert (r.step, r.source, r.nbytes, r.seated) == (7, "peer rank 0 (grown seat)", len(body), True)
    assert torch.equal(w.t, torch.full((8,), 7.0)) and eng.available() == [7]
    assert DonorBroadcast(eng, pg, me, [1]).offer() == set()  # it constrains nothing
    eng.close()


class DyingHolder(PeerReplicas):
    """A spare's replica holders: step 19 was only on a holder that died mid-fetch; step 15
    is on another one (its weights are 15)."""

    def __init__(self, engine: SnapshotEngine) -> None:
        super().__init__(None, 1, engine)  # type: ignore[arg-type] - no etcd: offer/load are scripted
        self.offers = [{19, 15}, {15}]  # what the holders answer, round by round
        self.asked: list[int] = []

    def offer(self) -> set[int]:
        return self.offers.pop(0)

    def load(self, step: int):
        self.asked.append(step)
        if step == 19:
            raise RuntimeError("no usable replica of sid 1 at step 19: node1: [Errno 111] Connection refused")
        _, w = self.engine.providers[0]
        w.t.fill_(15.0)
        return Loaded(15, "replica on node2", 32)


def test_a_member_whose_fetch_fails_withdraws_the_step_and_every_member_agrees_again(tmp_path):
    eng, w = _engine(tmp_path)
    me = Membership(rank=1, size=2, epoch=2)
    phases: list[tuple[str, int]] = []
    # round 1: 19 is common, this member cannot load it (the others could: MIN gives 0);
    # round 2: this member offers 15 only, 15 is common, everyone loads it
    pg = ScriptedGroup(_head(19, 0, 0), _mask({19, 15}, 19, -1), _LOADED,
                       _head(19, 0, 0), _mask({19, 15}, 19, -1), _LOADED)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    holders = DyingHolder(eng)
    r = RestoreAgreement(pg, eng, me, phase=lambda name, step: phases.append((name, step))).run(
        [LocalSlots(eng, None), holders], tier, fresh=False)
    assert (r.step, r.source) == (15, "replica on node2") and torch.equal(w.t, torch.full((8,), 15.0))
    assert holders.asked == [19, 15] and not pg.others
    assert phases == [("restore", 20), ("fetch", 20), ("restore", 16), ("fetch", 16)]
    eng.close()


def test_a_survivor_agrees_again_when_another_member_could_not_load_the_step(tmp_path):
    eng, w = _engine(tmp_path, steps=[-1, 9, 10, 11])  # ring: 10, 11; points: -1, 9
    me = Membership(rank=0, size=2, epoch=2)
    failed = torch.tensor([0])  # the other member's word: it could not load step 11
    pg = ScriptedGroup(_head(11, 0, 0), _mask({11, 9}, 11, -1), failed,
                       _head(11, 0, 0), _mask({9}, 11, -1), _LOADED)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, live_step=11)], tier, fresh=False)
    assert (r.step, r.source) == (9, "own snapshot") and torch.equal(w.t, torch.full((8,), 9.0))
    assert eng.available() == [-1, 9] and not pg.others
    eng.close()


def test_loads_failing_until_no_step_is_common_is_unrecoverable_naming_the_failure(tmp_path):
    eng, _ = _engine(tmp_path)
    me = Membership(rank=1, size=2, epoch=2)
    holders = DyingHolder(eng)
    holders.offers = [{19}, set()]
    pg = ScriptedGroup(_head(19, 0, 0), _mask({19}, 19, -1), _LOADED, _head(19, 0, 0), _mask({19}, 19, -1))
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    with pytest.raises(Unrecoverable, match=r"loading failed here: step 19 from DyingHolder: no usable replica "
                                            r"of sid 1 at step 19: node1: \[Errno 111\] Connection refused"):
        RestoreAgreement(pg, eng, me).run([LocalSlots(eng, None), holders], tier, fresh=False)
    eng.close()


def test_a_step_held_in_two_timelines_is_not_common_and_an_older_one_is_restored(tmp_path):
    """Security review F20: after a rollback a step is computed again (a new timeline). Here
    this member's step 3 is the recomputed one (timeline 2) while the other member's copy of
    step 3 is the lost rank's from before the rollback (timeline 1, say a buddy's replica):
    identical only if training is deterministic. Step 3 must not be agreed on; step 2, held
    in timeline 1 by both, is."""
    eng = SnapshotEngine(tmp_path, sid=0, replicate_every=10, replication_timeout=0.01)
    w = Weights()
    eng.providers = [("m", w)]
    for s, tl in ((-1, 1), (1, 1), (2, 1), (3, 2)):
        w.t.fill_(float(s))
        eng.capture(s, timeline=tl)
        eng.wait()
    me = Membership(rank=0, size=2, epoch=3)
    pg = ScriptedGroup(_head(3, 0, 0), _mask({2, 3}, 3, -1, timelines={3: 1, 2: 1}), _LOADED)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, live_step=None)], tier, fresh=False)
    assert r.step == 2 and torch.equal(w.t, torch.full((8,), 2.0))
    eng.close()


def test_a_spare_fetches_the_newest_timeline_of_a_step_never_a_pre_rollback_copy(monkeypatch):
    """F20 from the spare's side: two holders have step 30, one from before a rollback
    (timeline 1), one recomputed (timeline 2): the spare offers timeline 2 and fetches only
    from its holder."""
    from hotspare.recovery import restore as restore_mod

    peers = restore_mod.PeerReplicas.__new__(restore_mod.PeerReplicas)
    peers._timeline, peers._holders = {}, {}
    peers.asked, peers.sid, peers._secret = 0, 0, b"k" * 32
    points = {"old": {30: 1}, "new": {30: 2}}
    monkeypatch.setattr(restore_mod, "list_points", lambda host, port, secret, sid: points[host])
    nodes = [type("N", (), {"name": n, "host": n, "replica_port": 1})() for n in ("old", "new")]
    peers._holders = peers._ask(nodes)
    assert peers.timeline(30) == 2
    assert [h[0] for h in peers._of_timeline(30)] == ["new"]


class SeatHolders:
    """A survivor's seat's replica holders (its ``wider`` source): they hold its older points."""

    def __init__(self, engine: SnapshotEngine, steps: set[int]) -> None:
        self.engine, self.steps, self.loaded = engine, steps, []

    def offer(self) -> set[int]:
        return set(self.steps)

    def load(self, step: int) -> Loaded:
        self.loaded.append(step)
        _, w = self.engine.providers[0]
        w.t.fill_(float(step))
        self.engine.capture(step)
        self.engine.wait()
        return Loaded(step, "replica on node3", 32)


def test_without_a_common_step_a_member_asks_its_seats_replica_holders_for_an_older_point(tmp_path):
    """The double failure: this member is a spare that restored ring step 38 after a worker
    crash, so its slots hold no older point; then another node is lost, and that seat's spare
    has only point 12 (its predecessor's). No step is common, so every member agrees once
    more with its seat's replica holders added: they still hold this seat's point 12."""
    eng, w = _engine(tmp_path, steps=[38])
    me = Membership(rank=2, size=4, epoch=6)
    holders = SeatHolders(eng, {12, 0})
    pg = ScriptedGroup(_head(38, 0, 0, 0, 0), _mask({12}, 38, -1),  # round 1: 38 is not common
                       _head(38, 0, 0, 0, 0), _mask({12}, 38, -1), _LOADED)  # round 2: 12 is
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, live_step=38)], tier, fresh=False, wider=[holders])
    assert (r.step, r.source) == (12, "replica on node3") and holders.loaded == [12]
    assert torch.equal(w.t, torch.full((8,), 12.0)) and not pg.others
    eng.close()


def test_no_member_with_wider_sources_means_no_second_round(tmp_path):
    """The flag is each member's own: if nobody has wider sources the members go straight to
    the persisted tier (here: none, so the job ends saying why), one agreement only."""
    eng, _ = _engine(tmp_path, steps=[38])
    me = Membership(rank=2, size=4, epoch=6)
    pg = ScriptedGroup(_head(38, 0, 0, 0, 0), _mask({12}, 38, -1))
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    with pytest.raises(Unrecoverable, match="no snapshot step is held by every member of epoch 6"):
        RestoreAgreement(pg, eng, me).run([LocalSlots(eng, live_step=38)], tier, fresh=False)
    assert not pg.others
    eng.close()


def test_another_members_wider_sources_make_this_member_agree_again_with_its_own(tmp_path):
    """Only another member has wider sources (its flag arrives in the MAX): this member agrees
    a second time with the same offer, and the step the wider round finds is loaded here from
    its own slots."""
    eng, w = _engine(tmp_path, steps=[-1, 10, 37, 38])  # ring: 37, 38; points: -1, 10
    me = Membership(rank=0, size=2, epoch=6)
    pg = ScriptedGroup(_head(40, 0, 0, wider=1), _mask({40}, 40, -1),
                       _head(40, 0, 0), _mask({40, 10}, 40, -1), _LOADED)
    tier = PersistentTier(str(tmp_path / "none"), eng, pg, me, lambda *a, **k: None)
    r = RestoreAgreement(pg, eng, me).run([LocalSlots(eng, live_step=38)], tier, fresh=False)
    assert (r.step, r.source) == (10, "own snapshot") and torch.equal(w.t, torch.full((8,), 10.0))
    assert not pg.others
    eng.close()
