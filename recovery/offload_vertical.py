"""Vertical micro-batch scheduling (GreedySnake): every micro-batch through block 0, then
block 1, ...; then backward block by block in reverse, all micro-batches of a block before the
next. Each block's parameters (and, with :class:`~hotspare.recovery.offload.OffloadedAdamW`,
its offloaded optimizer state) are touched once per iteration: a block's update starts right
after its last micro-batch's backward, while the earlier blocks' backward runs.

Gradients are bit-identical to the ordinary (horizontal) accumulation loop::

    for x, y in micro_batches:
        loss_fn(model(x), y).backward()

because each parameter's gradient is still the sum over micro-batches in micro-batch order
(block b's backward for micro-batch m runs before m+1's, whichever the schedule), and each
micro-batch's gradient flows through the same operations: a block's output is cut from the
graph (``detach().requires_grad_()``) and the gradient arriving at the cut is fed back in,
unchanged. The price is memory: every micro-batch's activations are kept at once (as in the
paper; it trades activation memory for reading each block's state once). Dropout and other
randomness consume the RNG in a different order than the horizontal loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn


def _ctx(opt: Any, final: bool) -> contextlib.AbstractContextManager:
    name = "final_micro_batch" if final else "accumulating"
    return getattr(opt, name)() if opt is not None and hasattr(opt, name) else contextlib.nullcontext()


def vertical_step(blocks: Iterable[nn.Module], micro_batches: Sequence[tuple[Any, Any]],
                  loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], opt: Any = None,
                  step: bool = True) -> list[torch.Tensor]:
    """Forward and backward of ``micro_batches`` (``(input, target)`` pairs) through ``blocks``
    (an ``nn.Sequential`` or a list of modules, each taking and returning one tensor) in the
    vertical order; ``loss_fn(output, target)`` is each micro-batch's loss, backpropagated as
    it is (divide by the number of micro-batches there, as in a horizontal loop). With ``opt``
    (an ``OffloadedAdamW``: its ``accumulating()``/``final_micro_batch()`` mark the last
    micro-batch of each block; any other optimizer works too) and ``step``, calls
    ``opt.step()`` at the end. Returns the detached losses."""
    blocks = list(blocks)
    if not blocks or not micro_batches:
        raise ValueError("vertical_step needs at least one block and one micro-batch")
    m_count, last = len(micro_batches), len(blocks) - 1
    ins: list[list[Any]] = [[x for x, _ in micro_batches]]
    outs: list[list[Any]] = []
    for b, block in enumerate(blocks):
        if b:
            ins.append([o.detach().requires_grad_() for o in outs[-1]])
        outs.append([block(x) for x in ins[b]])
    losses = [loss_fn(o, y) for o, (_, y) in zip(outs[last], micro_batches, strict=True)]
    for b in range(last, -1, -1):
        for m in range(m_count):
            with _ctx(opt, m == m_count - 1):
                if b == last:
                    losses[m].backward()
                else:
                    grad = ins[b + 1][m].grad
                    if grad is not None and outs[b][m].requires_grad:
                        outs[b][m].backward(grad)
            outs[b][m] = None  # free the block's activations as soon as its backward is done
            if b < last:
                ins[b + 1][m] = None
    if opt is not None and step:
        opt.step()
    return [loss.detach() for loss in losses]
