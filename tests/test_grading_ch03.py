"""Chapter 03's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

The five multi-rank exercises run the student's class on real gloo ranks (dp 2 and 3) inside the sandbox and
compare with one process. A mutant is the solution cell with one classic mistake — gradients summed instead of
averaged, an all-reduce inside gradient accumulation, a shard that starts one element off when dp does not
divide the parameter count, memory never freed, a prefetch never issued, issued for the wrong block or never
waited on — and only the checks that must catch it are run, to keep this file fast.

The worked problems (03.problems) are one exercise over nine answer cells: a mutant's (old, new) is applied in
the one cell that holds `old`; each mutant is a slip a learner makes in every problem where it can happen (a GB
for a GiB, a missing factor 2).
"""

from __future__ import annotations

import random

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch03
from lab.grading.release import release_notebook
from lab.model import build_model, num_params

EXERCISES = ("03.bucketed_dp", "03.zero1", "03.zero2", "03.zero3", "03.zero3_prefetch", "03.memory_ladder",
             "03.problems")

BUCKETED_LAUNCH = ("                bucket.buffer.div_(self.world)  # the sum of grad / dp is the average\n"
                   "                bucket.handle = dist.all_reduce(bucket.buffer, async_op=True)\n")

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "dp_gradients_summed_not_averaged": (
        "03.bucketed_dp", [("                bucket.buffer.div_(self.world)  # the sum of grad / dp is the average\n",
                            "")],
        {"dp=2: the same losses, gradients and parameters as one process after every step",
         "dp=3 with gradient accumulation: the same as one process after every step"}),
    "dp_all_reduce_inside_accumulation": (
        "03.bucketed_dp", [("        if self.sync:\n            bucket.ready += 1\n"
                            "            if bucket.ready == len(bucket.params):\n",
                            "        if True:  # no_sync() ignored: every micro-batch sends its buckets\n"
                            "            bucket.ready += 1\n            if bucket.ready == len(bucket.params):\n"
                            "                bucket.ready = 0\n")],
        {"no all-reduce inside no_sync(): one per bucket, during the last micro-batch's backward"}),
    "dp_no_sync_counts_but_never_sends": (  # counts gradients under no_sync too: the last backward sends nothing
        "03.bucketed_dp", [("        if self.sync:\n            bucket.ready += 1\n",
                            "        bucket.ready += 1\n        if self.sync:\n")],
        {"no all-reduce inside no_sync(): one per bucket, during the last micro-batch's backward"}),
    "dp_finish_never_sends_an_incomplete_bucket": (  # issue 13: replicas drift when a parameter gets no gradient
        "03.bucketed_dp", [("            if bucket.handle is None:  # never completed: a parameter got no gradient "
                            "this step\n                bucket.buffer.div_(self.world)\n"
                            "                bucket.handle = dist.all_reduce(bucket.buffer, async_op=True)\n"
                            "            bucket.handle.wait()\n",
                            "            if bucket.handle is not None:\n                bucket.handle.wait()\n")],
        {"a layer the forward skips: finish() still averages its bucket, once"}),
    "dp_buckets_in_forward_order": (
        "03.bucketed_dp", [("for param in reversed(self.params):", "for param in self.params:")],
        {"buckets as torch DDP sizes them, one all-reduce per bucket per step"}),
    "dp_one_bucket_per_parameter": (
        "03.bucketed_dp", [("cap = int(bucket_mb * 2**20) // 4", "cap = 1")],
        {"buckets as torch DDP sizes them, one all-reduce per bucket per step"}),
    "dp_all_reduce_in_finish_not_overlapped": (  # finish() then sends every bucket
        "03.bucketed_dp", [(BUCKETED_LAUNCH, "                pass  # sent in finish()\n")],
        {"every all-reduce starts during backward (overlapped), none in finish()"}),
    "zero1_gradients_summed_not_averaged": (
        "03.zero1", [("        self.flat_grad.div_(self.world)\n", "")],
        {"dp=2: the same losses, gradient norms and parameters as one process after every step"}),
    "zero1_shard_off_by_one_on_uneven_sizes": (
        "03.zero1", [("self.start = self.rank * self.shard_numel", "self.start = self.rank * (numel // self.world)")],
        {"dp=3, a parameter count dp does not divide: the same as one process after every step",
         "dp=2: the same losses, gradient norms and parameters as one process after every step"}),
    "zero1_optimizer_over_all_parameters": (
        "03.zero1", [("make_optimizer([self.shard])", "make_optimizer(self.params)")],
        {"each rank keeps AdamW's two moments for its 1/dp shard only"}),
    "zero1_all_reduce_then_slice": (
        "03.zero1", [("reduce_scatter_single(self.shard.grad, self.flat_grad)",
                      "dist.all_reduce(self.flat_grad)\n"
                      "        self.shard.grad.copy_(self.flat_grad[self.start:self.start + self.shard_numel])")],
        {"one reduce-scatter of the gradients and one all-gather of the parameters per step"}),
    "zero2_all_reduce_then_slice": (  # the right numbers, but every rank receives the whole sum
        "03.zero2", [("            reduce_scatter_single(self.shard.grad, self.grad)\n",
                      "            dist.all_reduce(self.grad)\n"
                      "            self.shard.grad.copy_(self.grad.chunk(self.world)[self.rank])\n")],
        {"per step and unit, one reduce-scatter of the gradient and one all-gather of the parameters, no all-reduce"}),
    "zero2_gradients_summed_not_averaged": (  # AdamW hides it in the parameters; the shards right after show it
        "03.zero2", [("            self.grad.div_(self.world)\n", "")],
        {"right after backward, each rank's gradient shards are its slices of the whole batch's mean gradient"}),
    "zero2_shard_off_by_one_on_uneven_sizes": (
        "03.zero2", [("start = self.rank * self.shard_numel", "start = self.rank * (numel // self.world)")],
        {"dp=2: the same losses and parameters as one process after every step",
         "dp=3, units whose size dp does not divide: the same as one process after every step"}),
    "zero2_flat_gradient_kept": (  # correct, but each rank keeps the whole gradient: ZeRO-1's memory
        "03.zero2", [("            self.grad = None\n        ### END SOLUTION\n",
                      "            self.grad.zero_()  # kept for the next step\n        ### END SOLUTION\n")],
        {"after backward each rank holds a 1/dp shard of the gradients, nothing more"}),
    "zero3_gradients_summed_not_averaged": (
        "03.zero3", [("            self.grad.div_(self.world)\n", "")],
        {"dp=2: the same losses and parameters as one process after every step",
         "dp=3, blocks whose size dp does not divide: the same as one process after every step"}),
    "zero3_shard_off_by_one_on_uneven_sizes": (
        "03.zero3", [("start = self.rank * self.shard_numel", "start = self.rank * (numel // self.world)")],
        {"dp=3, blocks whose size dp does not divide: the same as one process after every step"}),
    "zero3_not_freed_after_forward": (
        "03.zero3", [("# called just before the block's backward\n        self.free()\n",
                      "# called just before the block's backward\n")],
        {"while a block computes its forward, it alone is gathered"}),
    "zero3_not_freed_after_reduce_scatter": (
        "03.zero3", [("            self.grad = None\n            self.free()\n", "            self.grad = None\n")],
        {"between steps each rank holds only its 1/dp shard of each block"}),
    "prefetch_none": (  # every block gathered just before use: nothing overlaps
        "03.zero3_prefetch", [("            self.next.prefetch()\n",
                               "            pass  # exercise 4's gather() fetches it when it is needed\n")],
        {"block i+1's all-gather is issued, asynchronously, after block i-1's forward and before block i's",
         "while block i computes its forward, blocks i and i+1 alone are gathered"}),
    "prefetch_block_after_next": (
        "03.zero3_prefetch", [("        if self.next is not None:\n            self.next.prefetch()\n",
                               "        if self.next is not None and self.next.next is not None:\n"
                               "            self.next.next.prefetch()\n")],
        {"block i+1's all-gather is issued, asynchronously, after block i-1's forward and before block i's"}),
    "prefetch_never_waited": (  # under the driver the values arrive at the wait: the block computes with NaN
        "03.zero3_prefetch", [("            self.handle.wait()\n", "")],
        {"each prefetched all-gather is waited on after the previous block's forward, before its own",
         "dp=2: the same losses and parameters as one process after every step",
         "dp=3, blocks whose size dp does not divide: the same as one process after every step"}),
    "prefetch_in_backward_too": (  # backward's gathers prefetch blocks that nothing frees before the next step
        "03.zero3_prefetch", [("        block.register_forward_pre_hook(self._prefetch_next)", "        pass"),
                              ("            super().gather()\n",
                               "            super().gather()\n        self._prefetch_next(None, ())\n")],
        {"between steps each rank holds only its 1/dp shard of each block"}),
    "ladder_optimizer_sharded_from_stage_two": (
        "03.memory_ladder", [("(shard if stage >= 1 else n_params)", "(shard if stage >= 2 else n_params)")],
        {"ZeRO-1 shards the optimizer states, fp32 master weights included"}),
    "ladder_master_weights_counted_with_parameters": (
        "03.memory_ladder", [('"mixed": (2, 2, 12)', '"mixed": (6, 2, 8)')],
        {"no ZeRO (stage 0): every rank holds all the states",
         "ZeRO-1 shards the optimizer states, fp32 master weights included"}),
    "ladder_optimizer_sharded_without_zero": (
        "03.memory_ladder", [("optimizer * (shard if stage >= 1 else n_params)", "optimizer * shard")],
        {"no ZeRO (stage 0): every rank holds all the states"}),
    "ladder_gradients_sharded_only_at_stage_three": (
        "03.memory_ladder", [("(shard if stage >= 2 else n_params)", "(shard if stage >= 3 else n_params)")],
        {"ZeRO-2 also shards the gradients, ZeRO-3 the parameters too"}),
    "ladder_shard_rounded_down": (
        "03.memory_ladder", [("shard = -(-n_params // dp)", "shard = n_params // dp")],
        {"parameter counts that dp does not divide round up"}),
    "ladder_fp32_with_master_copy": (
        "03.memory_ladder", [('"fp32": (4, 4, 8)', '"fp32": (4, 4, 12)')],
        {"fp32 training: 4 + 4 + 8 bytes per parameter"}),
}

P1, P2, P3 = ("P1 — model-state GB per GPU under ZeRO-0 to 3, with and without an fp32 gradient buffer",
              "P2 — the GiB of gradients ZeRO-2 saves per GPU over ZeRO-1",
              "P3 — the largest model N GPUs train with ZeRO-3, activations taking their share of memory")
P4, P5, P6 = ("P4 — ZeRO-3's token threshold: tokens per GPU above which a layer's forward hides its all-gather",
              "P5 — the all-gather time a prefetched ZeRO-3 layer leaves exposed, in ms",
              "P6 — bf16 parameter GiB on a ZeRO-3 GPU during a forward, with and without prefetch")
P7, P8, P9 = ("P7 — bytes a GPU sends per optimizer step under ZeRO-3 with gradient accumulation",
              "P8 — the latency per step that bucketing saves over one all-reduce per tensor, in ms",
              "P9 — the smallest global batch (tokens) that keeps pure FSDP compute-bound, several mesh axes")
MUTANTS |= {  # the problems: each mistake in every cell where a learner would make it
    "problems_gb_gib_slip": ("03.problems", [
        ("optimizer) / 1e9", "optimizer) / 2**30"), ("zero2_grads) / 2**30", "zero2_grads) / 1e9"),
        ("activation_gib) * 2**30", "activation_gib) * 1e9"), ("n_layers) / 2**30", "n_layers) / 1e9")],
        {P1, P2, P3, P6}),
    "problems_fp32_grad_buffer_never_sharded": ("03.problems", [
        ("grads, optimizer = 2, 2 + (4 if fp32_grads else 0), 12", "grads, optimizer = 2, 2, 12"),
        ("(weights + grads + optimizer)", "(weights + grads + optimizer + (4 if fp32_grads else 0))")], {P1}),
    "problems_a_missing_2": ("03.problems", [  # bf16's 2 bytes; the ring's two passes
        ("* 2 * flops / (2 * bandwidth)", "* flops / (2 * bandwidth)"),
        ("steps = 2 * (n_gpus - 1)", "steps = n_gpus - 1")], {P4, P8}),
    "problems_forward_counted_as_training": ("03.problems", [("forward_s = 2 * block_params",
                                                              "forward_s = 6 * block_params")], {P5}),
    "problems_prefetch_holds_one_layer": ("03.problems", [("whole_layers = 2 if prefetch else 1",
                                                           "whole_layers = 1")], {P6}),
    "problems_accumulation_gathers_once": ("03.problems", [("return grad_accum * 3 * per_collective",
                                                            "return 3 * per_collective")], {P7}),
    "problems_mesh_axes_ignored": ("03.problems", [("(n_axes * link_gbs * 1e9)", "(link_gbs * 1e9)")], {P9}),
}

CHAPTER = Chapter("03_data_parallel_zero.ipynb", EXERCISES, MUTANTS)
globals().update(chapter_tests(CHAPTER))


def test_random_configs_make_every_shard_uneven():
    """No block and no model divides by 2 or 3: every shard at dp 2 and 3 ends in padding."""
    rng = random.Random(0)
    for _ in range(20):
        cfg = ch03.random_config(rng)
        assert all(n % dp for n in (ch03.block_numel(cfg), ch03.total_numel(cfg)) for dp in (2, 3))
        model = build_model(cfg)
        assert num_params(model) == ch03.total_numel(cfg)
        assert num_params(model.layers["0"]) == ch03.block_numel(cfg)


@pytest.mark.parametrize("name, check, dp", [
    ("dp_gradients_summed_not_averaged",
     "dp=3 with gradient accumulation: the same as one process after every step", 3),
    ("zero1_gradients_summed_not_averaged",
     "dp=2: the same losses, gradient norms and parameters as one process after every step", 2),
    ("zero3_gradients_summed_not_averaged", "dp=2: the same losses and parameters as one process after every step", 2),
])
def test_a_sum_over_ranks_is_named_by_its_ratio(name, check, dp):
    """A gradient summed over the ranks shows as an exact dp-fold ratio: the message says so and the hint is about
    averaging (not the check's own hint, e.g. no_sync() for the accumulation check)."""
    exercise_id, replace, _ = MUTANTS[name]
    result, = CHAPTER.grade(exercise_id, replace, only={check}).checks
    assert result.status == "failed" and f"exactly {dp} times the expected" in result.message, result.message
    assert f"(dp = {dp})" in result.message and "summed, not averaged" in result.hint, result


def test_not_attempted_on_ranks_names_the_method_to_write():
    released = release_notebook(CHAPTER.solutions, CHAPTER.notebook)
    result = CHAPTER.grade("03.bucketed_dp", notebook=released, only={"buckets as torch DDP sizes them, one "
                                                                      "all-reduce per bucket per step"})
    assert result.reason.startswith("not attempted: BucketedDP.__init__ raises NotImplementedError"), result.reason
