"""Typed run configuration: the model, the parallel layout and the training loop.

Three small dataclasses, each handed only to the component that needs it (TorchTitan's lesson: one
monolithic job config reached into everything is hard to change). `Config` bundles them for TOML files.

Everything here is torch-free, so `lab.calc` and the widgets can use it without importing torch.
Validation raises `ValueError` with one line that names the field, the value and the rule. The rules that tie the
degrees to the model and the batch live in `lab.layout`, which calc, parallel and the widgets call too.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lab import layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ATTENTION_KINDS = ("gqa", "mla")
MOE_GATINGS = ("softmax", "sigmoid")
MOE_GATE_NORMS = ("auto", "none", "topk")  # see ModelConfig.renormalizes_gates
PP_SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1")  # lab.calc.schedules builds them
RECOMPUTE_MODES = ("none", "selective", "full")
KERNEL_MODES = ("eager", "triton")  # torch's own ops, or lab.kernels' Triton kernels patched into the model
# torch.compile per block (lab.parallel.compile): "auto" compiles on a GPU where `lab doctor`'s check passes and
# stays eager on a CPU; "eager" never compiles; a backend name always does ("aot_eager": graphs, no code generated)
COMPILE_MODES = ("auto", "eager", "inductor", "aot_eager")
# the LM loss at tp = 1 (lab.loss): "chunked" never holds the micro-batch's fp32 logits (tensor parallelism
# always takes whole logits, split by vocabulary); "whole" is torch's cross-entropy on them, FSDP2's output_dtype recipe
LOSS_MODES = ("chunked", "whole")
# The numbers a run computes in (lab.precision.scheme): fp32; bf16/fp16 compute with fp32 master weights (fp16 with
# dynamic loss scaling); bf16 with the linears' three GEMMs in FP8, scaled per tensor or in DeepSeek-V3's tiles.
PRECISIONS = ("fp32", "bf16", "fp16", "fp8-tensorwise", "fp8-rowwise", "fp8-tilewise")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")  # what gradients are summed in: over micro-batches and over ranks
DP_MODES = ("naive", "overlapped", "bucketed")
CP_IMPLS = ("ring", "zigzag", "ulysses")  # ring attention on contiguous or zig-zag chunks; Ulysses all-to-all


_require = layout.require


def _positive(obj: Any, *names: str, minimum: int = 1) -> None:
    for name in names:
        layout.check_count(name, getattr(obj, name), minimum)


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    _require(value in allowed, f"{name}={value!r} must be one of {', '.join(map(repr, allowed))}")


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA or MLA attention, SwiGLU or MoE FFN).

    `n_experts = 0` means dense. With experts, the first `n_dense_layers` blocks keep a dense FFN of width
    `d_ff` (DeepSeek-V3 does this for its first 3 layers); the others route each token to `top_k` of
    `n_experts` SwiGLU experts of width `d_ff_expert`, plus `n_shared_experts` always-on experts.
    `attention = "mla"` selects DeepSeek's multi-head latent attention, whose shape is set by the
    `*_lora_rank` and `*_head_dim` fields; GQA uses `n_kv_heads` and `head_dim`.
    """

    name: str = "custom"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0: d_model // n_heads
    d_ff: int = 128
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Mixture of experts
    n_experts: int = 0
    top_k: int = 2
    d_ff_expert: int = 0  # 0: same as d_ff
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    moe_gating: str = "softmax"  # softmax over experts (Mixtral, Switch) or per-expert sigmoid (DeepSeek-V3)
    moe_gate_norm: str = "auto"  # "topk": the chosen scores divided by their sum; "none": raw; "auto": by top_k
    moe_route_scale: float = 1.0  # multiplies every gate (DeepSeek-V3's routed_scaling_factor: 2.5)
    capacity_factor: float = 0.0  # 0: no token dropped; c: an expert takes at most c·tokens·top_k/n_experts
    aux_loss_coef: float = 0.0  # weight of the load-balancing loss (Switch/GShard) in the training loss
    z_loss_coef: float = 0.0  # weight of the router z-loss (ST-MoE)
    # Multi-head latent attention (DeepSeek-V2/V3)
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.n_heads > 0:
            self.head_dim = self.d_model // self.n_heads
        if self.d_ff_expert == 0:
            self.d_ff_expert = self.d_ff
        self.validate()

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.n_dense_layers

    @property
    def renormalizes_gates(self) -> bool:
        """Whether the chosen experts' scores are divided by their sum before weighting the experts' outputs.

        GShard's top-2, Mixtral and DeepSeek-V3 do; Switch Transformer's top-1 gates with the raw probability.
        "auto" (the default) follows them: renormalise for top_k > 1, not for top-1 — where a renormalised gate
        is identically 1 and the router would learn nothing from the language-model loss.
        """
        return self.moe_gate_norm == "topk" or (self.moe_gate_norm == "auto" and self.top_k > 1)

    def validate(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                  "max_seq_len")
        _positive(self, "n_experts", "n_shared_experts", "n_dense_layers", minimum=0)
        _one_of("attention", self.attention, ATTENTION_KINDS)
        _require(self.n_heads % self.n_kv_heads == 0,
                 f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        _require(self.rope_theta > 0, f"rope_theta={self.rope_theta!r} must be > 0")
        if self.attention == "gqa":
            _require(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        else:
            _positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            _positive(self, "q_lora_rank", minimum=0)
            _require(self.qk_rope_head_dim % 2 == 0,
                     f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.is_moe:
            _positive(self, "top_k", "d_ff_expert")
            _one_of("moe_gating", self.moe_gating, MOE_GATINGS)
            _one_of("moe_gate_norm", self.moe_gate_norm, MOE_GATE_NORMS)
            _require(self.moe_gate_norm != "topk" or self.top_k > 1,
                     "moe_gate_norm='topk' with top_k=1 makes every gate 1 and leaves the router no gradient from the "
                     "loss: use 'none' (Switch) or 'auto' for top-1")
            _require(isinstance(self.moe_route_scale, int | float) and self.moe_route_scale > 0,
                     f"moe_route_scale={self.moe_route_scale!r} must be a number > 0")
            for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
                _require(getattr(self, name) >= 0, f"{name}={getattr(self, name)!r} must be >= 0")
            _require(self.top_k <= self.n_experts,
                     f"top_k={self.top_k} must be <= n_experts={self.n_experts}")
            _require(self.n_dense_layers < self.n_layers,
                     f"n_dense_layers={self.n_dense_layers} must be < n_layers={self.n_layers}")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


@dataclass
class ParallelConfig:
    """Degrees of the five parallelisms and the memory-saving switches that go with them.

    The world is dp x pp x cp x tp ranks; expert parallelism reuses the dp x cp ranks (ep divides them),
    as in TorchTitan. `sp` (sequence parallelism) only makes sense together with tp > 1.
    """

    # `metadata` is what `python -m lab.train` turns into its flags (--dp, --cp-impl, --pp-chunks, ...).
    dp: int = field(default=1, metadata={"help": "data-parallel degree (default: the ranks tp x cp x pp leave)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree"})
    sp: bool = field(default=False, metadata={"help": "sequence parallelism (with --tp)"})
    cp: int = field(default=1, metadata={"help": "context-parallel degree"})
    cp_impl: str = field(default="zigzag", metadata={
        "choices": CP_IMPLS, "help": "context parallelism: ring attention on contiguous or zig-zag chunks, or "
                                     "Ulysses (default zigzag)"})
    pp: int = field(default=1, metadata={"help": "pipeline-parallel degree"})
    pp_schedule: str = field(default="1f1b", metadata={
        "choices": PP_SCHEDULES, "help": "pipeline schedule (default 1f1b); the micro-batches are --grad-accum's"})
    # 0: the schedule's own, resolved here once (2 for interleaved, else 1), so a file naming only the schedule loads
    pp_virtual_stages: int = field(default=0, metadata={
        "flag": "--pp-chunks", "help": "layer chunks per pipeline rank (interleaved schedule; default 2 there)"})
    pp_layers: str = field(default="even", metadata={
        "help": "layers of each virtual stage: 'even' (default), 'llama3' (the first and last stage one layer "
                "fewer) or the counts, e.g. '3,5'"})
    ep: int = field(default=1, metadata={"help": "expert-parallel degree (carved out of dp x cp)"})
    zero: int = field(default=0, metadata={"help": "ZeRO stage 0-3 over the dp x cp ranks (0: plain data "
                                                   "parallelism)"})
    fp8_all_gather: bool = field(default=False, metadata={
        "help": "with --zero 3: all-gather the parameters in FP8 (E4M3, one scale per parameter; torchao's float8 "
                "all-gather): a quarter of fp32's bytes, the model computing with the FP8 values"})
    dp_mode: str = field(default="bucketed", metadata={
        "choices": DP_MODES, "help": "how plain data parallelism averages gradients (default bucketed)"})
    bucket_mb: float = field(default=25.0, metadata={"help": "MiB per gradient bucket for --dp-mode bucketed"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per step (gradient accumulation; a "
                                                         "pipeline's micro-batches)"})
    recompute: str = field(default="none", metadata={"choices": RECOMPUTE_MODES,
                                                     "help": "activation recomputation (default none)"})

    def __post_init__(self) -> None:
        if self.pp_virtual_stages == 0:
            self.pp_virtual_stages = layout.pp_chunks(self.pp_schedule)
        self.validate()

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def validate(self) -> None:
        _positive(self, "dp", "tp", "cp", "pp", "ep", "grad_accum", "pp_virtual_stages")
        _require(self.zero in (0, 1, 2, 3), f"zero={self.zero!r} must be one of 0, 1, 2, 3")
        _require(not self.zero or self.dp > 1, f"zero={self.zero} needs dp > 1: it shards over the data-parallel "
                                               f"ranks (got dp={self.dp})")
        _require(not self.fp8_all_gather or self.zero == 3,
                 f"fp8_all_gather=True (--fp8-all-gather) needs zero=3 (got zero={self.zero}): only ZeRO-3 "
                 f"all-gathers the parameters before each forward")
        _one_of("dp_mode", self.dp_mode, DP_MODES)
        _require(isinstance(self.bucket_mb, int | float) and self.bucket_mb > 0,
                 f"bucket_mb={self.bucket_mb!r} must be a number > 0 (MiB per gradient bucket)")
        _one_of("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _one_of("cp_impl", self.cp_impl, CP_IMPLS)
        _one_of("recompute", self.recompute, RECOMPUTE_MODES)
        if self.pp_layers not in layout.PP_SPLITS:  # counts: their number and form; their sum is the model's
            layout.split_counts(self.pp_layers, self.pp * self.pp_virtual_stages)
        _require(not self.sp or self.tp > 1, f"sp=True needs tp > 1 (got tp={self.tp})")
        layout.check_ep_ranks(self.ep, self.dp, self.cp)

    def check_model(self, model: ModelConfig) -> None:
        """Rules that tie the layout to a model's shape, e.g. "tp=3 must divide n_heads=8"."""
        layout.check_tp(self.tp, model.n_heads, model.n_kv_heads if model.attention == "gqa" else None, model.d_ff,
                        model.vocab_size)
        if self.cp > 1 and self.cp_impl == "ulysses":
            layout.check_ulysses(model.n_heads, self.tp, self.cp)
        layout.check_stages(model.n_layers, self.pp, self.pp_virtual_stages, self.pp_layers)
        if self.ep > 1:
            _require(model.is_moe, f"ep={self.ep} needs a mixture-of-experts model (n_experts=0)")
            layout.experts_per_rank(model.n_experts, self.ep)


@dataclass
class TrainConfig:
    """The training loop: how many steps, the global batch (in sequences), optimiser and logging.

    The global batch is fixed, whatever the layout: each data-parallel rank takes
    `global_batch / dp` sequences, split further into `grad_accum` micro-batches.
    """

    steps: int = 10
    global_batch: int = 8
    seq_len: int = 32
    lr: float = 3e-3
    warmup_steps: int = 2
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    data_branching: int = 4
    device: str = "auto"
    kernels: str = "eager"  # "triton": RMSNorm, SwiGLU, attention and the loss run as lab.kernels' Triton kernels
    compile: str = "auto"  # one of COMPILE_MODES: torch.compile each block after the parallelisms are applied
    loss: str = "chunked"  # one of LOSS_MODES: the loss chunk by chunk, or on the micro-batch's whole logits
    precision: str = "fp32"  # one of PRECISIONS: the model's compute dtype (FSDP2's param_dtype) and FP8 recipe
    reduce_dtype: str = "fp32"  # FSDP2's reduce_dtype: gradients summed over micro-batches and ranks in this
    # the accelerator the layout is sized for: `--dry-run` says whether its fullest rank fits, and checks the name
    # against lab.calc.hardware's table (here it would make lab.config, which a grading sandbox carries alone,
    # import lab.calc, the reference the exercises are checked against)
    hardware: str = "h100"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _positive(self, "steps", "global_batch", "seq_len", "data_branching")
        _positive(self, "warmup_steps", "seed", minimum=0)
        # past `steps` the linear warm-up never reaches the peak lr and the decay never starts (issue 33)
        _require(self.warmup_steps <= self.steps,
                 f"warmup_steps={self.warmup_steps} must be between 0 and steps={self.steps} (a longer warm-up "
                 f"never reaches the peak learning rate)")
        _require(self.lr > 0, f"lr={self.lr!r} must be > 0")
        _require(self.weight_decay >= 0, f"weight_decay={self.weight_decay!r} must be >= 0")
        _require(self.grad_clip >= 0, f"grad_clip={self.grad_clip!r} must be >= 0 (0 disables clipping)")
        _one_of("device", self.device, ("auto", "cpu", "cuda"))
        _one_of("kernels", self.kernels, KERNEL_MODES)
        _one_of("compile", self.compile, COMPILE_MODES)
        _one_of("loss", self.loss, LOSS_MODES)
        _require(self.kernels == "eager" or self.compile in ("auto", "eager"),
                 f"compile={self.compile!r} with kernels={self.kernels!r}: lab.kernels' Triton kernels are launched "
                 f"by hand (in Triton's interpreter on a CPU), not traced; compile writes its own fused kernels — "
                 f"use one or the other")
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        compute = {"fp16": "fp16", "fp32": "fp32"}.get(self.precision, "bf16")
        _require(self.reduce_dtype == "fp32" or self.reduce_dtype == compute,
                 f"reduce_dtype={self.reduce_dtype!r} with precision={self.precision!r}: gradients are summed in "
                 f"fp32 or in the compute dtype ({compute!r}), never in a narrower or another 16-bit format")


@dataclass
class Config:
    """A whole run: what `configs/*.toml` holds and `python -m lab.train` executes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        self.model.validate()
        self.parallel.validate()
        self.train.validate()
        self.parallel.check_model(self.model)
        _require(self.train.seq_len <= self.model.max_seq_len,
                 f"seq_len={self.train.seq_len} must be <= max_seq_len={self.model.max_seq_len}")
        p = self.parallel
        layout.check_sequence(self.train.seq_len, p.cp, p.cp_impl, p.tp, p.sp)
        layout.check_schedule(p.pp, p.pp_virtual_stages, p.pp_schedule, p.grad_accum)
        layout.micro_batch(self.train.global_batch, p.dp, p.grad_accum)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        """Build from nested dicts; `[model] preset = "name"` starts from a preset, other keys override it."""
        unknown = set(data) - {"model", "parallel", "train"}
        _require(not unknown, f"unknown config section(s) {sorted(unknown)}; valid: model, parallel, train")
        model_data = dict(data.get("model", {}))
        preset = model_data.pop("preset", None)
        base = ModelConfig.from_preset(preset) if preset else ModelConfig()
        model = _replace_checked(base, model_data, "model", also_valid=("preset",))
        # pp_virtual_stages left out is the schedule's default, not the default schedule's 1
        parallel = _replace_checked(ParallelConfig(), {"pp_virtual_stages": 0, **data.get("parallel", {})}, "parallel")
        train = _replace_checked(TrainConfig(), data.get("train", {}), "train")
        config = cls(model=model, parallel=parallel, train=train)
        config.validate()
        return config


# The layouts that are valid (the calculators cost them) but that lab.train does not run, each with its reason.
# One place, read by `lab.train.run` (the CLI and notebooks alike), and by anything that proposes layouts.
UNSUPPORTED: tuple[tuple[str, tuple[str, ...], Any, str], ...] = (
    ("zero>=2 with pp", ("zero", "pp"), lambda c: c.parallel.zero >= 2 and c.parallel.pp > 1,
     "ZeRO-2/3 would free gradients (and parameters) between a pipeline's micro-batches, which need them; "
     "use zero=1 with pp, as Megatron and DeepSeek-V3 do"),
    ("zero with ep", ("zero", "ep"), lambda c: c.parallel.zero > 0 and c.parallel.ep > 1,
     "experts' gradients are averaged over other ranks (ep_dp) than the rest (dp x cp), and lab's ZeRO shards "
     "over one group; use zero=0 with ep"),
    ("tp with mla", ("tp", "attention"), lambda c: c.parallel.tp > 1 and c.model.attention == "mla",
     "tensor parallelism splits grouped-query attention heads, not MLA's latent projections; use tp=1"),
    ("sp with moe", ("sp", "n_experts"), lambda c: c.parallel.sp and c.model.is_moe,
     "each TP rank would route a shard of the tokens, which changes the router's balancing losses; use sp=False"),
    ("pp with tied embeddings", ("pp", "tie_embeddings"), lambda c: c.parallel.pp > 1 and c.model.tie_embeddings,
     "the first and last stages would have to share the embedding's gradient; untie them or use pp=1"),
    ("zero-bubble with recompute", ("pp_schedule", "recompute"),
     lambda c: c.parallel.pp > 1 and c.parallel.pp_schedule == "zb-h1" and c.parallel.recompute != "none",
     "the zero-bubble schedule splits the backward by hand and keeps what it needs; use recompute='none'"),
)


def check_supported(config: Config) -> None:
    """Raise ValueError, one line, if `lab.train` cannot run this (valid) layout: the rule, the values, why."""
    for rule, names, applies, why in UNSUPPORTED:
        if applies(config):
            section = {n: config.parallel if hasattr(config.parallel, n) else config.model for n in names}
            values = ", ".join(f"{n}={getattr(section[n], n)!r}" for n in names)
            raise ValueError(f"lab.train does not run {rule} ({values}): {why}")


def _replace_checked(obj: Any, values: dict, section: str, also_valid: tuple[str, ...] = ()) -> Any:
    """`dataclasses.replace` with a clear message for unknown keys and wrongly typed values. `also_valid` names
    keys the caller has already taken out (the model's `preset`), so that the message lists them too."""
    valid = {f.name for f in fields(obj)}
    clean = {}
    for key, value in values.items():
        _require(key in valid, f"unknown field {section}.{key}; valid fields: "
                               f"{', '.join(sorted(valid | set(also_valid)))}")
        expected = type(getattr(obj, key))
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        _require(ok, f"{section}.{key}={value!r} must be of type {expected.__name__}")
        clean[key] = value
    return dataclasses.replace(obj, **clean)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse `section.field=value` (value in TOML syntax, bare strings allowed) from the command line."""
    _require("=" in text and "." in text.split("=", 1)[0],
             f"override {text!r} must look like section.field=value, e.g. train.steps=20")
    key, raw = text.split("=", 1)
    section, name = key.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, name, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = {section: dict(values) for section, values in data.items()}
    for text in overrides:
        section, name, value = parse_override(text)
        data.setdefault(section, {})[name] = value
    return data


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> dict:
    """The sections of a TOML run config (or none) with `section.field=value` overrides applied, not yet
    validated: a caller may add more fields (the command line's flags) before `Config.from_dict`."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        _require(path.is_file(), f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    return apply_overrides(data, overrides or [])


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML run config (or start from defaults) and apply `section.field=value` overrides."""
    return Config.from_dict(read_config(path, overrides))


def save_config(config: Config, path: str | Path) -> None:
    import tomli_w  # only writing needs it: a GPU image with torch but without tomli_w still reads configs

    Path(path).write_text(tomli_w.dumps(config.to_dict()))


# Presets. Shapes come from each model's public configuration; only the tiny ones are ever
# instantiated on a CPU, the others are built on the `meta` device or used by `lab.calc`.
PRESETS: dict[str, ModelConfig] = {}


def _preset(**kwargs: Any) -> None:
    PRESETS[kwargs["name"]] = ModelConfig(**kwargs)


# Tiny models for tests and laptops: every degree the chapters use (2 and 4) divides heads (4), KV heads
# (2 for tp=2), d_ff, vocab and the 8 layers; seq_len 32 splits into 2*cp zig-zag chunks for cp <= 4.
# tiny-moe gates with moe_gate_norm="auto": top-2 renormalised as GShard and Mixtral, and a chapter or a
# command line that sets top_k=1 gets Switch's raw probability instead of a constant gate of 1.
_preset(name="tiny", vocab_size=256, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=128,
        max_seq_len=256)
_preset(name="tiny-moe", vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
        max_seq_len=256, n_experts=8, top_k=2, d_ff_expert=64, aux_loss_coef=0.01, z_loss_coef=0.001)
# HuggingFaceTB/SmolLM-135M
_preset(name="smollm-135m", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
        max_seq_len=2048, rope_theta=10000.0, tie_embeddings=True)
# meta-llama/Llama-3.2-1B
_preset(name="llama3-1b", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
        max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True)
# meta-llama/Llama-3.1-8B, -70B, -405B
_preset(name="llama3-8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
        max_seq_len=131072, rope_theta=500000.0)
_preset(name="llama3-70b", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
        max_seq_len=131072, rope_theta=500000.0)
_preset(name="llama3-405b", vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8,
        d_ff=53248, max_seq_len=131072, rope_theta=500000.0)
# mistralai/Mixtral-8x7B-v0.1
_preset(name="mixtral-8x7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
        max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2,
        moe_gate_norm="topk")
# deepseek-ai/DeepSeek-V3 (without the multi-token-prediction module): MLA, 3 dense layers, then
# 256 routed experts (top-8, sigmoid scores; the chosen 8 normalised to sum to one, then times the
# routed_scaling_factor 2.5) plus 1 shared expert.
_preset(name="deepseek-v3", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128,
        d_ff=18432, max_seq_len=163840, rope_theta=10000.0, norm_eps=1e-6, n_experts=256, top_k=8,
        d_ff_expert=2048, n_shared_experts=1, n_dense_layers=3, moe_gating="sigmoid", moe_gate_norm="topk",
        moe_route_scale=2.5, attention="mla", q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=192)
