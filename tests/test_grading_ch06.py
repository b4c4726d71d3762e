"""Chapter 06's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

The schedule exercises are compared with `lab.calc` (the op lists and the simulator); the split backward with
autograd over a small stage; the AFAB step runs on real gloo ranks (2, 3 and 4) inside the sandbox and is compared
with the whole model in one process. A mutant is the solution cell with one classic mistake — a warm-up one
forward too long, a bubble that forgets the chunks, a peak of p instead of p − r, a transposed weight gradient, a
B that also computes the weight gradients, a gradient sent to the wrong neighbour — and only the checks that must
catch it are run, to keep this file fast.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading import checks
from lab.grading.checks import ch06
from lab.grading.release import release_notebook

EXERCISES = ("06.one_f_one_b_order", "06.bubble", "06.peak_activations", "06.split_backward", "06.afab_step",
             "06.one_f_one_b_ranks", "06.problems")

ORDER_ENDS = "the first and the last stage, m ≥ p"
ORDER_EVERY = "every stage: p − r − 1 warm-up forwards, then one forward and one backward in turn, then the cool-down"
ORDER_FEW = "fewer micro-batches than stages (m < p)"
ORDER_DEEP = "16 to 32 stages and up to 128 micro-batches"
BUBBLE_AFAB = "AFAB and 1F1B: the bubble ratio (p−1)/m"
BUBBLE_INTERLEAVED = "interleaved 1F1B: v chunks per rank shrink the bubble by v"
STEP_AFAB = "step time of AFAB and 1F1B, random t_f and t_b"
STEP_INTERLEAVED = "step time of interleaved 1F1B"
STEP_ZB = "ZB-H1: deferred weight gradients fill part of the bubble"
BUBBLE_DEEP = "up to 32 stages and 128 micro-batches, every schedule"
PEAK_AFAB = "AFAB: every stage holds all m micro-batches"
PEAK_1F1B = "1F1B with m ≥ p: stage r holds p − r"
PEAK_FEW = "1F1B with m < p: never more than m"
PEAK_INTERLEAVED = "interleaved 1F1B, in stages' worth of activations: more than 1F1B's p − r"
PEAK_DEEP = "up to 32 stages, every schedule"
W_LINEAR = "Linear's W: the weight gradient (out, in) and the bias gradient, 2-D input"
W_RMSNORM = "RMSNorm's W: the gradient of its scale"
W_LEADING = "(batch, seq, features) inputs: summed over every leading dimension, Linear and RMSNorm"
SPLIT_B = "B: the stage's input gradient, and no weight gradient computed or stored"
SPLIT_W = "W after B, in a ZB-H1 rank's order: the accumulated weight gradients equal autograd's"
AFAB_TWO = "2 stages: the loss and every stage's gradients equal one process's"
AFAB_MORE = "3 and 4 stages, fewer and more micro-batches than stages"
AFAB_P2P = "point-to-point only: m activations forward and m gradients back across each boundary"
RANKS_TWO = "2 stages, more micro-batches than stages: the loss and both stages' gradients equal one process's"
RANKS_THREE = "3 stages, fewer and more micro-batches than stages"
RANKS_PEAK = "the most micro-batches in flight on stage r (forwarded, backward not begun) is p − r"
RANKS_P2P = "1F1B's messages: point-to-point only, one activation forward and one gradient back per micro-batch"

B_GRADS = "    grads = torch.autograd.grad(output, targets, grad_output)\n"
RETURN_LOSS = "    return loss if last else None\n"
BATCHED_SEND = "ops.append(dist.P2POp(dist.isend, tensor, send_to))"

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "order_warmup_one_too_many": (  # the mutant: warm-up count off by one
        "06.one_f_one_b_order", [("warmup = min(p - r - 1, m)", "warmup = min(p - r, m)")],
        {ORDER_ENDS, ORDER_EVERY, ORDER_FEW, ORDER_DEEP}),
    "order_warmup_one_too_few": (
        "06.one_f_one_b_order", [("warmup = min(p - r - 1, m)", "warmup = max(min(p - r - 2, m), 0)")],
        {ORDER_ENDS, ORDER_EVERY, ORDER_DEEP}),
    "order_warmup_not_capped_at_m": (
        "06.one_f_one_b_order", [("warmup = min(p - r - 1, m)", "warmup = p - r - 1")], {ORDER_FEW}),
    "order_backward_before_forward": (
        "06.one_f_one_b_order", [('ops += [f"F{warmup + i}", f"B{i}"]', 'ops += [f"B{i}", f"F{warmup + i}"]')],
        {ORDER_ENDS, ORDER_EVERY}),
    "order_cool_down_newest_first": (
        "06.one_f_one_b_order", [("for i in range(m - warmup, m)]", "for i in reversed(range(m - warmup, m))]")],
        {ORDER_EVERY}),
    "bubble_m_instead_of_v_m": (  # interleaving's gain forgotten
        "06.bubble", [("return (p - 1) / (v * m)", "return (p - 1) / m")],
        {BUBBLE_INTERLEAVED, STEP_INTERLEAVED, BUBBLE_DEEP}),
    "bubble_is_the_idle_fraction": (  # idle / total instead of idle / useful
        "06.bubble", [("return (p - 1) / (v * m)", "return (p - 1) / (v * m + p - 1)")],
        {BUBBLE_AFAB, BUBBLE_INTERLEAVED, STEP_AFAB, STEP_INTERLEAVED}),
    "step_time_without_the_bubble": (
        "06.bubble", [("return useful * (1 + bubble_ratio(schedule, p, m, v))", "return useful")],
        {STEP_AFAB, STEP_INTERLEAVED}),
    "zero_bubble_ignores_the_ws": (
        "06.bubble", [("(t_f + t_b - 2 * t_w)", "(t_f + t_b)")], {STEP_ZB}),
    "zero_bubble_fills_one_t_w": (
        "06.bubble", [("(t_f + t_b - 2 * t_w)", "(t_f + t_b - t_w)")], {STEP_ZB}),
    "peak_p_instead_of_p_minus_r": (
        "06.peak_activations", [("min(m, p - r)", "min(m, p)")], {PEAK_1F1B, PEAK_DEEP}),
    "peak_not_capped_at_m": (
        "06.peak_activations", [("min(m, p - r)", "p - r")], {PEAK_FEW}),
    "peak_afab_p_instead_of_m": (
        "06.peak_activations", [("return [m] * p", "return [p] * p")], {PEAK_AFAB}),
    "peak_interleaved_in_chunks_not_stages": (
        "06.peak_activations", [("(v - 1) * p + 1) / v, m)", "(v - 1) * p + 1), m)")],
        {PEAK_INTERLEAVED, PEAK_DEEP}),
    "peak_interleaved_forgets_the_forward_before_the_first_backward": (
        "06.peak_activations", [("(v - 1) * p + 1) / v, m)", "(v - 1) * p) / v, m)")], {PEAK_INTERLEAVED}),
    "linear_weight_grad_transposed": (  # the brief's mutant
        "06.split_backward", [("return rows_g.T @ rows_x, rows_g.sum(0)", "return rows_x.T @ rows_g, rows_g.sum(0)")],
        {W_LINEAR, W_LEADING, SPLIT_W}),
    "linear_bias_grad_averaged": (
        "06.split_backward", [("return rows_g.T @ rows_x, rows_g.sum(0)", "return rows_g.T @ rows_x, rows_g.mean(0)")],
        {W_LEADING}),
    "rmsnorm_weight_grad_from_the_raw_input": (
        "06.split_backward", [("(grad_y * normed)", "(grad_y * x)")], {W_RMSNORM, W_LEADING, SPLIT_W}),
    "rmsnorm_sums_only_the_first_dimension": (
        "06.split_backward", [("(grad_y * normed).flatten(0, -2).sum(0)", "(grad_y * normed).sum(0)")], {W_LEADING}),
    "b_runs_the_whole_backward": (  # W computed in B, by autograd: .grad filled, then W adds it again
        "06.split_backward", [(B_GRADS, "    grads = torch.autograd.grad(output, targets, grad_output, "
                                        "retain_graph=True)\n    torch.autograd.backward(output, grad_output)\n")],
        {SPLIT_B, SPLIT_W}),
    "w_computed_in_b_instead_of_after": (  # the mutant: the weight gradients computed before B returns
        "06.split_backward", [(B_GRADS, B_GRADS + "    backward_weight(calls, list(grads[1:]))\n")],
        {SPLIT_B, SPLIT_W}),
    "w_overwrites_instead_of_accumulating": (
        "06.split_backward", [("param.grad = grad if param.grad is None else param.grad + grad", "param.grad = grad")],
        {SPLIT_W}),
    "afab_gradient_sent_to_the_wrong_neighbour": (  # the mutant: the gradient goes on, not back
        "06.afab_step", [("dist.send(x.grad, rank - 1)", "dist.send(x.grad, rank + 1)")], {AFAB_TWO}),
    "afab_loss_not_divided_by_m": (
        "06.afab_step", [("F.mse_loss(y, micro_targets[i]) / m", "F.mse_loss(y, micro_targets[i])")],
        {AFAB_TWO, AFAB_MORE}),
    "afab_received_input_does_not_require_grad": (
        "06.afab_step", [("            x.requires_grad_()  # its", "            # its")], {AFAB_TWO, AFAB_MORE}),
    "afab_loss_broadcast_to_every_rank": (
        "06.afab_step", [(RETURN_LOSS, "    dist.broadcast(loss, world - 1)\n" + RETURN_LOSS)], {AFAB_P2P}),
    "one_f_one_b_warmup_one_too_many": (  # the mutant: no hang, but one micro-batch more held per stage
        "06.one_f_one_b_ranks", [("warmup = min(world - rank - 1, m)", "warmup = min(world - rank, m)")], {RANKS_PEAK}),
    "one_f_one_b_warmup_not_capped_at_m": (
        "06.one_f_one_b_ranks", [("warmup = min(world - rank - 1, m)", "warmup = world - rank - 1")], {RANKS_THREE}),
    "one_f_one_b_backward_of_the_newest": (  # the gradient that comes back is the oldest micro-batch's
        "06.one_f_one_b_ranks", [("x, y = stash.pop(0)", "x, y = stash.pop()")], {RANKS_TWO, RANKS_THREE}),
    "one_f_one_b_loss_broadcast_to_every_rank": (
        "06.one_f_one_b_ranks", [(RETURN_LOSS, "    dist.broadcast(loss, world - 1)\n" + RETURN_LOSS)], {RANKS_P2P}),
}
HANGS = {"afab_gradient_sent_to_the_wrong_neighbour"}  # ranks wait for a message that never comes: a short budget
# The other 1F1B mutant: both neighbours send first (blocking) and wait for each other. Graded once, by its
# own test below, which also times the check.
DEADLOCK = ("06.one_f_one_b_ranks", [(BATCHED_SEND, "dist.send(tensor, send_to)")], {RANKS_TWO})


P1 = "P1 — the share of a 1F1B step each GPU idles: (p − 1)/(m + p − 1)"
P2 = "P2 — the fewest micro-batches for a 1F1B bubble ratio at most a target"
P3 = "P3 — the same with v chunks per rank (interleaved 1F1B): fewer micro-batches, in multiples of p"
P4 = "P4 — interleaving's price: point-to-point messages per step, 2·m·(v·p − 1)"
P5 = "P5 — ZB-H1's idle time per rank, in the paper's regime (m ≥ p, t_w ≤ t_f, 2·t_w ≤ t_b)"
P6 = "P6 — what 1F1B saves on stage r against AFAB: (m − min(m, p − r)) micro-batches' activations"
P7 = "P7 — bytes across one pipeline boundary per step: 2·m·b·s·h·2 (bf16, both ways)"
P8 = "P8 — TP's bytes per GPU over PP's for one stage's L layers: 4·L·(t − 1)/t"
P9 = "P9 — a 1F1B step in seconds, from the global batch: m = B/(b·dp), then (m + p − 1)(t_f + t_b)"
P10 = "P10 — the first stage's memory with 1F1B: 16·N/p + min(m, p)·(L/p)·A"
MUTANTS |= {  # the problems: each mistake in every cell where a learner would make it
    "problems_idle_over_useful_time": ("06.problems", [("return (p - 1) / (m + p - 1)", "return (p - 1) / m")], {P1}),
    "problems_rounded_down": ("06.problems", [("return max(1, math.ceil((p - 1) / target))",
                                               "return max(1, int((p - 1) / target))")], {P2}),
    "problems_interleaved_m_not_a_multiple_of_p": ("06.problems", [("return math.ceil(m / p) * p", "return m")],
                                                   {P3}),
    "problems_one_direction_only": ("06.problems", [("return 2 * m * (v * p - 1)", "return m * (v * p - 1)"),
                                                    ("return 2 * m * b * s * h * 2", "return m * b * s * h * 2")],
                                    {P4, P7}),
    "problems_zb_fills_one_w_per_slot": ("06.problems", [("(t_f + t_b - 2 * t_w)", "(t_f + t_b - t_w)")], {P5}),
    "problems_1f1b_holds_p_on_every_stage": ("06.problems", [("(m - min(m, p - r))", "(m - min(m, p))")], {P6}),
    "problems_ring_factor_left_out": ("06.problems", [("return 4 * layers * 2 * (tp - 1) / tp / 2",
                                                       "return 4 * layers * 2 / 2")], {P8}),
    "problems_micro_batches_without_dp": ("06.problems", [("m = global_batch / (dp * micro_batch)",
                                                           "m = global_batch / micro_batch")], {P9}),
    "problems_first_stage_holds_one_micro_batch": ("06.problems", [("held = min(m, p)", "held = 1")], {P10}),
}


CHAPTER = Chapter("06_pipeline_parallel.ipynb", EXERCISES, MUTANTS, hangs=HANGS, said=("returned", "raised"))
globals().update(chapter_tests(CHAPTER))


def test_the_weight_gradient_reference_is_lab_parallel_pp():
    """The split-backward check's expected W (autograd, float64) is what `lab.parallel.pp.weight_gradients` — the
    W pass the real ZB-H1 pipeline runs — computes from the same input and output gradient."""
    import torch
    from torch import nn

    from lab.model import RMSNorm
    from lab.parallel.pp import weight_gradients

    for kind, lead, d_in, d_out, eps in [("linear", [5], 3, 4, 1e-6), ("linear", [2, 3], 4, 2, 1e-6),
                                         ("rmsnorm", [2, 3], 6, 6, 0.1)]:
        expected = ch06.weight_grad_reference(kind, lead, d_in, d_out, eps, seed=7)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(*lead, d_in, generator=g).double()
        grad_y = torch.randn(*lead, d_out, generator=g).double()
        module = (nn.Linear(d_in, d_out) if kind == "linear" else RMSNorm(d_in, eps)).double()
        weight_gradients(module, x, grad_y)
        torch.testing.assert_close(module.weight.grad, expected["weight"], rtol=1e-5, atol=1e-6)  # RMSNorm: float32
        if kind == "linear":
            torch.testing.assert_close(module.bias.grad, expected["bias"])


def _cell_namespace(exercise_id: str) -> dict:
    """The solution cell of `exercise_id` run here, outside the sandbox (its drivers build the models)."""
    namespace: dict = {}
    exec(compile(CHAPTER.cell(exercise_id), exercise_id, "exec"), namespace)
    return namespace


def test_the_references_draw_the_drivers_models():
    """`split_reference` draws the stage the notebook's `make_stage` builds and `afab_reference` the model of
    `make_model`, in the same order, and both differentiate them as autograd does."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    g = torch.Generator().manual_seed(3)
    stage = _cell_namespace("06.split_backward")["make_stage"](4, 5, 0.1, g)
    xs = [torch.randn(2, 3, 4, generator=g) for _ in range(2)]
    grad_ys = [torch.randn(2, 3, 4, generator=g) for _ in range(2)]
    for x, grad_y in zip(xs, grad_ys, strict=True):
        stage(x).backward(grad_y)
    expected = ch06.split_reference(4, 5, [2, 3], 2, 0.1, seed=3)
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad.double(), expected["weight_grads"][name].grad, rtol=1e-5, atol=1e-6)

    rng = random.Random(0)
    world, d, layers, batch, seed = 3, 4, 2, 6, rng.randrange(10**6)
    stages, inputs, targets = _cell_namespace("06.afab_step")["make_model"](world, d, layers, batch, seed)
    loss = F.mse_loss(nn.Sequential(*stages)(inputs), targets)
    loss.backward()
    reference = ch06.afab_reference(world, d, layers, batch, seed)
    assert reference["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for rank, stage in enumerate(stages):
        got = [p.grad.flatten().tolist() for p in stage.parameters()]
        assert len(got) == len(reference["grads"][rank]) == 2 * layers
        for mine, theirs in zip(got, reference["grads"][rank], strict=True):
            assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("name, check, factor", [
    ("bubble_m_instead_of_v_m", BUBBLE_INTERLEAVED, "v"),
    ("afab_loss_not_divided_by_m", AFAB_TWO, "m"),
])
def test_a_mistake_seen_in_the_numbers_is_named(name, check, factor):
    """An answer off by exactly v (the chunks) or m (the micro-batches) says so, and its hint is the mistake's."""
    exercise_id, replace, _ = MUTANTS[name]
    result, = CHAPTER.grade(exercise_id, replace, only={check}).checks
    assert result.status == "failed" and "times the expected values" in result.message, result.message
    assert f"({factor} = " in result.message and result.hint != ch06.SPLIT.checks[0].hint, result


def test_not_attempted_names_the_function_to_write_not_the_driver():
    released = release_notebook(CHAPTER.solutions, CHAPTER.notebook)
    result = CHAPTER.grade("06.split_backward", notebook=released)
    assert result.status == "not attempted" and result.reason.startswith(
        "not attempted: linear_weight_grad, rmsnorm_weight_grad, backward_input raise NotImplementedError"), result
    assert "run_" not in result.reason


def test_a_deadlocked_1f1b_is_reported_by_rank_and_operation_within_10_s(monkeypatch):
    """Both neighbours send first (a blocking dist.send) in the steady state: the check stops the ranks at its
    deadline (gloo's own timeout, half of it, fires first) and says which rank waited in which send — within 10 s
    of the check's start (the sandbox's own start, which imports torch once per grader, is not the check's)."""
    exercise_id, replace, (name,) = DEADLOCK
    ex = checks.get(exercise_id)
    index, check = next((i, c) for i, c in enumerate(ex.checks) if c.name == name)
    seconds = []

    def timed(student, rng):
        start = time.perf_counter()
        try:
            check.fn(student, rng)
        finally:
            seconds.append(time.perf_counter() - start)

    timed_check = dataclasses.replace(check, fn=timed)
    monkeypatch.setattr(ex, "checks", [*ex.checks[:index], timed_check, *ex.checks[index + 1:]])
    graded = CHAPTER.grade(exercise_id, replace, only={name}, wall_s=20)
    result, = graded.checks
    assert graded.points == 0 and not graded.reason, graded  # a check's verdict, not a dead sandbox
    assert result.status == "failed" and " hung — " in result.message and "expected" in result.message, result
    assert re.search(r"rank \d failed in send #\d to rank \d", result.message), result.message
    assert result.hint == ch06.HANG_HINT and seconds[0] < 10, (seconds, result)
    print(f"hang reported in {seconds[0]:.1f} s: {result.message}")
