"""Chapter 07's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

Routing, the balancing losses and capacity are compared with `lab.model.MoE`; the dispatch plan with the layout of
`MoE.forward` and `lab.parallel.ep`; the expert-parallel layer, forward and backward (with its gradient sync on
ep × dp ranks), runs on real gloo ranks (2, 3 and 4) inside the sandbox and is compared with the whole layer in one
process. A mutant is the solution cell with one classic
mistake — weights never renormalised, or renormalised even for top-1 (a gate of 1 that teaches the router
nothing), a softmax that overflows, the assignments' share counted per token, a permutation confused with its
inverse, experts dealt to ranks round-robin, counts exchanged in the wrong order, a combine that forgets to
un-permute, a backward all-to-all with the forward's splits, expert gradients averaged over the wrong ranks or
by the wrong count, a router left unsynced — and only the checks that must catch it are run, to keep this file fast.
"""

from __future__ import annotations

import random

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch07

EXERCISES = ("07.top_k_routing", "07.balancing_loss", "07.capacity", "07.dispatch_plan", "07.ep_forward",
             "07.ep_backward", "07.problems")

ROUTE_SOFTMAX = "softmax gating, top-2 to top-4: the experts, best first, and weights that sum to one"
ROUTE_TOP1 = "top-1 (Switch), both gatings: the gate is the raw score, not 1"
ROUTE_SIGMOID = "sigmoid gating (DeepSeek-V3): the chosen experts' σ(logit), renormalised"
ROUTE_LARGE = "router logits in the hundreds: no overflow"
ROUTE_MANY = "64 to 256 experts, top-8, both gatings"
AUX_UNIFORM = "a router with equal probabilities: the loss is 1, however the tokens are assigned"
AUX_SOFTMAX = "softmax gating, random routings: n_experts·Σ f_e·P_e"
AUX_SIGMOID = "sigmoid gating: P_e from each token's scores normalised to sum to one"
Z_LOSS = "the router z-loss, logits around 0 and in the hundreds: mean of logsumexp², no overflow"
CAP_FIRST = "capacity factor 1 and 2: c·n·k/E per expert, first come first served"
CAP_SKEWED = "skewed routings: most tokens want the same two experts, the latest assignments are dropped"
CAP_ROUND = "capacity factors below 1 and capacities that are not whole: rounded up"
PLAN_ORDER = "the order: assignments sorted by expert, token order kept within each expert"
PLAN_COUNTS = "counts per expert (0 for experts no token chose) and the rows for each EP rank's block of experts"
PLAN_RECEIVE = "the receive side: rows from each rank, regrouped by local expert, then by source rank"
PLAN_SCALE = "64 ranks of 4 experts, most of them chosen by no token"
EP_TWO = "2 ranks of 2 experts: every rank's output equals the whole layer on its tokens"
EP_IMBALANCED = ("3 and 4 ranks, imbalanced routing: experts that no token chooses, one that most choose, uneven "
                 "token counts")
EP_BYTES = "only all_to_all_single: the counts, then the rows both ways, the bytes lab.calc.moe predicts"
EP_SIGMOID = "sigmoid gating, top-3, 4 ranks of 3 experts"
BACK_TWO = "2 ranks (ep=2): every rank's token, router and expert gradients equal the layer's in one process"
BACK_EP_DP = "4 ranks, ep=2 × dp=2, imbalanced routing: every rank's gradients after the sync equal the global mean's"
BACK_SIGMOID = "sigmoid gating, top-3, ep=2 × dp=2 of 3 experts per rank"

SOFTMAX = "logits.softmax(dim=-1)"
GATED = 'logits.softmax(dim=-1) if gating == "softmax" else logits.sigmoid()'
COUNTS_SENT = "dist.all_to_all_single(arriving, counts.view(ep, local), group=group)"
EXPERT_SUM = "dist.all_reduce(param.grad, group=expert_group)"
UNPERMUTE = "out.index_add_(0, token_of[order], returned * weights.flatten()[order, None])"

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "route_weights_not_renormalised": (
        "07.top_k_routing", [("    if top_k > 1:", "    if False:")],
        {ROUTE_SOFTMAX, ROUTE_SIGMOID, ROUTE_LARGE, ROUTE_MANY}),
    "route_top1_renormalised_to_one": (  # the bug: every k renormalised, a top-1 gate is always 1
        "07.top_k_routing", [("    if top_k > 1:", "    if True:")], {ROUTE_TOP1}),
    "route_top1_gate_is_one": (  # the same mistake, written as a constant gate
        "07.top_k_routing", [("    return weights, experts",
                              "    return (weights if top_k > 1 else torch.ones_like(weights)), experts")],
        {ROUTE_TOP1}),
    "route_softmax_over_the_tokens": (
        "07.top_k_routing", [(SOFTMAX, "logits.softmax(dim=0)")], {ROUTE_SOFTMAX, ROUTE_LARGE}),
    "route_sigmoid_gating_ignored": ("07.top_k_routing", [(GATED, SOFTMAX)], {ROUTE_SIGMOID, ROUTE_MANY}),
    "route_softmax_overflows": (
        "07.top_k_routing", [(SOFTMAX, "(logits.exp() / logits.exp().sum(dim=-1, keepdim=True))")], {ROUTE_LARGE}),
    "aux_share_per_token_not_per_assignment": (  # the mutant: the wrong normalisation of f_e
        "07.balancing_loss", [("/ experts.numel()", "/ experts.shape[0]")], {AUX_UNIFORM, AUX_SOFTMAX, AUX_SIGMOID}),
    "aux_without_the_n_experts_factor": (
        "07.balancing_loss", [("return n_experts * (share * probability).sum()", "return (share * probability).sum()")],
        {AUX_UNIFORM, AUX_SOFTMAX, AUX_SIGMOID}),
    "aux_sigmoid_scores_not_normalised": (
        "07.balancing_loss", [("(scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)", "scores.mean(dim=0)")],
        {AUX_SIGMOID}),
    "z_loss_overflows": (
        "07.balancing_loss", [("torch.logsumexp(logits, dim=-1)", "logits.exp().sum(dim=-1).log()")], {Z_LOSS}),
    "capacity_rounded_down": ("07.capacity", [("math.ceil(", "math.floor(")], {CAP_ROUND}),
    "capacity_keeps_the_latest": (
        "07.capacity", [("queue.cumsum(dim=0) * queue", "queue.flip(0).cumsum(dim=0).flip(0) * queue")],
        {CAP_FIRST, CAP_SKEWED}),
    "capacity_first_choices_first": (  # every token's first choice before any second choice
        "07.capacity", [("one_hot(experts.flatten(), n_experts)", "one_hot(experts.t().flatten(), n_experts)"),
                        ("(place <= capacity).view_as(experts)", "(place <= capacity).view(experts.shape[1], -1).t()")],
        {CAP_SKEWED}),
    "capacity_per_token_not_per_assignment": (
        "07.capacity", [("capacity_factor * experts.numel() / n_experts",
                         "capacity_factor * experts.shape[0] / n_experts")],
        {CAP_FIRST, CAP_SKEWED, CAP_ROUND}),
    "plan_order_is_the_inverse_permutation": (  # where each assignment goes, not which goes where
        "07.dispatch_plan", [("order = experts.argsort(stable=True)",
                              "order = experts.argsort(stable=True).argsort()")],
        {PLAN_ORDER, PLAN_SCALE}),
    "plan_counts_without_minlength": (  # experts nobody chose at the end are missing
        "07.dispatch_plan", [("torch.bincount(experts, minlength=n_experts)", "torch.bincount(experts)")],
        {PLAN_COUNTS, PLAN_SCALE}),
    "plan_experts_dealt_round_robin": (  # rank j holds experts j, j + ep, ... instead of a block
        "07.dispatch_plan", [("counts.view(ep, n_experts // ep).sum(dim=1)",
                              "counts.view(n_experts // ep, ep).sum(dim=0)")],
        {PLAN_COUNTS, PLAN_SCALE}),
    "plan_counts_read_in_the_wrong_order": (  # the arriving counts taken as (expert, source rank)
        "07.dispatch_plan", [("split(arriving.flatten().tolist())", "split(arriving.t().flatten().tolist())")],
        {PLAN_RECEIVE}),
    "plan_rows_not_regrouped_by_expert": (
        "07.dispatch_plan", [("for j in range(local) for s in range(ep)", "for s in range(ep) for j in range(local)")],
        {PLAN_RECEIVE}),
    "ep_combine_forgets_to_unpermute": (  # the mutant: rows added to tokens in the sorted order
        "07.ep_forward", [(UNPERMUTE, "out.index_add_(0, token_of, returned * weights.flatten()[:, None])")],
        {EP_TWO, EP_IMBALANCED, EP_SIGMOID}),
    "ep_counts_exchanged_in_the_wrong_order": (  # the issue's mutant: experts' counts sent to rank e % ep
        "07.ep_forward", [(COUNTS_SENT, "dist.all_to_all_single(arriving, counts.view(local, ep).t().contiguous(), "
                                        "group=group)")],
        {EP_TWO, EP_IMBALANCED, EP_SIGMOID}),
    "ep_outputs_not_put_back_in_arrival_order": (
        "07.ep_forward", [("    back = torch.empty_like(outputs)\n    back[regroup] = outputs", "    back = outputs")],
        {EP_TWO, EP_IMBALANCED, EP_SIGMOID}),
    "ep_counts_all_gathered": (  # the right answer, with an all-gather of every rank's counts
        "07.ep_forward", [(COUNTS_SENT, "everyone = torch.empty(ep, n_experts, dtype=torch.int64)\n"
                                        "    from lab.distributed import all_gather_single\n"
                                        "    all_gather_single(everyone.view(-1), counts)\n"
                                        "    mine = dist.get_rank() * local\n"
                                        "    arriving = everyone[:, mine:mine + local].contiguous()")],
        {EP_BYTES}),
    "backward_splits_not_swapped": (  # the gradient sent with the forward's splits, not back the other way
        "07.ep_backward", [("exchange_rows(grad, ctx.recv, ctx.send, ctx.group)",
                            "exchange_rows(grad, ctx.send, ctx.recv, ctx.group)")], {BACK_EP_DP}),
    "expert_gradients_averaged_over_all_ranks": (  # the wrong group: other experts' gradients mixed in
        "07.ep_backward", [(EXPERT_SUM, "dist.all_reduce(param.grad)")], {BACK_TWO, BACK_SIGMOID}),
    "expert_gradients_divided_by_ep_only": (  # averaged over the EP group, not over dp: dp times too large
        "07.ep_backward", [("            param.grad.div_(world)",
                            "            param.grad.div_(world // dist.get_world_size(expert_group))")],
        {BACK_EP_DP}),
    "router_gradient_not_synced": (
        "07.ep_backward", [("    dist.all_reduce(router.grad)  #", "    #")], {BACK_TWO}),
}
P1 = "P1 — the bytes one rank sends over all-to-alls per MoE layer, forward and backward"
P2 = "P2 — the routed experts' training FLOPs per layer: 6 · tokens·top_k · 3·d·f"
P3 = "P3 — active parameters: the total less the routed experts a token skips"
P4 = "P4 — capacity factor and a skewed router: the assignments dropped"
P5 = "P5 — the experts' memory per GPU at expert parallelism ep, in GiB"
P6 = "P6 — the rows one expert computes per layer under uniform routing: ep·tokens·top_k/n_experts"
P7 = "P7 — one dispatch all-to-all's time at a given bandwidth"
P8 = "P8 — EP's comm/compute ratio per layer (bf16, latency left out)"
P9 = "P9 — the EP degree beyond which the all-to-alls outlast the experts' compute"
FLOPS_P8 = "    compute = 6 * tokens * top_k * 3 * d_model * d_ff_expert / (tflops * 1e12)\n    return comm / compute"

MUTANTS |= {  # the problems: each mistake in every cell where a learner would make it
    "problems_forget_the_backward_all_to_alls": ("07.problems", [
        ("return 4 * rows_leaving", "return 2 * rows_leaving"), ("comm = 4 * tokens", "comm = 2 * tokens")], {P1, P8}),
    "problems_every_row_crosses": ("07.problems", [
        ("rows_leaving = tokens * top_k * (ep - 1) / ep", "rows_leaving = tokens * top_k"),
        ("sent = tokens * top_k * d_model * dtype_bytes * (ep - 1) / ep",
         "sent = tokens * top_k * d_model * dtype_bytes")],
        {P1, P7}),
    "problems_forward_flops_only": ("07.problems", [
        ("return 6 * tokens * top_k * 3", "return 2 * tokens * top_k * 3"),
        (FLOPS_P8, FLOPS_P8.replace("compute = 6 *", "compute = 2 *"))], {P2, P8}),
    "problems_expert_has_two_matrices": ("07.problems", [
        ("skipped = moe_layers * (n_experts - top_k) * 3 *", "skipped = moe_layers * (n_experts - top_k) * 2 *"),
        ("params = moe_layers * n_experts // ep * 3 *", "params = moe_layers * n_experts // ep * 2 *")], {P3, P5}),
    "problems_gib_taken_as_gb": ("07.problems", [("/ 2**30", "/ 1e9")], {P5}),
    "problems_capacity_forgets_top_k": ("07.problems", [
        ("capacity_factor * assignments / n_experts", "capacity_factor * tokens / n_experts")], {P4}),
    "problems_rows_from_one_rank_only": ("07.problems", [
        ("return ep * tokens_per_gpu * top_k / n_experts", "return tokens_per_gpu * top_k / n_experts")], {P6}),
    "problems_latency_read_as_ms": ("07.problems", [
        ("latency_us * 1e-6 + rows / ep", "latency_us * 1e-3 + rows / ep")], {P9}),
}


CHAPTER = Chapter("07_expert_parallel.ipynb", EXERCISES, MUTANTS, said=("returned", "raised"))
globals().update(chapter_tests(CHAPTER))


def test_the_references_use_lab_model():
    """The routing references are `lab.model.MoE.route` of the check's logits (its router is the identity), and
    the check's logits never tie."""
    import torch

    rng = random.Random(0)
    logits = ch07.random_logits(rng, 50, 16)
    assert all(len(set(row)) == 16 for row in logits)
    weights, experts, aux, z = ch07.reference_route(logits, 4, "sigmoid")
    scores = torch.tensor(logits, dtype=torch.float64).sigmoid()
    assert torch.equal(experts, scores.topk(4).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(50, dtype=torch.float64))
    assert aux > 0 and z > 0


def test_the_ep_reference_draws_the_drivers_layer():
    """`ep_reference` (lab.model.MoE with the weights `ep_inputs` draws) equals the notebook's own `make_layer`,
    `make_tokens` and `Expert`s run as one layer; tilted experts are chosen by most tokens, or by none."""
    import torch

    namespace: dict = {}
    exec(compile(CHAPTER.cell("07.ep_forward"), "07.ep_forward", "exec"), namespace)
    tilt, tokens_per_rank = [0.0, 4.0, 0.0, 0.0, -4.0, 0.0], [5, 9, 3]
    reference = ch07.ep_reference(8, 6, 6, 2, "softmax", tilt, tokens_per_rank, seed=3)
    router, experts = namespace["make_layer"](8, 6, 6, tilt, 3)
    for rank, n in enumerate(tokens_per_rank):
        x = namespace["make_tokens"](n, 8, 3, rank)
        weights, chosen = (x @ router.T).softmax(-1).topk(2)
        weights = weights / weights.sum(-1, keepdim=True)
        want = sum(weights[:, k, None] * torch.stack([experts[e](x[i]) for i, e in enumerate(chosen[:, k].tolist())])
                   for k in range(2))
        torch.testing.assert_close(reference["out"][rank].float(), want, rtol=1e-4, atol=1e-5)
        assert reference["load"][rank][1] == n and reference["load"][rank][4] == 0


@pytest.mark.parametrize("ep", [2, 4])
def test_the_plan_references_are_lab_parallel_eps_layout(ep):
    """`dispatch_reference` and `receive_reference`, followed on real ranks (rows sorted by expert, counts
    exchanged, rows regrouped by expert), give every local expert the rows `lab.parallel.ep` gives it."""
    from lab.distributed import run

    for rank, (mine, lab_rows) in enumerate(run(_plan_on_ranks, ep, 8 // ep)):
        assert mine == lab_rows, f"rank {rank}"


def _plan_on_ranks(local: int):
    """Every rank routes 12 tokens to 8 experts (experts 6 and 7 chosen by none); each local expert's input rows,
    as the plan's references lay them out and as `ExpertParallelCompute` does (each row: its token's id)."""
    import torch
    import torch.distributed as dist

    from lab.model import MoE
    from lab.parallel.ep import ExpertParallelCompute

    rank, ep = dist.get_rank(), dist.get_world_size()
    rng = random.Random(rank)
    experts = [e for row in ch07.random_routing(rng, 12, 8, 2, hot=(1,), cold=(6, 7)) for e in row]
    ids = torch.tensor([[float(100 * rank + i // 2)] for i in range(len(experts))])  # the token of each assignment
    plan = ch07.dispatch_reference(experts, 8, ep)
    rows = ids[plan["order"]]
    arriving = torch.empty(ep, local, dtype=torch.int64)
    dist.all_to_all_single(arriving, torch.tensor(plan["counts"]).view(ep, local))
    receive = ch07.receive_reference(arriving.tolist())
    received = rows.new_empty(sum(receive["recv_splits"]), 1)
    dist.all_to_all_single(received, rows, receive["recv_splits"], plan["send_splits"])
    mine = [block.flatten().tolist() for block in received[receive["regroup"]].split(arriving.sum(0).tolist())]

    seen: dict[int, list[float]] = {}

    class Recorder(torch.nn.Module):
        def __init__(self, expert: int):
            super().__init__()
            self.expert = expert

        def forward(self, x):
            seen[self.expert] = x.flatten().tolist()
            return x

    moe = MoE.__new__(MoE)
    torch.nn.Module.__init__(moe)
    moe.n_experts, moe.experts = 8, torch.nn.ModuleDict({str(e): Recorder(e) for e in range(8)})
    ExpertParallelCompute(moe, None)(rows, plan["counts"])
    return mine, [seen[rank * local + j] for j in range(local)]
