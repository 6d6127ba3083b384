"""examples/gpt.py without a server: determinism, learning, data position, resumability."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

GPT_PATH = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
_spec = importlib.util.spec_from_file_location("hotspare_example_gpt", GPT_PATH)
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)


@pytest.fixture(autouse=True)
def _one_thread_deterministic():
    """Like the worker: one thread. Restore the process-wide settings train() changes."""
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
    torch.set_rng_state(rng)


class FakeSession:
    """The slice of hotspare's Session that train() uses. `restore`, if given, is loaded
    into the tracked objects on track(), as the real session does on recovery."""

    def __init__(self, total, start=0, rank=0, world_size=1, restore=None):
        self.total, self.start = total, start
        self.rank, self.world_size = rank, world_size
        self.restore = restore
        self.tracked = {}
        self.losses = []

    def track(self, **objs):
        self.tracked.update(objs)
        if self.restore is not None:
            load_snapshot(self.restore, **objs)

    def steps(self):
        yield from range(self.start, self.total)

    def allreduce_grads(self, model):
        return True

    def log(self, **kw):
        self.losses.append(kw["loss"])


def snapshot(model, optimizer, scheduler, data) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "data": json.dumps(data.state_dict()),  # must be JSON-able
            "torch_rng": torch.get_rng_state(),
        },
        buf,
    )
    return buf.getvalue()


def load_snapshot(blob: bytes, model, optimizer, scheduler, data) -> None:
    s = torch.load(io.BytesIO(blob), weights_only=True)
    model.load_state_dict(s["model"])
    optimizer.load_state_dict(s["optimizer"])
    scheduler.load_state_dict(s["scheduler"])
    data.load_state_dict(json.loads(s["data"]))
    torch.set_rng_state(s["torch_rng"])


def run(total, **kw):
    sess = FakeSession(total, **{k: kw.pop(k) for k in ("start", "restore") if k in kw})
    gpt.train(sess, **kw)
    return sess


def assert_same_params(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_same_seed_bit_identical():
    a = run(20)
    torch.manual_seed(999)  # global RNG state before train() must not matter
    b = run(20)
    assert a.losses == b.losses
    assert_same_params(a.tracked["model"], b.tracked["model"])
    assert (
        a.tracked["data"].state_dict() == b.tracked["data"].state_dict() == {"epoch": 0, "pos": 160}
    )
    c = run(3, seed=4321)
    assert not torch.equal(c.tracked["model"].wte.weight, b.tracked["model"].wte.weight)


def test_loss_decreases():
    s = run(60)
    first, last = sum(s.losses[:5]) / 5, sum(s.losses[-5:]) / 5
    assert s.losses[0] == pytest.approx(torch.log(torch.tensor(59.0)).item(), abs=0.3)
    assert last < first - 0.8, (first, last)


def test_token_stream_state_roundtrip_and_sharding():
    tokens, vocab = gpt.load_corpus()
    assert len(vocab) == len(set(gpt.CORPUS.read_text())) and vocab.itos == sorted(vocab.itos)
    assert vocab.decode(tokens[:20]) == gpt.CORPUS.read_text()[:20]

    d = gpt.TokenStream(tokens, 16, 4, seed=7)
    for _ in range(3):
        d.next_batch()
    state = d.state_dict()
    assert json.loads(json.dumps(state)) == state
    want = [d.next_batch() for _ in range(3)]
    e = gpt.TokenStream(tokens, 16, 4, seed=7)  # fresh object, same state -> same batches
    e.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(want, [e.next_batch() for _ in range(3)], strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x, y = want[0]
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])

    # Ranks: disjoint starts within each step, same rank-independent state afterwards.
    ranks = [gpt.TokenStream(tokens, 16, 4, rank=r, world_size=3, seed=7) for r in range(3)]
    seen = set()
    for _ in range(5):
        starts = [r.starts().tolist() for r in ranks]
        for r in ranks:
            r.next_batch()
        flat = [s for st in starts for s in st]
        assert len(set(flat)) == len(flat) == 12
        assert not seen & set(flat)
        seen |= set(flat)
    assert {json.dumps(r.state_dict()) for r in ranks} == {json.dumps({"epoch": 0, "pos": 60})}
    # world_size 1 at the same state reads the union of the three ranks' next shards.
    solo = gpt.TokenStream(tokens, 16, 12, seed=7)
    solo.load_state_dict(ranks[0].state_dict())
    union = torch.cat([r.starts() for r in ranks])
    assert torch.equal(solo.starts(), union)


def test_token_stream_epoch_rollover_reads_the_tail_then_the_next_epoch():
    tokens = torch.arange(30)
    d = gpt.TokenStream(tokens, 4, 3, rank=1, world_size=2, seed=0)  # 26 starts, 6 per step
    perm0, perm1 = d.permutation(0).clone(), d.permutation(1).clone()
    batches = [d.next_batch() for _ in range(5)]  # step 5 reads 24..25 of epoch 0, 0..3 of epoch 1
    assert d.state_dict() == {"epoch": 1, "pos": 4}
    assert torch.equal(batches[0][0][:, 0], perm0[3:6])
    assert torch.equal(batches[4][0][:, 0], perm1[1:4])  # rank 1's block: stream entries 27..29
    assert d.last[0].tolist() == [1, 1, 1]
    assert not torch.equal(perm0, perm1)


def test_token_stream_num_samples_limits_the_epoch():
    tokens, _ = gpt.load_corpus()
    d = gpt.TokenStream(tokens, 16, 4, seed=7, num_samples=10)
    assert sorted(d.permutation(0).tolist()) == list(range(10))
    d.next_batch(), d.next_batch(), d.next_batch()
    assert d.state_dict() == {"epoch": 1, "pos": 2}


def test_resume_from_step_10_is_bit_identical():
    full = run(20)
    first = run(10)
    blob = snapshot(**first.tracked)
    del first
    torch.manual_seed(0)  # scramble RNG and build fresh objects; the snapshot must suffice
    resumed = run(20, start=10, restore=blob)
    assert len(resumed.losses) == 10
    assert resumed.losses == full.losses[10:]
    assert_same_params(full.tracked["model"], resumed.tracked["model"])
    assert resumed.tracked["data"].state_dict() == full.tracked["data"].state_dict()
    assert resumed.tracked["scheduler"].state_dict()["last_epoch"] == 20
    # The optimizer state (Adam moments) matches too.
    so, sr = full.tracked["optimizer"].state_dict(), resumed.tracked["optimizer"].state_dict()
    for k in so["state"]:
        for name, v in so["state"][k].items():
            assert torch.equal(v, sr["state"][k][name]), (k, name)
