"""Small residual blocks to checkpoint and to measure, and the one way the chapter-01 exercises run them.

Activation checkpointing is easiest to get right, and to test, on a block that fits in a few lines. These are
the three shapes of block whose saved tensors teach something (what each op keeps is measured by
`lab.measure.saved.saved_bytes`):

* "gelu": x + W2·dropout(gelu(W1·LayerNorm(x))), with biases — the classic MLP; LayerNorm keeps its input and
  a mean and 1/std per token, each Linear its input, GELU its input.
* "swiglu": x + W2·(silu(W1·h) · W3·h), h = LayerNorm(x), no biases — W1 and W3 save the *same* h (one
  storage, counted once), the product keeps both its factors.
* "gated": x + Wo·((q · sigmoid(k)) · v), q, k, v = Wqkv·LayerNorm(x) cut in three — q and v are views of one
  storage that autograd keeps whole.

`gradients` is the fixed recipe both sides of a check use (the grader on the plain block, the learner's driver
on the wrapped one): same seed for the dropout draws, a random cotangent so no gradient is trivially equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("gelu", "swiglu", "gated")


class Block(nn.Module):
    """x + mlp(norm(x)) for one of `KINDS`; the weights are drawn from `seed`."""

    def __init__(self, kind: str, d_model: int, d_ff: int, *, dropout: float = 0.0, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {', '.join(map(repr, KINDS))}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1)")
        super().__init__()
        self.kind, self.dropout = kind, dropout
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.norm = nn.LayerNorm(d_model)
            nn.init.normal_(self.norm.weight, 1.0, 0.1)  # not all ones: a gradient that ignored it would show
            nn.init.normal_(self.norm.bias, 0.0, 0.1)
            if kind == "gelu":
                self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
            elif kind == "swiglu":
                self.w1, self.w3 = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_model, d_ff, bias=False)
                self.w2 = nn.Linear(d_ff, d_model, bias=False)
            else:
                self.wqkv, self.wo = nn.Linear(d_model, 3 * d_ff, bias=False), nn.Linear(d_ff, d_model, bias=False)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "gelu":
            return x + self.w2(F.dropout(F.gelu(self.w1(h)), self.dropout, self.training))
        if self.kind == "swiglu":
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        q, k, v = self.wqkv(h).chunk(3, dim=-1)
        return x + self.wo(q * torch.sigmoid(k) * v)


def example_input(batch: int, seq: int, d_model: int, seed: int, *, requires_grad: bool = True,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (batch, seq, d_model) input drawn from `seed`."""
    x = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.requires_grad_(requires_grad)


def cotangent(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The gradient `gradients` feeds the output with (fp32), drawn from seed + 1: the JAX track uses it too."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))


def gradients(fn: Callable[[torch.Tensor], torch.Tensor], block: nn.Module, x: torch.Tensor,
              seed: int) -> dict[str, list[float] | None]:
    """Run fn(x) (the block, or the block wrapped) with torch seeded by `seed` (dropout's draws), backpropagate
    a random cotangent, and return the output, the input's gradient and each of `block`'s parameters'
    gradients as flat lists (None where autograd left no gradient)."""
    block.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    y = fn(x)
    if y.requires_grad:  # a wrapper that cut the weights off the graph leaves nothing to backpropagate
        y.backward(cotangent(tuple(y.shape), seed).to(y.dtype))

    def flat(t: torch.Tensor | None) -> list[float] | None:
        return None if t is None else t.detach().float().flatten().tolist()

    return {"output": flat(y), "input": flat(x.grad),
            **{name: flat(p.grad) for name, p in block.named_parameters()}}
