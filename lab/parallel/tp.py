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

from lab.layout import check_tp, kv_heads_replicated
from lab.model import Attention, FeedForward, Linear, Transformer
from lab.parallel.placement import Placement, place, sum_partial_gradients
from lab.parallel.tp_comms import copy_to_tp, gather_sequence, reduce_from_tp, scatter_sequence


def _piece(weight: torch.Tensor, placement: Placement) -> nn.Parameter:
    """This rank's piece of `weight` as a parameter carrying its placement. On `meta` the piece is `meta` too
    (materialised later from the placement); on a real model it holds the slice of the values."""
    return place(nn.Parameter(placement.local(weight.detach())), placement)


def _tp(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class ColumnParallelLinear(Linear):
    """y[.., F_X] = x[.., D] W[D, F_X]: this rank's slice of the output features. No communication here:
    the input must already be the full x on every rank (see `prepare_input`)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup) -> None:
        rank, tp = _tp(group)
        super().__init__(linear.in_features, linear.out_features // tp, device="meta")
        self.weight = _piece(linear.weight, Placement(tp_dim=0, tp_parts=tp, tp_index=rank, replicas=1))


class ReplicatedKVLinear(Linear):
    """wk or wv when tp > n_kv_heads (GQA): each rank keeps the one KV head its query heads use, so tp/n_kv
    ranks hold a copy of each head. Their gradients are partial (each rank's queries only): the placement says
    so, and `sync_tensor_parallel_grads` sums them over the copies."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, n_kv_heads: int) -> None:
        rank, tp = _tp(group)
        copies = tp // n_kv_heads
        super().__init__(linear.in_features, linear.out_features // n_kv_heads, device="meta")
        self.weight = _piece(linear.weight, Placement(tp_dim=0, tp_parts=n_kv_heads, tp_index=rank // copies,
                                                      tp_partial=True, replicas=copies))


class RowParallelLinear(Linear):
    """y[.., F] = sum over ranks of x[.., D_X] W[D_X, F]: this module computes the partial sum; the hook that
    `reduce_output` adds all-reduces it (or reduce-scatters it along the sequence with sequence parallelism).
    Keeping the communication out of the matmul lets the zero-bubble W pass treat it as any linear layer."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup) -> None:
        rank, tp = _tp(group)
        super().__init__(linear.in_features // tp, linear.out_features, device="meta")
        self.weight = _piece(linear.weight, Placement(tp_dim=1, tp_parts=tp, tp_index=rank, replicas=1))


class VocabParallelEmbedding(nn.Embedding):
    """Each rank owns vocab_size/tp rows; ids outside its range look up zeros; the sum over ranks (the hook of
    `reduce_output`: all-reduce, or reduce-scatter along the sequence with SP) is the full embedding."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup) -> None:
        rank, tp = _tp(group)
        super().__init__(embedding.num_embeddings // tp, embedding.embedding_dim, device="meta")
        self.weight = _piece(embedding.weight, Placement(tp_dim=0, tp_parts=tp, tp_index=rank, replicas=1))
        self.start = rank * self.num_embeddings

    def _local_ids(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        return local.masked_fill(outside, 0), outside

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local, outside = self._local_ids(tokens)
        return nn.functional.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)

    @torch.no_grad()
    def weight_gradient(self, tokens: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """The gradient of this rank's rows (the zero-bubble W pass): ids it does not own add nothing."""
        local, outside = self._local_ids(tokens)
        rows = grad_output.masked_fill(outside[..., None], 0.0).flatten(0, -2)
        return torch.zeros_like(self.weight).index_add_(0, local.flatten(), rows)


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


def reduce_output(module: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
    """Sum `module`'s partial output over the ranks: g (all-reduce forward, identity backward), or with SP the
    reduce-scatter along the sequence (all-gather backward)."""
    op = scatter_sequence if sequence_parallel else reduce_from_tp

    def hook(_module, _args, output):
        return op(output, group)

    module.register_forward_hook(hook)


def apply_tensor_parallel(model: Transformer, group: dist.ProcessGroup, sequence_parallel: bool = False) -> Transformer:
    """Shard `lab.model.Transformer` in place over `group` (the TP plan), and return it. On a `meta` model
    nothing is allocated (materialise it afterwards with `lab.parallel.parallelize.materialize_local`); on a
    materialised one each rank keeps its slice of the values.

    Every parameter gets a placement: the split ones their piece; the others (norms, and an MoE layer's router
    and experts, which stay whole on every TP rank) are replicated over the group, their gradients partial
    under sequence parallelism, where each rank's norms see only its tokens."""
    cfg, tp = model.cfg, dist.get_world_size(group)
    if cfg.attention != "gqa":
        raise ValueError(f"tensor parallelism splits grouped-query attention heads; attention={cfg.attention!r} "
                         f"(MLA's latent projections are not split): use tp=1")
    if cfg.is_moe and sequence_parallel:
        raise ValueError("sequence parallelism with a mixture-of-experts model: each TP rank would route a shard of "
                         "the tokens and the balancing losses would change; use sp=False")
    check_tp(tp, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size)
    for param in model.parameters():  # what stays whole; the split layers below replace their weights
        place(param, Placement(tp_partial=sequence_parallel, replicas=tp))
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group)
        reduce_output(model.tok_embeddings, group, sequence_parallel)
    for block in model.layers.values():
        attn, ffn = block.attn, block.ffn
        assert isinstance(attn, Attention)
        attn.wq = ColumnParallelLinear(attn.wq, group)
        if not kv_heads_replicated(cfg.n_kv_heads, tp):
            attn.wk, attn.wv = ColumnParallelLinear(attn.wk, group), ColumnParallelLinear(attn.wv, group)
        else:
            attn.wk, attn.wv = (ReplicatedKVLinear(m, group, cfg.n_kv_heads) for m in (attn.wk, attn.wv))
        attn.wo = RowParallelLinear(attn.wo, group)
        reduce_output(attn.wo, group, sequence_parallel)
        prepare_input(attn, group, sequence_parallel)
        if isinstance(ffn, FeedForward):  # an MoE layer stays whole on every TP rank (expert parallelism splits it)
            ffn.w1, ffn.w3 = ColumnParallelLinear(ffn.w1, group), ColumnParallelLinear(ffn.w3, group)
            ffn.w2 = RowParallelLinear(ffn.w2, group)
            reduce_output(ffn.w2, group, sequence_parallel)
            prepare_input(ffn, group, sequence_parallel)
    if model.output is not None:
        model.output = ColumnParallelLinear(model.output, group)
        prepare_input(model.output, group, sequence_parallel)
    model.tie_weights()  # the vocabulary split is the same for both: the tied shards stay one parameter
    return model


def sync_tensor_parallel_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """After backward: sum the partial gradients (copied KV heads; with SP the norms, which saw only their rank's
    tokens) over the TP ranks holding the same piece, as their placements say."""
    sum_partial_gradients(model.parameters(), group)


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


def torch_sp_plan(model: Transformer) -> dict:
    """TorchTitan's TP + SP plan, `torch_tp_plan` plus sequence parallelism: the residual stream stays sharded
    along the sequence (Shard(1)); each attention/MLP input is all-gathered (PrepareModuleInput), each row layer
    reduce-scatters back to Shard(1); the norms run on the sequence shard; the logits stay sharded along the
    vocabulary for `loss_parallel` (run the loss inside `with loss_parallel():`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in model.layers:
        block = f"layers.{i}."
        plan.update({block + "attn_norm": SequenceParallel(), block + "ffn_norm": SequenceParallel(),
                     # Attention.forward(x, cos, sin, cache): only x is gathered
                     block + "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                        desired_input_layouts=(Replicate(), None, None, None)),
                     block + "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     block + "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                     block + "ffn.w2": RowwiseParallel(output_layouts=Shard(1))})
        plan.update({block + name: ColwiseParallel() for name in ("attn.wq", "attn.wk", "attn.wv", "ffn.w1", "ffn.w3")})
    return plan
