"""Chapter 01's checks: the solutions pass with any secret; every plausible-but-wrong answer (mutant) fails.

Each mutant is the solution cell with one classic mistake. The test names the check that must catch it, so
a check that goes soft (e.g. a formula that stops distinguishing s from s²) fails here, not in a classroom.
"""

from __future__ import annotations

from grading_support import Chapter, chapter_tests

from lab.calc.params import count_params
from lab.grading import checks
from lab.grading.checks import ch01
from lab.grading.runner import run_exercise, seed

EXERCISES = ("01.param_count", "01.state_bytes", "01.activation_bytes", "01.max_micro_batch", "01.mfu",
             "01.measured_activations", "01.activation_checkpoint", "01.problems")

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "gqa_kv_as_many_heads_as_q": ("01.param_count", [("2 * d * cfg.n_kv_heads * head_dim",
                                                      "2 * d * cfg.n_heads * head_dim")],
                                  {"grouped-query attention: K and V have n_kv_heads heads"}),
    "tied_embedding_counted_twice": ("01.param_count", [("0 if cfg.tie_embeddings else cfg.vocab_size * d",
                                                         "cfg.vocab_size * d")], {"tied embeddings are counted once"}),
    "norm_weights_forgotten": ("01.param_count", [("norms = 2 * d", "norms = 0")],
                               {"multi-head attention, untied embeddings"}),
    "head_dim_from_d_model": ("01.param_count", [("d, head_dim = cfg.d_model, cfg.head_dim",
                                                  "d, head_dim = cfg.d_model, cfg.d_model // cfg.n_heads")],
                              {"head_dim set independently of d_model / n_heads"}),
    "gelu_mlp_two_matrices": ("01.param_count", [("ffn = 3 * d * cfg.d_ff", "ffn = 2 * d * cfg.d_ff")],
                              {"multi-head attention, untied embeddings"}),
    "mixed_12_bytes_no_master_copy": ("01.state_bytes", [("per_param = 2 + 2 + 4 + 4 + 4",
                                                          "per_param = 2 + 2 + 4 + 4")],
                                      {"bf16 mixed precision with fp32 master weights"}),
    "fp32_grad_accum_ignored": ("01.state_bytes", [("per_param += 4", "per_param += 0")],
                                {"mixed precision with fp32 gradient accumulation"}),
    "fp32_adam_one_moment": ("01.state_bytes", [("per_param = 4 + 4 + 4 + 4", "per_param = 4 + 4 + 4")],
                             {"fp32 training with Adam"}),
    "scores_s_instead_of_s_squared": ("01.activation_bytes", [("5 * a * s * s * b", "5 * a * s * b")],
                                      {"no recompute: s·b·h·(34 + 5·a·s/h) per layer"}),
    "scores_with_kv_heads": ("01.activation_bytes", [("cfg.d_model, cfg.n_heads", "cfg.d_model, cfg.n_kv_heads")],
                             {"no recompute: s·b·h·(34 + 5·a·s/h) per layer"}),
    "one_layer_only": ("01.activation_bytes", [("return cfg.n_layers * per_layer", "return per_layer")],
                       {"no recompute: s·b·h·(34 + 5·a·s/h) per layer", "selective recompute keeps 34·s·b·h per layer",
                        "full recompute keeps each layer's input"}),
    "selective_keeps_scores": ("01.activation_bytes", [("per_layer = 34 * s * b * h\n",
                                                        "per_layer = 34 * s * b * h + 5 * a * s * s * b\n")],
                               {"selective recompute keeps 34·s·b·h per layer"}),
    "off_by_one_strict_less": ("01.max_micro_batch", [("return (budget_bytes - states) // per_sequence",
                                                       "return (budget_bytes - states - 1) // per_sequence")],
                               {"a budget filled exactly still fits"}),
    "off_by_one_plus_one": ("01.max_micro_batch", [("return (budget_bytes - states) // per_sequence",
                                                    "return (budget_bytes - states) // per_sequence + 1")],
                            {"a budget with room for several micro-batches", "a budget filled exactly still fits",
                             "a budget too small for one sequence gives 0"}),
    "model_states_ignored": ("01.max_micro_batch", [("states = model_state_bytes(param_count(cfg), precision)",
                                                     "states = 0")],
                             {"a budget with room for several micro-batches",
                              "a budget too small for one sequence gives 0"}),
    "negative_when_nothing_fits": ("01.max_micro_batch", [("    if budget_bytes < states:\n        return 0\n", "")],
                                   {"a budget too small for one sequence gives 0"}),
    "forward_only_2n": ("01.mfu", [("6 * param_count(cfg)", "2 * param_count(cfg)")],
                        {"one GPU", "several GPUs", "long sequences: the attention term"}),
    "attention_flops_forgotten": ("01.mfu", [(" + 12 * cfg.n_layers * cfg.d_model * seq_len", "")],
                                  {"long sequences: the attention term"}),
    "n_gpus_ignored": ("01.mfu", [("(step_time_s * n_gpus * peak_flops)", "(step_time_s * peak_flops)")],
                       {"several GPUs"}),
    "hfu_8n_counts_recompute": ("01.mfu", [("6 * param_count(cfg)", "8 * param_count(cfg)")], {"one GPU"}),
    # 01.measured_activations: the count (part 1), then the prediction (part 2)
    "parameters_counted": ("01.measured_activations", [("if storage.data_ptr() not in params:", "if True:")],
                           {"the GELU block's saved bytes, its weights left out"}),
    "storage_counted_per_save": ("01.measured_activations",
                                 [("storages[storage.data_ptr()] = storage.nbytes()",
                                   "storages[len(storages)] = storage.nbytes()")],
                                 {"one tensor saved by two ops is counted once"}),
    "view_counted_at_its_size": ("01.measured_activations",
                                 [("storages[storage.data_ptr()] = storage.nbytes()",
                                   "storages.setdefault(storage.data_ptr(), t.numel() * t.element_size())")],
                                 {"views of one storage count the whole storage"}),
    "four_bytes_per_element": ("01.measured_activations",
                               [("storages[storage.data_ptr()] = storage.nbytes()",
                                 "storages[storage.data_ptr()] = 4 * storage.nbytes() // t.element_size()")],
                               {"a bf16 block: 2 bytes per element"}),
    "norm_statistics_forgotten": ("01.measured_activations", [("norm = d + 2 + d", "norm = d + d")],
                                  {"the prediction for the GELU block equals the measurement",
                                   "the prediction for the SwiGLU block equals the measurement",
                                   "the prediction for the gated block equals the measurement"}),
    "gelu_input_forgotten": ("01.measured_activations", [("per_token = norm + f + f", "per_token = norm + f")],
                             {"the prediction for the GELU block equals the measurement"}),
    "shared_input_counted_twice": ("01.measured_activations",
                                   [("per_token = norm + 4 * f", "per_token = norm + d + 4 * f")],
                                   {"the prediction for the SwiGLU block equals the measurement"}),
    "only_the_views_kept": ("01.measured_activations", [("per_token = norm + 3 * f + 3 * f",
                                                         "per_token = norm + 2 * f + 3 * f")],
                            {"the prediction for the gated block equals the measurement"}),
    # 01.activation_checkpoint
    "keeps_everything": ("01.activation_checkpoint", [("return Recompute.apply(self.block, x, *weights)",
                                                       "return self.block(x)")],
                         {"only the block's input is kept for backward"}),
    "input_gradient_dropped": ("01.activation_checkpoint", [("return (None, grad_x, *grads)",
                                                             "return (None, None, *grads)")],
                               {"the same output and gradients as the plain block"}),
    "recomputed_without_grad": ("01.activation_checkpoint", [(", torch.enable_grad():", ":")],
                                {"the same output and gradients as the plain block"}),
    "dropout_mask_redrawn": ("01.activation_checkpoint", [("            torch.set_rng_state(ctx.rng_state)\n", "")],
                             {"with dropout, the recomputation draws the forward's mask"}),
    "weights_not_inputs": ("01.activation_checkpoint", [("return Recompute.apply(self.block, x, *weights)",
                                                         "return Recompute.apply(self.block, x)")],
                           {"an input that needs no gradient: the weights still get theirs"}),
}


P1, P2, P3, P4, P5 = ("P1 — model-state GB of mixed-precision Adam, with and without the fp32 master copy",
                      "P2 — the largest model n GPUs can train with mixed-precision Adam, ZeRO 0, 1 and 2",
                      "P3 — a Llama-size model's activations without recompute (Korthikanti), in GiB",
                      "P4 — the fraction of activation memory selective recompute saves",
                      "P5 — HFU from MFU under full and selective recompute")
P6, P7, P8, P9, P10 = ("P6 — days to train on D tokens with 6·N·D FLOPs",
                       "P7 — gradient-accumulation steps for a global batch in tokens",
                       "P8 — a matmul's arithmetic intensity",
                       "P9 — the tokens per matmul that make a bf16 weight matmul compute-bound",
                       "P10 — tokens per second per GPU from MFU")
MUTANTS |= {  # the problems (one exercise over ten cells): each mistake in every cell where a learner would make it
    "problems_gib_and_gb_swapped": ("01.problems", [("return n_params * per_param / 1e9",
                                                     "return n_params * per_param / 2**30"),
                                                    ("return gpu_gib * 2**30 /", "return gpu_gib * 1e9 /"),
                                                    ("return n_layers * per_layer / 2**30",
                                                     "return n_layers * per_layer / 1e9")], {P1, P2, P3}),
    "problems_no_master_copy_in_the_16": ("01.problems", [("weights, grads, optimizer = 2, 2, 12",
                                                           "weights, grads, optimizer = 2, 2, 8")], {P2}),
    "problems_zero2_shards_everything": ("01.problems", [("    if zero_stage >= 2:\n        grads /= n_gpus\n",
                                                          "    if zero_stage >= 2:\n        grads /= n_gpus\n"
                                                          "        weights /= n_gpus\n")], {P2}),
    "problems_attention_s_not_s_squared": ("01.problems", [("per_layer = s * b * h * (34 + 5 * a * s / h)",
                                                            "per_layer = s * b * h * (34 + 5 * a / h)"),
                                                           ("square = 5 * n_heads * seq / d_model",
                                                            "square = 5 * n_heads / d_model")], {P3, P4}),
    "problems_saving_over_the_rest": ("01.problems", [("return square / (34 + square)", "return square / 34")],
                                      {P4}),
    "problems_recompute_adds_a_backward": ("01.problems", [
        ('extra = {"none": 0, "selective": attention, "full": forward}[recompute]',
         'extra = {"none": 0, "selective": 3 * attention, "full": 3 * forward}[recompute]')], {P5}),
    "problems_forward_only_2n": ("01.problems", [("flops = 6 * n_params * tokens", "flops = 2 * n_params * tokens"),
                                                 ("flops_per_token = 6 * n_params + 12",
                                                  "flops_per_token = 2 * n_params + 12")], {P6, P10}),
    "problems_days_in_seconds": ("01.problems", [("return seconds / 86_400", "return seconds")], {P6}),
    "problems_accumulation_forgets_dp": ("01.problems", [("(seq * micro_batch * dp)", "(seq * micro_batch)")], {P7}),
    "problems_intensity_without_the_output": ("01.problems", [("(m * k + k * n + m * n)", "(m * k + k * n)")],
                                              {P8}),
    "problems_critical_batch_in_elements": ("01.problems", [("return peak_flops / hbm_bandwidth",
                                                             "return 2 * peak_flops / hbm_bandwidth")], {P9}),
    "problems_tokens_attention_forgotten": ("01.problems", [(" + 12 * n_layers * d_model * seq\n", "\n")], {P10}),
}


CHAPTER = Chapter("01_memory_and_compute.ipynb", EXERCISES, MUTANTS, wall_s=30, said=("returned", "raised"),
                  released_stubs=False)  # tests/test_grading_cli.py grades the released chapter-01 notebook
globals().update(chapter_tests(CHAPTER))


def test_answers_memorised_from_the_public_seed_fail_with_a_class_secret():
    """A learner can see the public inputs; hard-coding the answers to them earns nothing when graded."""
    ex = checks.get("01.param_count")
    table = {}

    class Recorder:  # stands in for the student: records the inputs each check asks about, answers right
        def param_count(self, cfg):
            table[(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_kv_heads)] = count_params(cfg)
            return count_params(cfg)

    import random

    for check in ex.checks:
        check.fn(Recorder(), random.Random(seed(None, ex.id, check.name)))
    cheat = (f"TABLE = {table!r}\n\ndef param_count(cfg):\n"
             f"    return TABLE.get((cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_kv_heads), 0)\n")
    assert run_exercise(ex, [("cheat", cheat)]).points == ex.points  # the public inputs: all right
    assert run_exercise(ex, [("cheat", cheat)], secret="class-of-2026").points == 0


def test_random_configs_are_valid_and_awkward():
    import random

    rng = random.Random(0)
    configs = [ch01.random_config(rng, gqa=True, tied=False, free_head_dim=True) for _ in range(50)]
    assert all(c.n_heads * c.head_dim != c.d_model for c in configs)
    assert any(c.n_kv_heads not in (1, c.n_heads) for c in configs)


def test_an_answer_n_gpus_times_too_large_is_named():
    exercise_id, replace, must_fail = MUTANTS["n_gpus_ignored"]
    for check in CHAPTER.grade(exercise_id, replace, only=must_fail).checks:
        assert "times the expected values (n_gpus = " in check.message and "n_gpus · peak" in check.hint, check


def test_the_blocks_reject_bad_input_in_one_line():
    import pytest

    from lab.measure.recompute import Block

    with pytest.raises(ValueError, match=r"kind='mlp' must be one of 'gelu', 'swiglu', 'gated'"):
        Block("mlp", 8, 8)
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        Block("gelu", 8, 8, dropout=1.0)


def test_lab_counts_only_the_input_of_torch_checkpoint():
    """The reference the checkpoint exercise is held to: torch's own checkpoint keeps exactly the block's input
    (tests/test_measure.py shows the same for lab.model's blocks), the plain block more."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from lab.measure.recompute import Block, example_input
    from lab.measure.saved import saved_bytes

    class TorchCheckpointed(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    block, x = Block("gated", 12, 20, seed=1), example_input(2, 5, 12, seed=1)
    assert saved_bytes(TorchCheckpointed(block), x) == x.numel() * 4 < saved_bytes(block, x)
