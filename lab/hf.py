"""Weights that travel: a lab checkpoint as a Hugging Face Llama (or Mixtral) checkpoint, and back.

    python -m lab checkpoint convert ckpt --to hf --out hf-model        # model.safetensors + config.json
    python -m lab checkpoint convert hf-model --from hf --out ckpt2     # a lab checkpoint at step 0
    python -m lab train --config ckpt2/lab.toml --checkpoint-dir ckpt2 --resume   # fine-tune it
    python -m lab serve --checkpoint ckpt2                              # or serve it

lab's model *is* a Llama (a Mixtral with experts): the conversion renames tensors and translates the config.
The conventions where the two could differ, and what lab does about each:

- RoPE layout. lab's `apply_rope` rotates (first half, second half) pairs of each head, as Hugging Face's
  `rotate_half` does. Meta's original checkpoints rotate interleaved pairs (2i, 2i+1) instead, which is why
  transformers' src/transformers/models/llama/convert_llama_weights_to_hf.py (`permute`) reorders the rows of
  wq and wk when it imports them. lab's wq and wk are already in Hugging Face's order, so they copy unchanged:
  a permutation here would be the bug (tests/test_hf.py plants it).
- RMSNorm: both compute x·rsqrt(mean(x²) + eps)·w with the statistics in fp32; `norm_eps` is `rms_norm_eps`,
  always written (Hugging Face Llama's default, 1e-6, is not lab's, 1e-5).
- `rope_theta` is written both as transformers 5 reads it (`rope_parameters`) and as 4.x does (`rope_theta`).
- Tied embeddings: `tie_embeddings` is `tie_word_embeddings`; a tied model has no `lm_head.weight` (as
  `save_pretrained` writes it).
- GQA: `n_heads`, `n_kv_heads`, `head_dim` are `num_attention_heads`, `num_key_value_heads`, `head_dim`.
- SwiGLU: w1 (gate), w3 (up), w2 (down) are `gate_proj`, `up_proj`, `down_proj`; Mixtral's experts keep the
  names w1, w3, w2 (its Hub checkpoints do; transformers 5 fuses them on load and unfuses them on save).
- Vocabulary: `vocab_size` as is. lab has no tokenizer, hence no special tokens: `bos_token_id` and
  `eos_token_id` are null (Hugging Face's defaults, 1 and 2, would end `generate` at the first token 2).

An MoE model maps to Mixtral when it routes as Mixtral does: a softmax over the experts, the top k >= 2 scores
divided by their sum, every layer routed, no shared expert, no gate scale. Anything else (DeepSeek-V3's shared
experts, sigmoid scores, dense first layers, routed_scaling_factor, or its latent attention) is refused in one
line that names each field. DeepSeek-V3's routing bias (`MoE.routing_bias`) would not map either, but it is a
buffer set by `lab.parallel.ep.balance_routing`, which `lab.train` does not run, and checkpoints hold
parameters only: no checkpoint carries one. Training-only settings without a Mixtral field (`capacity_factor`,
`z_loss_coef`) are not carried; `aux_loss_coef` is `router_aux_loss_coef`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import torch

from lab.checkpoint import complete_checkpoints, save, to_single_file
from lab.config import Config, ModelConfig, save_config
from lab.data import SyntheticTokens
from lab.model import build_model
from lab.parallel.optim import adamw
from lab.parallel.parallelize import parallelize

# lab's parameter name (a full match) -> Hugging Face's (a `re` template)
NAMES = (
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.ffn\.router\.weight", r"model.layers.\1.block_sparse_moe.gate.weight"),
    (r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight", r"model.layers.\1.block_sparse_moe.experts.\2.\3.weight"),
)
IGNORED = re.compile(r".*rotary_emb\.inv_freq")  # older Llama checkpoints save RoPE's frequencies: lab recomputes them


def hf_name(name: str) -> str:
    """Hugging Face's name of lab's parameter `name`."""
    for pattern, template in NAMES:
        if match := re.fullmatch(pattern, name):
            return match.expand(template)
    raise ValueError(f"{name}: lab parameter without a Hugging Face Llama/Mixtral name")


def unmapped(cfg: ModelConfig) -> list[str]:
    """What of `cfg` a Hugging Face Llama or Mixtral cannot hold, each as 'field=value (why; valid: ...)'."""
    checks = [(cfg.attention == "gqa", f"attention={cfg.attention!r} (DeepSeek's latent attention; valid: 'gqa')")]
    if cfg.is_moe:
        checks += [
            (cfg.n_shared_experts == 0, f"n_shared_experts={cfg.n_shared_experts} (Mixtral has no shared expert; "
                                        f"valid: 0)"),
            (cfg.n_dense_layers == 0, f"n_dense_layers={cfg.n_dense_layers} (every Mixtral layer is routed; valid: 0)"),
            (cfg.moe_gating == "softmax", f"moe_gating={cfg.moe_gating!r} (Mixtral's router is a softmax; "
                                          f"valid: 'softmax')"),
            (cfg.renormalizes_gates, f"moe_gate_norm={cfg.moe_gate_norm!r} with top_k={cfg.top_k} (Mixtral divides "
                                     f"the top-k scores by their sum; valid: top_k >= 2 with 'auto' or 'topk')"),
            (cfg.moe_route_scale == 1.0, f"moe_route_scale={cfg.moe_route_scale} (Mixtral scales no gate; "
                                         f"valid: 1.0)"),
        ]
    return [why for ok, why in checks if not ok]


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of the Hugging Face Llama (dense) or Mixtral (MoE) with `cfg`'s shape."""
    arch = "Mixtral" if cfg.is_moe else "Llama"
    config = {
        "architectures": [f"{arch}ForCausalLM"], "model_type": arch.lower(), "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff_expert if cfg.is_moe else cfg.d_ff, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "bos_token_id": None,
        "eos_token_id": None, "torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.is_moe:
        config |= {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "sliding_window": None,
                   "router_aux_loss_coef": cfg.aux_loss_coef, "router_jitter_noise": 0.0}
    else:
        config["mlp_bias"] = False
    return config


def to_hf(path: str, out: str) -> str:
    """Write checkpoint `path` (any layout's) as `out/model.safetensors` + `out/config.json`; say what it wrote."""
    from safetensors.torch import save_file

    state, config = to_single_file(path)
    cfg = config.model
    arch = "Mixtral" if cfg.is_moe else "Llama"
    if reasons := unmapped(cfg):
        raise ValueError(f"model {cfg.name!r} does not map to a Hugging Face {arch}: {'; '.join(reasons)}")
    tensors = {hf_name(name): value.contiguous() for name, value in state.items()
               if not (cfg.tie_embeddings and name == "output.weight")}  # tied: the embedding is the output layer
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(cfg, state["tok_embeddings.weight"].dtype), f, indent=2)
    return f"wrote {len(tensors)} tensors of {path} as a Hugging Face {arch} to {out}"


def _need(hf: dict, key: str) -> object:
    if hf.get(key) is None:
        raise ValueError(f"config.json has no {key!r}, which lab needs to build the model")
    return hf[key]


def lab_model_config(hf: dict, name: str) -> ModelConfig:
    """lab's ModelConfig for a Hugging Face Llama or Mixtral config.json; ValueError naming what does not map."""
    kind = hf.get("model_type")
    if kind not in ("llama", "mixtral"):
        raise ValueError(f"model_type={kind!r} does not map to lab's model; valid: 'llama', 'mixtral'")
    rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta")}
    checks = [
        (hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')!r} (valid: 'silu')"),
        (not hf.get("attention_bias"), "attention_bias=true (lab's projections have no bias; valid: false)"),
        (not hf.get("mlp_bias"), "mlp_bias=true (lab's projections have no bias; valid: false)"),
        (rope.get("rope_type") == "default" and not hf.get("rope_scaling"),
         f"rope scaling {hf.get('rope_scaling') or rope} (lab's RoPE scales no frequency; valid: rope_type "
         f"'default')"),
        (hf.get("sliding_window") is None, f"sliding_window={hf.get('sliding_window')} (lab attends over the "
                                           f"whole context; valid: null)"),
        (kind == "llama" or hf.get("num_experts_per_tok", 2) >= 2,
         f"num_experts_per_tok={hf.get('num_experts_per_tok')} (a renormalised top-1 gate is always 1; valid: >= 2)"),
    ]
    if reasons := [why for ok, why in checks if not ok]:
        raise ValueError(f"this {kind} does not map to lab's model: {'; '.join(reasons)}")
    if rope.get("rope_theta") is None:
        raise ValueError("config.json has no 'rope_theta' (nor rope_parameters.rope_theta)")
    heads = _need(hf, "num_attention_heads")
    shape = dict(name=name, vocab_size=_need(hf, "vocab_size"), d_model=_need(hf, "hidden_size"),
                 n_layers=_need(hf, "num_hidden_layers"), n_heads=heads,
                 n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or 0,
                 d_ff=_need(hf, "intermediate_size"), max_seq_len=_need(hf, "max_position_embeddings"),
                 rope_theta=float(rope["rope_theta"]), norm_eps=float(_need(hf, "rms_norm_eps")),
                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    if kind == "mixtral":
        shape |= dict(n_experts=_need(hf, "num_local_experts"), top_k=_need(hf, "num_experts_per_tok"),
                      moe_gate_norm="topk", aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    return ModelConfig(**shape)


def read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `directory` (one file, or the shards of a large model)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors file (lab reads safetensors weights, not "
                         f"pytorch_model.bin)")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def lab_state(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`build_model(cfg).state_dict()`'s keys, each with its Hugging Face tensor in fp32 (lab's parameters)."""
    expected = build_model(cfg).state_dict()  # meta: names and shapes only
    tied = {"output.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}
    sources = {name: tied.get(name) or hf_name(name) for name in expected}
    missing = [hf for hf in sources.values() if hf not in tensors]
    unused = sorted(set(tensors) - set(sources.values()) - {n for n in tensors if IGNORED.fullmatch(n)})
    if missing or unused:
        raise ValueError(f"the weights do not fit the config: missing {missing[:3] or 'none'}, "
                         f"no place in lab's model for {unused[:3] or 'none'}")
    for name, hf in sources.items():
        if tensors[hf].shape != expected[name].shape:
            raise ValueError(f"{hf} has shape {tuple(tensors[hf].shape)}, config.json says "
                             f"{tuple(expected[name].shape)}")
    return {name: tensors[hf].float() for name, hf in sources.items()}


def write_checkpoint(config: Config, state: dict[str, torch.Tensor], out: str) -> str:
    """`state` as step 0 (before any optimizer step) of a `lab.train` run of `config`, in `out`, with the run's
    config beside it as `out/lab.toml`: what `lab.train --resume` and `lab serve --checkpoint` read. lab's own
    save writes it, from the very objects a run builds, so the format has one home (`lab.checkpoint`)."""
    from lab.trainer import lr_factor  # the schedule of lab.train: its resume at step 0 is then a fresh run's

    if done := complete_checkpoints(out):
        raise ValueError(f"{out} already holds checkpoints ({os.path.basename(done[-1])}): --resume would take "
                         f"its newest, not these weights; give an empty --out")
    train = config.train
    par = parallelize(config.model, None, config.parallel, torch.device("cpu"), train.seed, train.seq_len)
    par.model.load_state_dict(state)
    optimizer = adamw(par.parameters(), train.lr, train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    data = SyntheticTokens(config.model.vocab_size, train.seq_len, train.global_batch, train.seed,
                           train.data_branching)
    path = save(out, 0, par, optimizer, scheduler, data, config)
    save_config(config, os.path.join(out, "lab.toml"))
    return path


def from_hf(directory: str, out: str) -> str:
    """Read the Hugging Face Llama/Mixtral in `directory` into a lab checkpoint in `out`; say what it wrote."""
    config_file = os.path.join(directory, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{directory} has no config.json: not a Hugging Face model directory")
    with open(config_file) as f:
        cfg = lab_model_config(json.load(f), os.path.basename(os.path.normpath(directory)))
    state = lab_state(cfg, read_safetensors(directory))
    config = Config(model=cfg)
    config.validate()
    path = write_checkpoint(config, state, out)
    return (f"wrote {len(state)} tensors of {directory} as lab checkpoint {path}; resume with "
            f"--config {os.path.join(out, 'lab.toml')} --checkpoint-dir {out} --resume")


def add_arguments(convert: argparse.ArgumentParser, target: argparse._MutuallyExclusiveGroup) -> None:
    """`python -m lab checkpoint convert`'s Hugging Face flags (`target`: one conversion of several)."""
    target.add_argument("--to", choices=("hf",), help="write Hugging Face weights (safetensors + config.json)")
    target.add_argument("--from", dest="source", choices=("hf",), help="read Hugging Face weights from DIR into "
                        "a lab checkpoint")
    convert.add_argument("--out", metavar="OUT", help="the directory --to hf and --from hf write")


def convert(args: argparse.Namespace, path: str) -> str:
    """Run the conversion `add_arguments`' flags ask for on `path`; one line saying what it wrote."""
    if args.out is None:
        raise ValueError(f"--{'to' if args.to else 'from'} hf needs --out OUT: the directory to write")
    return to_hf(path, args.out) if args.to else from_hf(path, args.out)
