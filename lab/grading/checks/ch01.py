"""Chapter 01, one device: memory and compute. Each answer is compared with `lab.calc` on random configs.

Configs are random (from the check's seed) and deliberately awkward: head counts whose K/V groups differ,
vocabularies and FFN widths that are not round, head_dim set apart from d_model / n_heads in a hidden check.

The worked problems (`01.problems`) are plain Python of random numbers in the sandbox (no lab.calc there),
compared with `lab.calc` to 1%.

The two torch exercises run small residual blocks from `lab.measure.recompute` (drawn from the check's seed, so the
learner's driver and the check build the same weights): `01.measured_activations` compares the learner's
saved-tensor count and prediction with `lab.measure.saved.saved_bytes`, `01.activation_checkpoint` the wrapped
block's output, gradients and saved bytes with the plain block's. torch is imported inside the functions.
"""

from __future__ import annotations

import random

from lab.calc.flops import mfu, six_n_flops_per_token, tokens_per_second, training_flops, training_time_s
from lab.calc.hardware import Accelerator
from lab.calc.memory import bytes_per_param, grad_accum_steps, korthikanti_layer_bytes, static_bytes
from lab.calc.params import count_params
from lab.calc.roofline import matmul
from lab.config import ModelConfig
from lab.grading.checks import (
    TORCH,
    CheckFailed,
    Mistake,
    describe,
    driver,
    exercise,
    expect_allclose,
    expect_close,
    expect_equal,
)


def random_config(rng: random.Random, *, gqa: bool, tied: bool, free_head_dim: bool = False) -> ModelConfig:
    n_heads = rng.choice([4, 6, 8, 12, 16, 24, 32, 40])
    n_kv_heads = rng.choice([d for d in range(1, n_heads) if n_heads % d == 0]) if gqa else n_heads
    head_dim = rng.randrange(16, 130, 2)
    d_model = n_heads * head_dim
    if free_head_dim:  # e.g. Gemma: n_heads * head_dim != d_model
        d_model = rng.choice([d for d in range(256, 4097, 64) if d != n_heads * head_dim])
    return ModelConfig(name="random", vocab_size=rng.randrange(1000, 130_000), d_model=d_model,
                       n_layers=rng.randrange(2, 49), n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim if free_head_dim else 0, d_ff=rng.randrange(d_model, 4 * d_model),
                       tie_embeddings=tied)


def state_bytes(n_params: int, precision: str = "mixed", fp32_grad_accum: bool = False) -> int:
    return sum(static_bytes(n_params, precision, fp32_grad_accum=fp32_grad_accum).values())


def layer_activations(cfg: ModelConfig, seq_len: int, micro_batch: int, recompute: str = "none") -> int:
    per_layer = korthikanti_layer_bytes(seq_len, micro_batch, cfg.d_model, cfg.n_heads, recompute=recompute)
    return round(cfg.n_layers * per_layer)


# --- 01.param_count ----------------------------------------------------------------------------------------

PARAM_COUNT = exercise("01.param_count", entry=("param_count",))


def _param_count(student, rng: random.Random, **kind) -> None:
    for _ in range(3):
        cfg = random_config(rng, **kind)
        expect_equal(student.param_count(cfg), count_params(cfg), f"param_count({describe(cfg)})")


@PARAM_COUNT.check(points=1, hint="per layer: 4 attention matrices, 3 SwiGLU matrices and 2 RMSNorm weights; "
                                  "plus the embedding, the final norm and the output layer")
def multi_head(student, rng):
    """multi-head attention, untied embeddings"""
    _param_count(student, rng, gqa=False, tied=False)


@PARAM_COUNT.check(points=1, hint="K and V project to n_kv_heads * head_dim, Q and the output to n_heads * head_dim")
def grouped_query(student, rng):
    """grouped-query attention: K and V have n_kv_heads heads"""
    _param_count(student, rng, gqa=True, tied=False)


@PARAM_COUNT.check(points=1, hint="with tie_embeddings the output layer reuses the embedding matrix")
def tied(student, rng):
    """tied embeddings are counted once"""
    _param_count(student, rng, gqa=rng.random() < 0.5, tied=True)


@PARAM_COUNT.check(points=1, hidden=True, hint="use cfg.head_dim, not d_model // n_heads")
def free_head_dim(student, rng):
    """head_dim set independently of d_model / n_heads"""
    _param_count(student, rng, gqa=True, tied=rng.random() < 0.5, free_head_dim=True)


# --- 01.state_bytes ------------------------------------------------------------------------------------------

STATE_BYTES = exercise("01.state_bytes", entry=("model_state_bytes",))


def _state_bytes(student, rng: random.Random, precision: str, fp32_grad_accum: bool) -> None:
    for _ in range(3):
        n = rng.randrange(10**6, 10**11)
        expected = state_bytes(n, precision, fp32_grad_accum)
        expect_equal(student.model_state_bytes(n, precision, fp32_grad_accum), expected,
                     f"model_state_bytes({n}, {precision!r}, fp32_grad_accum={fp32_grad_accum})")


@STATE_BYTES.check(points=0.25, hint="fp32 weights and gradients, plus Adam's two fp32 moments")
def fp32(student, rng):
    """fp32 training with Adam"""
    _state_bytes(student, rng, "fp32", False)


@STATE_BYTES.check(points=0.5, hint="bf16 weights and gradients, an fp32 master copy, Adam's two fp32 moments")
def mixed(student, rng):
    """bf16 mixed precision with fp32 master weights"""
    _state_bytes(student, rng, "mixed", False)


@STATE_BYTES.check(points=0.25, hint="an fp32 gradient buffer next to the bf16 one adds 4 bytes per parameter")
def mixed_fp32_grads(student, rng):
    """mixed precision with fp32 gradient accumulation"""
    _state_bytes(student, rng, "mixed", True)


# --- 01.activation_bytes -------------------------------------------------------------------------------------

ACTIVATIONS = exercise("01.activation_bytes", entry=("activation_bytes",))


def _activations(student, rng: random.Random, recompute: str, seq_range: tuple[int, int]) -> None:
    for _ in range(3):
        cfg, s, b = random_config(rng, gqa=True, tied=False), rng.randrange(*seq_range), rng.randrange(1, 17)
        expect_close(student.activation_bytes(cfg, s, b, recompute), layer_activations(cfg, s, b, recompute),
                     f"activation_bytes({describe(cfg)}, seq_len={s}, micro_batch={b}, recompute={recompute!r})",
                     rel=1e-9)


@ACTIVATIONS.check(points=1, hint="Korthikanti et al.'s count per layer has a term linear in s and one quadratic in "
                                  "s (the attention scores); the quadratic one counts query heads, not KV heads")
def no_recompute(student, rng):
    """no recompute: s·b·h·(34 + 5·a·s/h) per layer"""
    _activations(student, rng, "none", (64, 8192))


@ACTIVATIONS.check(points=1, hint="selective recompute drops exactly what attention keeps per score (the s² part): "
                                  "everything linear in s stays")
def selective(student, rng):
    """selective recompute keeps 34·s·b·h per layer"""
    _activations(student, rng, "selective", (64, 8192))


@ACTIVATIONS.check(points=1, hint="full recompute keeps one tensor per layer: which one, and how many bytes is it in "
                                  "16 bits?")
def full(student, rng):
    """full recompute keeps each layer's input"""
    _activations(student, rng, "full", (64, 8192))


# --- 01.max_micro_batch --------------------------------------------------------------------------------------

MAX_MICRO_BATCH = exercise("01.max_micro_batch", entry=("max_micro_batch",),
                           requires=("01.param_count", "01.state_bytes", "01.activation_bytes"))


def _max_micro_batch(student, rng: random.Random, fits: int, slack: str) -> None:
    """A random config, seq_len and recompute mode, with a budget in which exactly `fits` micro-batches fit:
    filled exactly (slack "none"), with part of one more sequence to spare ("some"), or below the model
    states alone ("below_states", fits = 0)."""
    cfg, seq = random_config(rng, gqa=True, tied=rng.random() < 0.5), rng.randrange(128, 4097)
    recompute = rng.choice(["none", "selective", "full"])
    static, per_sample = state_bytes(count_params(cfg)), layer_activations(cfg, seq, 1, recompute)
    budget = static + fits * per_sample + (rng.randrange(1, per_sample) if slack == "some" else 0)
    if slack == "below_states":
        budget = rng.randrange(static // 2, static)
    expect_equal(student.max_micro_batch(cfg, seq, budget, "mixed", recompute), fits,
                 f"max_micro_batch({describe(cfg)}, seq_len={seq}, budget_bytes={budget}, 'mixed', {recompute!r})")


@MAX_MICRO_BATCH.check(points=1, hint="model states are paid once; activations grow with the micro-batch")
def room_for_several(student, rng):
    """a budget with room for several micro-batches"""
    for _ in range(3):
        _max_micro_batch(student, rng, rng.randrange(2, 65), "some")


@MAX_MICRO_BATCH.check(points=1, hint="a micro-batch that fills the budget exactly still fits (<=, not <); "
                                      "work in integers")
def exactly_full(student, rng):
    """a budget filled exactly still fits"""
    for _ in range(3):
        _max_micro_batch(student, rng, rng.randrange(1, 65), "none")


@MAX_MICRO_BATCH.check(points=1, hint="when not even one sequence fits, the answer is 0")
def nothing_fits(student, rng):
    """a budget too small for one sequence gives 0"""
    for slack in ("some", "below_states", "below_states"):
        _max_micro_batch(student, rng, 0, slack)


# --- 01.mfu --------------------------------------------------------------------------------------------------

MFU = exercise("01.mfu", entry=("mfu",), requires=("01.param_count",))


def _mfu(student, rng: random.Random, n_gpus: int, seq_range: tuple[int, int]) -> None:
    for _ in range(3):
        cfg, seq = random_config(rng, gqa=True, tied=rng.random() < 0.5), rng.randrange(*seq_range)
        tokens, step_time, peak = seq * rng.randrange(1, 1025), rng.uniform(0.05, 20.0), rng.uniform(1e14, 2e15)
        expected = mfu(training_flops(cfg, seq, tokens), step_time, n_gpus, peak)
        shared = [Mistake(n_gpus, "n_gpus", "the step's FLOPs are done by all n_gpus together: divide by "
                                            "n_gpus · peak, not by one GPU's peak")] if n_gpus > 1 else []
        expect_close(student.mfu(cfg, seq, tokens, step_time, n_gpus, peak), expected,
                     f"mfu({describe(cfg)}, seq_len={seq}, tokens_per_step={tokens}, step_time_s={step_time!r}, "
                     f"n_gpus={n_gpus}, peak_flops={peak!r})", mistakes=shared)


@MFU.check(points=1, hint="count the FLOPs per token of a training step: the weights' share (forward and backward) "
                          "plus attention's")
def one_gpu(student, rng):
    """one GPU"""
    _mfu(student, rng, 1, (128, 2049))


@MFU.check(points=1, hint="the step's FLOPs are shared by n_gpus, each with its own peak")
def several_gpus(student, rng):
    """several GPUs"""
    _mfu(student, rng, rng.randrange(2, 1025), (128, 2049))


@MFU.check(points=1, hint="attention's products (QKᵀ and PV) do not involve weights: their FLOPs grow with the "
                          "sequence, in every layer, forward and backward")
def long_sequences(student, rng):
    """long sequences: the attention term"""
    _mfu(student, rng, rng.randrange(1, 65), (8192, 131_073))


# --- 01.measured_activations and 01.activation_checkpoint: small blocks, really run -------------------------

BLOCK_MODULES = ("lab.config", "lab.measure.recompute")
MEASURED = exercise("01.measured_activations", entry=("run_measured",), **{**TORCH, "modules": BLOCK_MODULES})
CHECKPOINT = exercise("01.activation_checkpoint", entry=("run_checkpoint",),
                      **{**TORCH, "modules": (*BLOCK_MODULES, "lab.measure.saved")})


def block_case(rng: random.Random, kind: str | None = None) -> dict:
    """A random block: kind, shape (nothing round) and seed — the arguments both drivers take."""
    d_model = rng.randrange(3, 24)
    return {"kind": kind or rng.choice(["gelu", "swiglu", "gated"]), "batch": rng.randrange(1, 4),
            "seq": rng.randrange(1, 9), "d_model": d_model, "d_ff": rng.randrange(2, 3 * d_model),
            "seed": rng.randrange(10**6)}


def _call(case: dict, **extra) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in {**case, **extra}.items())
    return f"{args}"


def lab_saved_bytes(case: dict, dtype: str = "float32") -> int:
    """What `lab.measure.saved` counts for the block of `case`."""
    import torch

    from lab.measure.recompute import Block, example_input
    from lab.measure.saved import saved_bytes

    dt = getattr(torch, dtype)
    block = Block(case["kind"], case["d_model"], case["d_ff"], seed=case["seed"], dtype=dt)
    return saved_bytes(block, example_input(case["batch"], case["seq"], case["d_model"], case["seed"], dtype=dt))


def _measured(student, rng: random.Random, kind: str | None, dtype: str, key: str) -> None:
    for _ in range(3):
        case = block_case(rng, kind)
        what = f"run_measured({_call(case, dtype=dtype)})"
        got = driver(what, "a dict with the measured and predicted bytes", student.run_measured, *case.values(),
                     dtype)
        expect_equal(got.get(key), lab_saved_bytes(case, dtype), f"{what}[{key!r}]")


@MEASURED.check(points=1, hint="count every tensor the pack hook sees, except the module's parameters (a Linear "
                               "saves its weight, but weights are not activations)")
def measured_parameters_left_out(student, rng):
    """the GELU block's saved bytes, its weights left out"""
    _measured(student, rng, "gelu", "float32", "measured")


@MEASURED.check(points=1, hint="W1 and W3 save the same input: a tensor the hook sees twice must count once — tell "
                               "saved tensors apart by the memory they live in, not by the Python objects the hook "
                               "receives")
def measured_shared_storage(student, rng):
    """one tensor saved by two ops is counted once"""
    _measured(student, rng, "swiglu", "float32", "measured")


@MEASURED.check(points=1, hint="q and v are views of the qkv matmul's output: autograd keeps the whole memory under a "
                               "view alive, so a view costs what its storage holds, not what the view shows")
def measured_views(student, rng):
    """views of one storage count the whole storage"""
    _measured(student, rng, "gated", "float32", "measured")


@MEASURED.check(points=1, hint="bytes per element come from the tensor (bf16: 2), not a constant 4")
def measured_bf16(student, rng):
    """a bf16 block: 2 bytes per element"""
    _measured(student, rng, None, "bfloat16", "measured")


@MEASURED.check(points=1, hint="go through the GELU block op by op and list what each one saves for its backward, per "
                               "token: a norm keeps small per-token statistics besides a whole tensor, and the "
                               "measured bytes are the total to match")
def predicted_gelu(student, rng):
    """the prediction for the GELU block equals the measurement"""
    _measured(student, rng, "gelu", rng.choice(["float32", "bfloat16"]), "predicted")


@MEASURED.check(points=1, hint="a tensor two ops save is one tensor; and each elementwise op keeps what its own "
                               "backward needs: which tensors is that for silu, and for the product of the two "
                               "branches?")
def predicted_swiglu(student, rng):
    """the prediction for the SwiGLU block equals the measurement"""
    _measured(student, rng, "swiglu", rng.choice(["float32", "bfloat16"]), "predicted")


@MEASURED.check(points=1, hint="a view saved for backward keeps its whole storage alive: count the qkv output as "
                               "autograd holds it; and ask what sigmoid's backward needs")
def predicted_gated(student, rng):
    """the prediction for the gated block equals the measurement"""
    _measured(student, rng, "gated", rng.choice(["float32", "bfloat16"]), "predicted")


def _checkpoint(student, case: dict, dropout: float = 0.0, input_grad: bool = True) -> tuple[dict, dict, str]:
    """(the learner's driver's dict, the plain block's gradients, the call) for `case`."""
    from lab.measure.recompute import Block, example_input, gradients

    what = f"run_checkpoint({_call(case, dropout=dropout, input_requires_grad=input_grad)})"
    got = driver(what, "the wrapped block's output, gradients and saved bytes", student.run_checkpoint,
                 *case.values(), dropout, input_grad)
    block = Block(case["kind"], case["d_model"], case["d_ff"], dropout=dropout, seed=case["seed"])
    x = example_input(case["batch"], case["seq"], case["d_model"], case["seed"], requires_grad=input_grad)
    return got, gradients(block, block, x, case["seed"]), what


def _expect_gradients(got: dict, expected: dict, what: str) -> None:
    for name, values in expected.items():
        if values is None:
            if got.get(name) is not None:
                raise CheckFailed(f"{what}[{name!r}] returned a gradient, expected None (the input needs none)")
            continue
        label = "the output" if name == "output" else f"the gradient of {name}"
        expect_allclose(got.get(name), values, f"{what}: {label}", tol=1e-5)


@CHECKPOINT.check(points=2, hint="the gradients come from a second forward run in backward, this time building a "
                                 "graph from a fresh leaf copy of the input")
def checkpoint_gradients(student, rng):
    """the same output and gradients as the plain block"""
    for kind in ("gelu", "swiglu", "gated"):
        _expect_gradients(*_checkpoint(student, block_case(rng, kind)))


@CHECKPOINT.check(points=2, hint="the forward must not keep the block's intermediates alive: only what backward "
                                 "needs to recompute them")
def checkpoint_keeps_input_only(student, rng):
    """only the block's input is kept for backward"""
    for _ in range(3):
        case = block_case(rng)
        got, _, what = _checkpoint(student, case)
        expected = 4 * case["batch"] * case["seq"] * case["d_model"]
        expect_equal(got.get("saved_bytes"), expected, f"{what}['saved_bytes'] (the plain block keeps "
                                                       f"{lab_saved_bytes(case)})")


@CHECKPOINT.check(points=2, hint="dropout draws a new mask on every call: the recomputation must see the same random "
                                 "numbers as the forward did")
def checkpoint_dropout(student, rng):
    """with dropout, the recomputation draws the forward's mask"""
    for _ in range(2):
        _expect_gradients(*_checkpoint(student, block_case(rng, "gelu"), dropout=rng.uniform(0.2, 0.6)))


@CHECKPOINT.check(points=2, hint="when the input needs no gradient, the output must still need one: autograd only "
                                 "tracks what the Function is given")
def checkpoint_frozen_input(student, rng):
    """an input that needs no gradient: the weights still get theirs"""
    for _ in range(2):
        _expect_gradients(*_checkpoint(student, block_case(rng), input_grad=False))


# --- 01.problems ---------------------------------------------------------------------------------------------

PROBLEMS = exercise("01.problems", entry=(
    "model_state_gb", "largest_model", "activation_gib", "selective_saving", "hfu_from_mfu", "training_days",
    "accumulation_steps", "matmul_intensity", "compute_bound_batch", "tokens_per_s_per_gpu"))
TOLERANCE = 0.01
GIB_FOR_GB = Mistake(2**30 / 1e9, "GiB taken for GB", "a GB is 1e9 bytes, a GiB 2**30: the problem says which")
GB_FOR_GIB = Mistake(1e9 / 2**30, "GB taken for GiB", "a GiB is 2**30 bytes, a GB 1e9: the problem says which")


@PROBLEMS.check(points=1, hint="list what mixed-precision Adam keeps per parameter and in which precision, and "
                               "whether an fp32 gradient buffer is one of them; a GB is 1e9 bytes")
def p1_model_states(student, rng):
    """P1 — model-state GB of mixed-precision Adam, with and without the fp32 master copy"""
    for master, accum in ((True, False), (False, False), (True, True)):
        n = rng.randrange(10**8, 10**12)
        expected = n * bytes_per_param("mixed" if master else "bf16", fp32_grad_accum=accum) / 1e9
        expect_close(student.model_state_gb(n, master, accum), expected,
                     f"model_state_gb({n}, master_weights={master}, fp32_grad_accum={accum})", TOLERANCE,
                     [GB_FOR_GIB])


@PROBLEMS.check(points=1, hint="ZeRO-1 shards the 12 bytes of optimizer states over the GPUs, ZeRO-2 the 2 bytes of "
                               "gradients too; without ZeRO every GPU holds all 16 bytes, whatever their number")
def p2_largest_model(student, rng):
    """P2 — the largest model n GPUs can train with mixed-precision Adam, ZeRO 0, 1 and 2"""
    for zero in (0, 1, 2):
        gib, n_gpus = rng.choice([16, 24, 40, 80, 96, 141, 192]), rng.randrange(2, 513)
        expected = gib * 2**30 / bytes_per_param("mixed", zero=zero, dp=n_gpus)
        expect_close(student.largest_model(gib, n_gpus, zero), expected,
                     f"largest_model(gpu_gib={gib}, n_gpus={n_gpus}, zero_stage={zero})", TOLERANCE, [GIB_FOR_GB])


@PROBLEMS.check(points=1, hint="the chapter's per-layer activation count, for every layer; a GiB is 2**30 bytes")
def p3_activations(student, rng):
    """P3 — a Llama-size model's activations without recompute (Korthikanti), in GiB"""
    for _ in range(3):
        heads = rng.choice([32, 40, 64, 128])
        h, layers = heads * 128, rng.randrange(16, 127)
        s, b = rng.choice([2048, 4096, 8192]), rng.randrange(1, 5)
        expected = layers * korthikanti_layer_bytes(s, b, h, heads) / 2**30
        expect_close(student.activation_gib(s, b, h, heads, layers), expected,
                     f"activation_gib(seq={s}, micro_batch={b}, d_model={h}, n_heads={heads}, n_layers={layers})",
                     TOLERANCE, [GB_FOR_GIB])


@PROBLEMS.check(points=1, hint="the fraction saved is the share of the attention-score term in the per-layer count")
def p4_selective_saving(student, rng):
    """P4 — the fraction of activation memory selective recompute saves"""
    for _ in range(3):
        heads, s = rng.choice([16, 32, 64, 96, 128]), rng.choice([1024, 2048, 4096, 8192, 16384])
        h = heads * rng.choice([64, 128])
        none, selective = (korthikanti_layer_bytes(s, 1, h, heads, recompute=r) for r in ("none", "selective"))
        expect_close(student.selective_saving(s, h, heads), 1 - selective / none,
                     f"selective_saving(seq={s}, d_model={h}, n_heads={heads})", TOLERANCE)


@PROBLEMS.check(points=1, hint="HFU counts the FLOPs the hardware executes, recomputation included; MFU only the "
                               "model's. What does each recompute policy run twice?")
def p5_hfu(student, rng):
    """P5 — HFU from MFU under full and selective recompute"""
    for recompute in ("full", "selective", "none"):
        n, layers = rng.randrange(10**9, 5 * 10**11), rng.randrange(16, 127)
        h, s, value = 128 * rng.randrange(16, 129), rng.choice([4096, 8192, 32768]), rng.uniform(0.2, 0.6)
        model, hardware = six_n_flops_per_token(n, layers, h, s, recompute)
        expect_close(student.hfu_from_mfu(value, n, layers, h, s, recompute), value * hardware / model,
                     f"hfu_from_mfu({value:.4f}, n_params={n}, n_layers={layers}, d_model={h}, seq={s}, "
                     f"recompute={recompute!r})", TOLERANCE)


@PROBLEMS.check(points=1, hint="what the cluster really delivers per second is not its peak, and not one GPU's: use "
                               "the MFU and every GPU; the answer is in days")
def p6_training_days(student, rng):
    """P6 — days to train on D tokens with 6·N·D FLOPs"""
    for _ in range(3):
        n, tokens = rng.randrange(10**9, 10**12), rng.randrange(10**11, 2 * 10**13)
        gpus, peak, value = rng.randrange(64, 32769), rng.choice([312e12, 989.4e12, 2.25e15]), rng.uniform(0.2, 0.6)
        expected = training_time_s(six_n_flops_per_token(n)[0] * tokens, gpus, peak, value) / 86_400
        expect_close(student.training_days(n, tokens, gpus, peak, value), expected,
                     f"training_days(n_params={n}, tokens={tokens}, n_gpus={gpus}, peak_flops={peak:.6g}, "
                     f"mfu={value:.4f})", TOLERANCE, [Mistake(86_400, "seconds", "divide seconds by 86,400")])


@PROBLEMS.check(points=1, hint="one optimizer step sees dp ranks × micro_batch sequences × seq tokens per "
                               "accumulation step")
def p7_accumulation(student, rng):
    """P7 — gradient-accumulation steps for a global batch in tokens"""
    for _ in range(3):
        seq, mbs, dp, steps = rng.choice([2048, 4096, 8192]), rng.randrange(1, 9), rng.randrange(2, 257), \
            rng.randrange(1, 65)
        tokens = seq * mbs * dp * steps
        expect_close(student.accumulation_steps(tokens, seq, mbs, dp), grad_accum_steps(tokens, seq, mbs, dp),
                     f"accumulation_steps(global_batch_tokens={tokens}, seq={seq}, micro_batch={mbs}, dp={dp})",
                     TOLERANCE)


@PROBLEMS.check(points=1, hint="arithmetic intensity is FLOPs over bytes moved: count both, the result's bytes "
                               "included")
def p8_intensity(student, rng):
    """P8 — a matmul's arithmetic intensity"""
    for width in (2, 4, 1):
        m, k, n = (rng.randrange(1, 16385) for _ in range(3))
        dtype = {1: "fp8", 2: "bf16", 4: "fp32"}[width]
        expect_close(student.matmul_intensity(m, k, n, width), matmul("p8", m, k, n, dtype).intensity,
                     f"matmul_intensity({m}, {k}, {n}, bytes_per_element={width})", TOLERANCE)


@PROBLEMS.check(points=1, hint="with a small batch the weights dominate the bytes: how many FLOPs does each weight "
                               "byte buy, and where does that meet the GPU's ridge point?")
def p9_critical_batch(student, rng):
    """P9 — the tokens per matmul that make a bf16 weight matmul compute-bound"""
    for _ in range(3):
        peak, bandwidth = rng.uniform(1e14, 3e15), rng.uniform(5e11, 1e13)
        chip = Accelerator("p9", peak, None, None, 0, bandwidth, "the problem's numbers")
        expect_close(student.compute_bound_batch(peak, bandwidth), chip.critical_intensity(),
                     f"compute_bound_batch(peak_flops={peak:.6g}, hbm_bandwidth={bandwidth:.6g})", TOLERANCE)


@PROBLEMS.check(points=1, hint="a token's training FLOPs, attention included, against what one GPU delivers at that "
                               "MFU")
def p10_tokens_per_s(student, rng):
    """P10 — tokens per second per GPU from MFU"""
    for s in (rng.choice([2048, 4096]), rng.choice([32768, 131072])):
        n, layers, h = rng.randrange(10**9, 5 * 10**11), rng.randrange(16, 127), 128 * rng.randrange(16, 129)
        peak, value = rng.choice([312e12, 989.4e12]), rng.uniform(0.2, 0.6)
        expected = tokens_per_second(value, six_n_flops_per_token(n, layers, h, s)[0], peak)
        expect_close(student.tokens_per_s_per_gpu(value, n, layers, h, s, peak), expected,
                     f"tokens_per_s_per_gpu({value:.4f}, n_params={n}, n_layers={layers}, d_model={h}, seq={s}, "
                     f"peak_flops={peak:.6g})", TOLERANCE)
