"""Tensor parallelism (and sequence parallelism) applied to `lab.model` without editing it.

In the sharding notation of *How to Scale Your Model*, a linear layer y = x W with W[D, F]:

  column parallel   W[D, F_X]: each rank computes y[B, F_X] from the full x — no communication;
  row parallel      W[D_X, F]: each rank holds x[B, D_X] and computes a *partial sum* of y[B, F],
                    so the ranks must all-reduce (or, with sequence parallelism, reduce-scatter) it.

A column layer followed by a row layer therefore costs one all-reduce forward and one backward: the
MLP (w1, w3 column; w2 row) and attention (wq, wk, wv column, i.e. heads split; wo row) each need exactly
that. The input's gradient all-reduce (f) is inserted once per attention/MLP input by a forward pre-hook,
not once per column layer (three times for q, k, v) — the same bytes, a third of the messages.

The embedding is split along the vocabulary (each rank looks up the ids it owns, zeros for the others,
then all-reduce), and so is the output layer, whose logits are never gathered:
`vocab_parallel_cross_entropy` computes the loss from max, sum-exp and target logit reduced across ranks.

Sequence parallelism (`sequence_parallel=True`) keeps activations between those regions sharded along the
sequence: an all-gather before each attention/MLP input and a reduce-scatter after its output replace the
all-reduce. Norm weights then see only their rank's tokens, so their gradients are all-reduced over the
TP group after backward (`sync_tensor_parallel_grads`).

Grouped-query attention with fewer KV heads than ranks replicates each KV head on tp/n_kv ranks
(`ReplicatedKVLinear`); with tp dividing neither n_kv_heads nor a multiple of it, no split works.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lab.model import Attention, FeedForward, Transformer
from lab.parallel.tp_comms import copy_to_tp, gather_sequence, reduce_from_tp, scatter_sequence


def _shard(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if t.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} must be divisible by tp={world}")
    return t.chunk(world, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """y[.., F_X] = x[.., D] W[D, F_X]: this rank's slice of the output features. No communication here:
    the input must already be the full x on every rank (see `prepare_input`)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(_shard(linear.weight.detach(), 0, group))
        self.weight.tensor_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class ReplicatedKVLinear(nn.Module):
    """wk or wv when tp > n_kv_heads (GQA): each rank keeps the one KV head its query heads use, so tp/n_kv
    ranks hold a copy of each head. Their gradients are partial (each rank's queries only) and are summed
    over the copies by `sync_tensor_parallel_grads`."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, n_kv_heads: int) -> None:
        super().__init__()
        tp = dist.get_world_size(group)
        self.n_kv_heads, self.kv_head = n_kv_heads, dist.get_rank(group) // (tp // n_kv_heads)
        heads = linear.weight.detach().view(n_kv_heads, -1, linear.in_features)
        self.weight = nn.Parameter(heads[self.kv_head].clone())
        self.weight.tensor_parallel = True
        self.weight.tensor_parallel_replicas = tp // n_kv_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)

    @torch.no_grad()
    def sync_grad(self, group: dist.ProcessGroup) -> None:
        # every head's slot summed over the TP group: simple, and only n_kv_heads x one head's bytes
        slots = torch.zeros((self.n_kv_heads, *self.weight.shape), dtype=self.weight.dtype, device=self.weight.device)
        slots[self.kv_head] = self.weight.grad
        dist.all_reduce(slots, group=group)
        self.weight.grad.copy_(slots[self.kv_head])


class RowParallelLinear(nn.Module):
    """y[.., F] = sum over ranks of x[.., D_X] W[D_X, F]: all-reduce the partial sums (or reduce-scatter
    them along the sequence with sequence parallelism)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(_shard(linear.weight.detach(), 1, group))
        self.weight.tensor_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(x, self.weight)
        return scatter_sequence(partial, self.group) if self.sequence_parallel else reduce_from_tp(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """Each rank owns vocab_size/tp rows; ids outside its range look up zeros; the sum over ranks is the
    full embedding (all-reduce, or reduce-scatter along the sequence with SP)."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(_shard(embedding.weight.detach(), 0, group))
        self.weight.tensor_parallel = True
        self.start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        partial = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        partial = partial.masked_fill(outside[..., None], 0.0)
        return scatter_sequence(partial, self.group) if self.sequence_parallel else reduce_from_tp(partial, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over tokens whose logits are split along the vocabulary. Only per-token scalars
    cross the network (3 all-reduces of B*T numbers), never the (B, T, vocab) logits."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        logits = logits.float()
        global_max = logits.max(dim=-1).values
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - global_max[..., None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local_target = targets - start
        mine = (local_target >= 0) & (local_target < vocab_local)
        target_logit = shifted.gather(-1, local_target.clamp(0, vocab_local - 1)[..., None])[..., 0] * mine
        dist.all_reduce(target_logit, group=group)
        loss = (sum_exp.log() - target_logit).mean()
        softmax = exp / sum_exp[..., None]
        ctx.save_for_backward(softmax, local_target.clamp(0, vocab_local - 1), mine)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target[..., None], -mine[..., None].to(grad.dtype))
        return grad * (grad_loss / local_target.numel()), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, vocab/tp) sharded along the vocabulary over `group`."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)


def prepare_input(module: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
    """Give `module` the full input on every rank: f (identity forward, all-reduce of the gradient backward),
    or with SP the all-gather of the sequence shards (reduce-scatter backward)."""
    op = gather_sequence if sequence_parallel else copy_to_tp

    def hook(_module, args):
        return (op(args[0], group), *args[1:])

    module.register_forward_pre_hook(hook)


def apply_tensor_parallel(model: Transformer, group: dist.ProcessGroup, sequence_parallel: bool = False) -> Transformer:
    """Shard a materialised `lab.model.Transformer` in place over `group` (the TP plan), and return it."""
    cfg, tp = model.cfg, dist.get_world_size(group)
    if cfg.attention != "gqa" or cfg.is_moe:
        raise ValueError("tensor parallelism supports dense GQA models; use ep for experts (got "
                         f"attention={cfg.attention!r}, n_experts={cfg.n_experts})")
    for name, size in (("n_heads", cfg.n_heads), ("d_ff", cfg.d_ff), ("vocab_size", cfg.vocab_size)):
        if size % tp:
            raise ValueError(f"tp={tp} must divide {name}={size}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise ValueError(f"tp={tp} must divide n_kv_heads={cfg.n_kv_heads} (KV heads split) or be a multiple of it "
                         "(KV heads replicated)")
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, sequence_parallel)
    for block in model.layers.values():
        attn, ffn = block.attn, block.ffn
        assert isinstance(attn, Attention) and isinstance(ffn, FeedForward)
        attn.wq = ColumnParallelLinear(attn.wq, group)
        if cfg.n_kv_heads % tp == 0:
            attn.wk, attn.wv = ColumnParallelLinear(attn.wk, group), ColumnParallelLinear(attn.wv, group)
        else:
            attn.wk, attn.wv = (ReplicatedKVLinear(m, group, cfg.n_kv_heads) for m in (attn.wk, attn.wv))
        attn.wo = RowParallelLinear(attn.wo, group, sequence_parallel)
        ffn.w1, ffn.w3 = ColumnParallelLinear(ffn.w1, group), ColumnParallelLinear(ffn.w3, group)
        ffn.w2 = RowParallelLinear(ffn.w2, group, sequence_parallel)
        prepare_input(attn, group, sequence_parallel)
        prepare_input(ffn, group, sequence_parallel)
    if model.output is not None:
        model.output = ColumnParallelLinear(model.output, group)
        prepare_input(model.output, group, sequence_parallel)
    model.tp_group, model.sequence_parallel = group, sequence_parallel
    return model


@torch.no_grad()
def sync_tensor_parallel_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """After backward: sum the partial gradients of replicated KV heads over their copies, and with SP the
    gradients of replicated weights (the norms), which saw only their rank's tokens."""
    for module in model.modules():
        if isinstance(module, ReplicatedKVLinear):
            module.sync_grad(group)
    if getattr(model, "sequence_parallel", False):
        for param in model.parameters():
            if not getattr(param, "tensor_parallel", False) and param.grad is not None:
                dist.all_reduce(param.grad, group=group)


def grad_norm(model: nn.Module, tp_group: dist.ProcessGroup | None,
              pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global gradient norm of a tensor-parallel model: shards summed over ranks, replicas counted once.
    Pipeline stages hold disjoint layers: their squared norms add up over `pp_group`."""
    device = next(model.parameters()).device
    sharded, replicated = torch.zeros((), device=device), torch.zeros((), device=device)
    for param in model.parameters():
        if param.grad is None:
            continue
        square = param.grad.detach().float().pow(2).sum()
        if getattr(param, "tensor_parallel", False):
            sharded += square / getattr(param, "tensor_parallel_replicas", 1)
        else:
            replicated += square
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def torch_tp_plan(model: Transformer) -> dict:
    """The same split of the blocks in PyTorch's own API, for `parallelize_module(model, tp_mesh, plan)`:
    q, k, v, w1, w3 column-wise, wo and w2 row-wise (TorchTitan's plan; embedding and output left whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in model.layers:
        plan.update({f"layers.{i}.attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
        plan.update({f"layers.{i}.ffn.{n}": ColwiseParallel() for n in ("w1", "w3")})
        plan.update({f"layers.{i}.attn.wo": RowwiseParallel(), f"layers.{i}.ffn.w2": RowwiseParallel()})
    return plan
