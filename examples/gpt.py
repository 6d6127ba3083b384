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

import math
import random
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

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

    Each epoch uses a permutation of every valid start offset, drawn from a
    ``torch.Generator`` seeded with ``seed + epoch``. A step consumes
    ``batch_size * world_size`` consecutive entries of that permutation starting at
    ``pos``; rank ``r`` takes the ``r``-th block of ``batch_size`` of them, so within a
    step (and so within an epoch) ranks read disjoint shards. When fewer than a full
    global batch remain, the stream moves to the next epoch.

    The state (``{"epoch", "pos"}``) is the same on every rank and does not depend on
    the rank, so a state saved by any rank restores any other; ``rank`` and
    ``world_size`` are plain attributes and may be changed between steps (re-sharding
    continues from the same global position). Follows the torchdata StatefulDataLoader
    convention: ``state_dict()`` is JSON-able and ``load_state_dict`` restores it.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        self.tokens = tokens.long()
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.n_starts = self.tokens.numel() - self.block_size  # x = t[s:s+T], y = t[s+1:s+T+1]
        if self.n_starts < self.batch_size:
            raise ValueError("corpus too small for one batch")
        self.epoch = 0
        self.pos = 0
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None
        self._offsets = torch.arange(self.block_size + 1)

    # torchdata StatefulDataLoader convention
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])

    def permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.n_starts, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def starts(self) -> torch.Tensor:
        """Start offsets of this rank's next batch (without advancing)."""
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")
        step = self.batch_size * self.world_size
        epoch, pos = self.epoch, self.pos
        if pos + step > self.n_starts:
            epoch, pos = epoch + 1, 0
        lo = pos + self.rank * self.batch_size
        return self.permutation(epoch)[lo : lo + self.batch_size]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.batch_size * self.world_size
        if self.pos + step > self.n_starts:
            self.epoch, self.pos = self.epoch + 1, 0
        starts = self.starts()
        self.pos += step
        win = self.tokens[starts[:, None] + self._offsets]  # (B, T+1)
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
    data = TokenStream(tokens, block_size, batch_size, rank=rank, world_size=world_size, seed=seed)
    return model, opt, sched, data


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
):
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
        rank=session.rank,
        world_size=session.world_size,
    )
    session.track(model=model, optimizer=opt, scheduler=sched, data=data)
    for _step in session.steps():
        x, y = data.next_batch()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        session.allreduce_grads(model)  # False = step failed (group changed); carry on
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        session.log(loss=loss.item())
