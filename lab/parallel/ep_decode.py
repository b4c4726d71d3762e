"""Expert-parallel decode on ranks: a mixture of experts generating with its experts spread over the ranks.

(It lives in `lab.parallel`, not `lab.inference`: inference stays below the parallelisms, DESIGN.md's "Which way
imports run"; this module joins the two.)

This is DeepSeek-V3's decoding layout (DeepSeek-V3 Technical Report, §3.4 "Inference and Deployment") in
miniature: every rank holds the router, attention and dense layers whole (replicated), and n_experts / ep of each
MoE layer's experts; each rank decodes its *own* sequences with its own KV cache. Nothing new runs the model:
`lab.parallel.ep.apply_expert_parallel` swaps each MoE layer's expert step for the all-to-alls, and
`lab.inference.kv_cache.generate` decodes as on one process. Every forward — the prefill, then one per new token —
sends each token's hidden state to its top-k experts and back in each MoE layer: what
`lab.calc.inference.ep_decode` prices, measured here by `traced_generate`.

Per MoE layer per step a rank makes three `all_to_all_single` calls, not the two `ep_decode` counts: before the
dispatch and the combine, `ExpertParallelCompute` exchanges how many rows each rank sends to each expert
(n_experts int64 counts), so that receivers can size their buffers exactly. It adds one more latency floor per
layer and a few bytes (`lab.calc.inference.ep_counts_exchange`); DeepEP's low-latency kernels skip it by sending
into buffers sized for the worst case (every token of every rank to one rank).

Capacity: at decode nothing may be dropped — a dropped assignment changes the token's output, and with it the
text, and which tokens share the batch would decide it. `lab.model.MoE` applies `capacity_factor` only in
training; `generate` runs the model in eval mode, so every assignment reaches its expert whatever the config says,
and the receive buffers are as large as the counts exchanged (`DecodeTrace.dropped` counts what was dropped: 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab.distributed import count_collectives
from lab.inference.kv_cache import generate
from lab.inference.sampling import SamplingParams
from lab.model import MoE, Transformer
from lab.parallel.ep import apply_expert_parallel


@dataclass
class DecodeTrace:
    """What one `generate` did, forward by forward (the first forward is the prefill, then one per new token)."""

    tokens: torch.Tensor  # (batch, max_tokens): the new tokens
    logits: torch.Tensor  # (max_tokens, batch, vocab): each forward's logits at the last position
    all_to_alls: list[int]  # all_to_all_single calls this rank made, per forward
    all_to_all_bytes: list[int]  # bytes this rank handed them (their inputs, `count_collectives`), per forward
    dispatched_rows: list[int]  # token rows this rank routed to experts, summed over the MoE layers, per forward
    dropped: int  # assignments dropped by a capacity limit, over the whole decode: 0 at inference


def traced_generate(model: Transformer, prompts: torch.Tensor, params: SamplingParams) -> DecodeTrace:
    """`generate(model, prompts, params)` (with the KV cache), recording per forward the last position's logits,
    the all-to-alls this rank made and the rows its MoE layers routed. Works on one process too (no all-to-all)."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    logits: list[torch.Tensor] = []
    calls: list[int] = []
    nbytes: list[int] = []
    rows: list[int] = []
    dropped = 0

    with count_collectives() as counts:
        def before(module: torch.nn.Module, args: tuple) -> None:
            calls.append(-counts.calls["all_to_all_single"])
            nbytes.append(-counts.bytes["all_to_all_single"])

        def after(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            nonlocal dropped
            calls[-1] += counts.calls["all_to_all_single"]
            nbytes[-1] += counts.bytes["all_to_all_single"]
            logits.append(output[:, -1].detach().clone())
            rows.append(sum(int(m.load.sum()) for m in moes))
            dropped += sum(m.dropped for m in moes)

        hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
        try:
            tokens = generate(model, prompts, params)
        finally:
            for hook in hooks:
                hook.remove()
    return DecodeTrace(tokens, torch.stack(logits), calls, nbytes, rows, dropped)


def expert_parallel_decode(model: Transformer, prompts: torch.Tensor, params: SamplingParams,
                           group: dist.ProcessGroup | None = None) -> DecodeTrace:
    """Shard `model`'s experts over the ranks of `group` (in place: this rank keeps its n_experts / ep of each MoE
    layer) and decode this rank's `prompts` (its own sequences; every rank calls it with the same `params`, so the
    ranks run the same number of forwards and meet in every all-to-all)."""
    return traced_generate(apply_expert_parallel(model, group), prompts, params)
