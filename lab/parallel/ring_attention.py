"""Ring attention: exact attention over a sequence split across context-parallel ranks.

Each rank keeps its queries and passes its keys and values around a ring: at step i, rank r holds the
K/V of rank r - i, sends them on to r + 1 and, while they travel, attends its queries to them. After cp
steps every query has met every key, yet no rank ever held more than two K/V blocks (the one it computes
on and the one arriving). The partial results are merged with the log-sum-exp rule of online softmax:

    lse = log(e^lse_a + e^lse_b)        out = e^(lse_a - lse) · out_a + e^(lse_b - lse) · out_b

which is exact, because softmax over all keys is the softmax over each block, reweighted by how much of
the total mass (e^lse) each block holds.

A rank's sequence is a list of equal *chunks* of the global sequence (`lab.calc.cp` decides which:
one contiguous chunk, or two in zig-zag order). With a causal mask a query chunk attends to a key chunk
fully (an earlier chunk), diagonally (the same chunk: lower triangle) or not at all (a later chunk: the
block is skipped, no work done). That skipping is what makes the contiguous split unbalanced and the
zig-zag split balanced.

The backward pass is the FlashAttention one, block by block: with the final `out` and `lse` saved, the
probabilities of any block are exp(s - lse), so each block's dq, dk, dv can be computed on its own. The
K/V go round the ring again, and their gradients travel with them, each rank adding its contribution,
until one last hop brings them home. Communication is written out as isend/irecv (autograd never sees
it), posted before the local compute so that it overlaps with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lab.calc.cp import DIAGONAL, SKIP, block_kind
from lab.collectives.p2p import group_info


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GQA: repeat each of the KV heads for the query heads that share it (as SDPA's enable_gqa does)."""
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _reduce_kv(grad: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand_kv`: sum over the query heads that shared a KV head."""
    B, H, T, D = grad.shape
    return grad if H == n_kv_heads else grad.view(B, n_kv_heads, H // n_kv_heads, T, D).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if kind == DIAGONAL:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H, Tq, D) to one block of keys and values: (out, lse), lse being (B, H, Tq)."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = _scores(q, k, kind, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (out, lse) into the running result: the online-softmax rule."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    # a row that has seen no key yet in either part (lse = -inf on both sides) stays empty, not NaN
    safe = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    return (out * torch.exp(lse - safe).unsqueeze(-1)
            + block_out * torch.exp(block_lse - safe).unsqueeze(-1)), new_lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, kind: str, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, from the *final* lse and delta = rowsum(dout * out) (FlashAttention-2)."""
    n_kv = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    probs = torch.exp(_scores(q, k, kind, scale) - lse.unsqueeze(-1))
    dv = probs.transpose(-2, -1) @ dout
    dscores = probs * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    dq = dscores @ k * scale
    dk = dscores.transpose(-2, -1) @ q * scale
    return dq, _reduce_kv(dk, n_kv), _reduce_kv(dv, n_kv)


class _Ring:
    """Who sends to whom, and one step of passing a tensor to the next rank."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.rank, self.world, to_global = group_info(group)
        self.group = group
        self.next, self.prev = to_global((self.rank + 1) % self.world), to_global((self.rank - 1) % self.world)

    def source(self, step: int) -> int:
        """The group rank whose K/V this rank holds at `step`."""
        return (self.rank - step) % self.world

    def pass_on(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post: send `tensor` to the next rank, receive the previous rank's into a new buffer."""
        incoming = torch.empty_like(tensor)
        requests = [dist.isend(tensor.contiguous(), self.next, group=self.group),
                    dist.irecv(incoming, self.prev, group=self.group)]
        return incoming, requests


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class RingAttention(torch.autograd.Function):
    """out = softmax(q kᵀ · scale + mask) v over the whole sequence, each rank holding its chunks of it."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                chunks: list[list[int]], causal: bool, scale: float,
                on_block: Callable[[int, int, int, int, str], None] | None) -> torch.Tensor:
        ring = _Ring(group)
        n = len(chunks[ring.rank])
        q_parts = q.chunk(n, dim=2)
        results: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * n
        kv = torch.stack((k, v))  # one message per step
        for step in range(ring.world):
            src = ring.source(step)
            if step < ring.world - 1:  # the next block travels while this one is computed
                incoming, requests = ring.pass_on(kv)
            for i, (q_chunk, q_part) in enumerate(zip(chunks[ring.rank], q_parts, strict=True)):
                for k_chunk, k_part, v_part in zip(chunks[src], kv[0].chunk(n, 2), kv[1].chunk(n, 2), strict=True):
                    kind = block_kind(q_chunk, k_chunk, causal)
                    if on_block is not None:
                        on_block(step, src, q_chunk, k_chunk, kind)
                    if kind != SKIP:
                        results[i] = merge(*results[i], *block_forward(q_part, k_part, v_part, kind, scale))
            if step < ring.world - 1:
                _wait(requests)
                kv = incoming
        out = torch.cat([o for o, _ in results], dim=2)
        lse = torch.cat([s for _, s in results], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.chunks, ctx.causal, ctx.scale = group, chunks, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, chunks = _Ring(ctx.group), ctx.chunks
        n = len(chunks[ring.rank])
        delta = (dout * out).sum(-1)
        q_parts, dout_parts = q.chunk(n, 2), dout.chunk(n, 2)
        lse_parts, delta_parts = lse.chunk(n, 2), delta.chunk(n, 2)
        dq_parts = [torch.zeros_like(p) for p in q_parts]
        kv = torch.stack((k, v))
        dkv = torch.zeros_like(kv)  # gradient of the block this rank holds; travels with it
        for step in range(ring.world):
            src = ring.source(step)
            if step < ring.world - 1:
                incoming, requests = ring.pass_on(kv)
            k_parts, v_parts = kv[0].chunk(n, 2), kv[1].chunk(n, 2)
            dk_parts, dv_parts = dkv[0].chunk(n, 2), dkv[1].chunk(n, 2)  # views: += writes into dkv
            for i, q_chunk in enumerate(chunks[ring.rank]):
                for j, k_chunk in enumerate(chunks[src]):
                    kind = block_kind(q_chunk, k_chunk, ctx.causal)
                    if kind == SKIP:
                        continue
                    dq, dk, dv = block_backward(dout_parts[i], q_parts[i], k_parts[j], v_parts[j], lse_parts[i],
                                                delta_parts[i], kind, ctx.scale)
                    dq_parts[i] += dq
                    dk_parts[j].add_(dk)
                    dv_parts[j].add_(dv)
            if ring.world > 1:  # hand the gradient on with its block; the last hop brings it home
                dkv_incoming, dkv_requests = ring.pass_on(dkv)
                if step < ring.world - 1:
                    _wait(requests)
                    kv = incoming
                _wait(dkv_requests)
                dkv = dkv_incoming
        return torch.cat(dq_parts, dim=2), dkv[0], dkv[1], None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                   chunks: list[list[int]], *, causal: bool = True, scale: float | None = None,
                   on_block: Callable[[int, int, int, int, str], None] | None = None) -> torch.Tensor:
    """Attention of this rank's queries q (B, H, T_local, D) to the keys and values of every rank.

    `chunks[r]` lists the global chunk indices rank r holds, in the order they are laid out in its
    q, k, v (see `lab.calc.cp.chunk_ids`); k and v may have fewer heads than q (GQA). `on_block(step,
    source rank, query chunk, key chunk, kind)` is called for every block in the forward pass (to draw the
    ring, or count the work). Differentiable; the backward pass communicates over the same ring.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, chunks, causal, scale, on_block)
