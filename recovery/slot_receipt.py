"""A peer's snapshot received straight into a slot of the restoring member's own
:class:`~hotspare.recovery.snapshot.SnapshotEngine` (used by
:class:`hotspare.recovery.restore.PeerReplicas`): the body never exists in this process but in
that slot, and the tracked state is restored from it once the wire and the CRC32s vouched for
every byte (``benchmarks/restore_rss.py`` measures what that saves).

It works on the engine's slot bookkeeping (slot choice, sequence numbers, the replication
point) the way the engine's own write does.
"""

from __future__ import annotations

import json
import time

from .slotfile import COMPLETE, CTRL_SIZE, EMPTY, WRITING
from .slots import TensorInfo
from .snapshot import SnapshotEngine, restore


class SlotReceipt:
    """A peer's snapshot of ``step`` received straight into one of ``engine``'s slots: the one
    copy a restoring spare holds. :meth:`buffer` (the ``into`` of
    :func:`~hotspare.recovery.replica_client.fetch`) makes the slot ready, WRITING, and hands
    the wire its data area; :meth:`complete`, once the body passed its MAC and CRC32s, marks it
    COMPLETE -- a snapshot of this engine like any other, with this epoch's lineage and the
    source's timeline, as ``capture(step, timeline=...)`` would write it -- and restores the
    tracked state from it. Leaving the ``with`` block without completing empties the slot."""

    def __init__(self, engine: SnapshotEngine, step: int) -> None:
        engine.wait()  # no snapshot of its own in flight
        self.engine, self.step, self._meta = engine, step, {}
        self._at: tuple[int, int, int, int] | None = None  # slot, seq, header length, data length
        self._view: memoryview | None = None

    def buffer(self, header: dict, data_len: int) -> memoryview:
        eng = self.engine
        self._release()
        lineage = dict(eng.lineage)
        if header.get("timeline") is not None:
            lineage["timeline"] = header["timeline"]
        self._meta = header.get("meta", {})  # what the state is restored with, as the source captured it
        hb = json.dumps({"rank": eng.sid, "step": self.step, "time": time.time(), "data_len": data_len,
                         **lineage, "meta": self._meta, "tensors": header["tensors"]}, separators=(",", ":")).encode()
        k = eng._pick_slot(eng.is_candidate(self.step))
        slot, _ = eng._slot_for(k, len(hb), data_len)
        eng._seq, eng._steps[k] = eng._seq + 1, -2
        self._at = (k, eng._seq, len(hb), data_len)
        slot.set_ctrl(WRITING, self.step, eng._seq, len(hb))
        slot.mm[CTRL_SIZE : CTRL_SIZE + len(hb)] = hb
        self._view = memoryview(slot.mm)[slot.data_off : slot.data_off + data_len]
        return self._view

    def complete(self) -> None:
        assert self._at is not None, "nothing received"
        eng, (k, seq, hlen, data_len) = self.engine, self._at
        slot = eng._slots[k]
        assert slot is not None
        self._release()
        slot.set_ctrl(COMPLETE, self.step, seq, hlen, data_len)
        eng._steps[k], eng._seqs[k] = self.step, seq
        if eng.is_candidate(self.step):
            eng._last_point = (self.step, seq)
            eng._agent_bell.ring()  # the replicator pushes it on to this node's buddies
        header = json.loads(bytes(slot.mm[CTRL_SIZE : CTRL_SIZE + hlen]))
        infos = [TensorInfo(**{**i, "shape": tuple(i["shape"])}) for i in header["tensors"]]
        restore(eng.providers, {i.name: slot.view(i) for i in infos}, self._meta)
        eng._preparer.prepare_others(hlen, data_len)
        self._at = None

    def _release(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None

    def __enter__(self) -> SlotReceipt:
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()
        if self._at is not None:  # not completed: nothing half-received may pass for a snapshot
            slot = self.engine._slots[self._at[0]]
            if slot is not None:
                slot.set_ctrl(EMPTY, -2, 0, 0)
            self._at = None
