"""Cross-entropy fused with its own gradient (as Liger-Kernel does): the loss and dloss/dlogits in one launch.

The loss of a token with logits x (V of them) and target t is log Σⱼ exp(xⱼ) − x_t, and its gradient with
respect to x is softmax(x) − onehot(t) (divided by N for the mean over N tokens). Eager torch runs log_softmax
(read the N×V logits, write N×V log-probabilities, kept for the backward) and gathers the targets' entries; its
backward writes an N×V gradient of the log-probabilities (zero but at the targets), then reads it and the
log-probabilities to write the logits' gradient: 3 reads and 3 writes of N×V.

This kernel does, per block of rows, in one launch during the *forward*:
    pass 1  over the V columns in chunks of BLOCK_V: a running max m and a running sum s of exp(x − m)
            (online softmax: when a chunk raises the max, the sum so far is rescaled by exp(m_old − m_new)),
            so V need not fit one block; then loss = log s + m − x_t
    pass 2  over the chunks again: writes (exp(x − m) / s − [j = t]) / N, the gradient of the mean loss
2 reads and 1 write of N×V in the forward, and the backward merely scales the saved gradient by grad_output
(1 read, 1 write): 3 reads and 2 writes, with one N×V tensor kept between forward and backward, as eager keeps
its log-probabilities. Liger goes further: it writes the gradient over the logits in place (no N×V buffer at all)
and skips the scaling when grad_output is 1; here the logits are left intact, since a caller may still read them.
An evaluation (no gradient wanted) runs pass 1 only: 1 read of N×V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.kernels.runtime import check_input, interpreted, row_launch
from lab.kernels.softmax import online_max_and_sum


def default_block_v(vocab: int) -> int:
    """Columns per chunk: a whole small vocabulary, else 4096 on a GPU (16384 in the interpreter)."""
    return min(triton.next_power_of_2(vocab), 1 << 14 if interpreted() else 1 << 12)


@triton.jit
def _cross_entropy_kernel(logits_ptr, targets_ptr, loss_ptr, grad_ptr, n_rows, n_cols, inv_n,
                          BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    row_start = rows.to(tl.int64) * n_cols
    # pass 1: running max m and running sum s = Σ exp(x - m), chunk by chunk
    m, s = online_max_and_sum(logits_ptr, row_start, row_mask, n_cols, BLOCK_ROWS, BLOCK_V)
    target = tl.load(targets_ptr + rows, mask=row_mask, other=0)
    x_target = tl.load(logits_ptr + row_start + target, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(loss_ptr + rows, tl.log(s) + m - x_target, mask=row_mask)
    if WRITE_GRAD:  # pass 2: the gradient of the mean loss, (softmax - onehot) / N
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            offsets = row_start[:, None] + cols[None, :]
            x = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            probs = tl.exp(x - m[:, None]) / s[:, None]
            grad = (probs - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * inv_n
            tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, block_v: int, write_grad: bool) -> torch.Tensor:
        vocab = logits.shape[-1]
        logits2 = logits.reshape(-1, vocab).contiguous()
        targets1 = targets.reshape(-1).contiguous()
        n_rows = logits2.shape[0]
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits2) if write_grad else losses  # (an unused pointer when not write_grad)
        block_rows, num_warps = row_launch(n_rows, block_v)
        _cross_entropy_kernel[(triton.cdiv(n_rows, block_rows),)](
            logits2, targets1, losses, grad, n_rows, vocab, 1.0 / n_rows, BLOCK_ROWS=block_rows, BLOCK_V=block_v,
            WRITE_GRAD=write_grad, num_warps=num_warps)
        ctx.save_for_backward(grad)
        ctx.logits_shape = logits.shape
        return losses.mean().to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_output).view(ctx.logits_shape), None, None, None


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The pure-torch op the kernel must match (`lab.loss.cross_entropy`, for any leading shape)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, block_v: int | None = None) -> torch.Tensor:
    """The mean cross-entropy of logits (..., V) against int64 targets (...) in [0, V), in logits' dtype:
    `lab.loss.cross_entropy`'s signature and values. The gradient of the logits is computed in the
    forward and kept (an N×V tensor); `block_v` (a power of two) sets the columns per chunk of the V loop."""
    check_input(logits, "logits")
    if logits.dim() < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}: it "
                         "must be logits' shape without its last (vocabulary) dim")
    if targets.dtype != torch.int64:
        raise ValueError(f"targets dtype {str(targets.dtype).removeprefix('torch.')} is not supported: use int64")
    vocab = logits.shape[-1]
    if targets.numel() == 0 or vocab == 0:
        raise ValueError(f"logits {tuple(logits.shape)} are empty: the mean loss needs at least one token and "
                         "one class")
    low, high = int(targets.min()), int(targets.max())  # one host sync; a bad target would read out of bounds
    if low < 0 or high >= vocab:
        raise ValueError(f"target {low if low < 0 else high} is out of range: targets must be in [0, {vocab})")
    block_v = default_block_v(vocab) if block_v is None else block_v
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v {block_v} must be a power of two (tl.arange needs one)")
    # an evaluation (no grad needed) skips pass 2: the logits are read once and no N×V tensor is written
    return _CrossEntropy.apply(logits, targets, block_v, logits.requires_grad and torch.is_grad_enabled())
