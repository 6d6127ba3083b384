"""A small character-level GPT trained on bundled public-domain text, as a hotspare job.

Everything here is deterministic: the same seed gives the same initial weights on every
rank, and the data position (``TokenStream``) is a small JSON-able state that fully
determines the next batch. With the model, optimizer, scheduler, data position and the
RNG states (which the session tracks itself), a run can be stopped at any step and
resumed bit-for-bit, which is what hotspare's recovery relies on.

Entrypoint: ``examples/gpt.py:train``. ``build`` gives the same workload without a session
(for tests and benchmarks).
"""

from __future__ import annotations

import json
import math
import os
import random
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from hotspare import ElasticSampler

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


# --------------------------------------------------------------------------- data


class CharVocab:
    """Char-level vocabulary: the sorted set of characters of the corpus."""

    def __init__(self, text: str) -> None:
        self.itos = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.itos[int(i)] for i in ids)


@lru_cache(maxsize=4)
def load_corpus(path: str | Path = CORPUS) -> tuple[torch.Tensor, CharVocab]:
    """The corpus as a 1-D int64 token tensor, and its vocabulary."""
    text = Path(path).read_text(encoding="utf-8")
    vocab = CharVocab(text)
    return vocab.encode(text), vocab


class TokenStream:
    """Deterministic, resumable batches of (x, y) windows over a token tensor.

    A sample is a window start offset (``x = t[s:s+T]``, ``y = t[s+1:s+T+1]``); which
    samples a rank reads is :class:`hotspare.ElasticSampler`'s business: each
    epoch is a permutation of the first ``num_samples`` start offsets (all of them by
    default) seeded with ``seed + epoch``, a step consumes ``batch_size * world_size``
    consecutive entries from the global position, rank ``r`` takes the ``r``-th block of
    ``batch_size``, and a step at the end of an epoch continues into the next one, so each
    epoch reads every sample exactly once.

    The state (``{"epoch", "pos"}``) is the same on every rank and does not depend on the
    rank, so a state saved by any rank restores any other. Rank and world size come from
    ``group`` (the session) at every step, or from the ``rank``/``world_size``
    attributes: after a shrink or grow the stream re-shards from the same global position.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_samples: int | None = None,
        group=None,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        self.tokens = tokens.long()
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.n_starts = self.tokens.numel() - self.block_size
        if num_samples:
            self.n_starts = min(self.n_starts, int(num_samples))
        if self.n_starts < self.batch_size:
            raise ValueError("corpus too small for one batch")
        self.sampler = ElasticSampler(self.n_starts, batch_size, seed=seed, rank=rank,
                                      world_size=world_size, group=group)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (epochs, starts) last read
        self._offsets = torch.arange(self.block_size + 1)

    @property
    def rank(self) -> int:
        return self.sampler.rank

    @rank.setter
    def rank(self, value: int) -> None:
        self.sampler.rank = value

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    @world_size.setter
    def world_size(self, value: int) -> None:
        self.sampler.world_size = value

    # torchdata StatefulDataLoader convention
    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def permutation(self, epoch: int) -> torch.Tensor:
        return self.sampler.permutation(epoch)

    def starts(self) -> torch.Tensor:
        """Start offsets of this rank's next batch (without advancing)."""
        return self.sampler.peek()[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.last = self.sampler.peek()
        self.sampler.advance()
        win = self.tokens[self.last[1][:, None] + self._offsets]  # (B, T+1)
        return win[:, :-1], win[:, 1:]

    def __iter__(self):
        while True:
            yield self.next_batch()


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError("n_embd must be divisible by n_head")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Manual masked softmax: plain matmuls/softmax, deterministic on CPU for a fixed
        # thread count, and independent of which fused SDPA kernel a build would pick.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LN decoder-only transformer. Untied input/output embeddings, so the state dict
    has no shared tensors (safetensors refuses those)."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 2,
        n_embd: int = 64,
        n_head: int = 4,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Sample continuations of idx (B, T); call model.eval() first to disable dropout."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size :])
            probs = logits[:, -1, :].softmax(dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


# --------------------------------------------------------------------------- workload


def warmup_cosine(warmup_steps: int, decay_steps: int, min_ratio: float):
    """LR multiplier: linear warmup, cosine decay to min_ratio, then flat."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, decay_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def build(
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    block_size: int = 64,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 1234,
    dropout: float = 0.1,
    warmup_steps: int = 10,
    decay_steps: int = 2000,
    rank: int = 0,
    world_size: int = 1,
    corpus: str | Path = CORPUS,
    num_samples: int | None = None,
    group=None,
):
    """(model, optimizer, scheduler, data) for the workload; seeds torch's global RNG
    with ``seed`` first, so every rank builds identical weights."""
    torch.manual_seed(seed)
    tokens, vocab = load_corpus(corpus)
    model = GPT(len(vocab), block_size, n_layer, n_embd, n_head, dropout)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(warmup_steps, decay_steps, min_ratio=0.1)
    )
    data = TokenStream(tokens, block_size, batch_size, rank=rank, world_size=world_size, seed=seed,
                       num_samples=num_samples, group=group)
    return model, opt, sched, data


class SampleLog:
    """``record_samples: true``: one JSON line per step and rank under
    ``<output_dir>/samples/``: the (data epoch, sample id) pairs the rank trained on, with
    the step, the session epoch (the newest epoch's line of a step is the one that stuck)
    and the rank and world size. Lets a test check that no sample was skipped or repeated
    through shrinks and grows."""

    def __init__(self, session) -> None:
        d = Path(session.spec.output_dir) / "samples"
        d.mkdir(parents=True, exist_ok=True)
        self.session = session
        self.fd = os.open(d / f"{session.node}-{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def write(self, step: int, epochs: torch.Tensor, ids: torch.Tensor) -> None:
        s = self.session
        line = {"step": step, "epoch": s.epoch, "rank": s.rank, "world": s.world_size,
                "samples": [[int(e), int(i)] for e, i in zip(epochs, ids, strict=True)]}
        os.write(self.fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())


def warmup(**_args) -> None:
    """Run by a warm (spare) worker before it has a rank: load and tokenize the corpus."""
    load_corpus(CORPUS)


def train(
    session,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    block_size: int = 64,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 1234,
    dropout: float = 0.1,
    warmup_steps: int = 10,
    decay_steps: int = 2000,
    num_samples: int | None = None,
    record_samples: bool = False,
):
    """``num_samples`` limits the data set to that many windows (short epochs, for tests);
    ``record_samples`` logs what each rank read (:class:`SampleLog`)."""
    torch.use_deterministic_algorithms(True)
    # every generator the process owns is seeded: the run is a function of (seed, rank)
    random.seed(seed + session.rank)
    np.random.seed(seed + session.rank)
    model, opt, sched, data = build(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        block_size=block_size,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        dropout=dropout,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        num_samples=num_samples,
        group=session,  # rank and world size are read at every step: shrink/grow re-shard
    )
    session.track(model=model, optimizer=opt, scheduler=sched, data=data)
    record = SampleLog(session) if record_samples else None
    for step in session.steps():
        x, y = data.next_batch()
        if record is not None:
            record.write(step, *data.last)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        session.allreduce_grads(model)  # False = step failed (group changed); carry on
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        session.log(loss=loss.item())
