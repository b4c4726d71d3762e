"""`lab.hf` and `python -m lab checkpoint convert --to hf / --from hf`: a lab checkpoint becomes a Hugging Face Llama
(Mixtral with experts) that transformers loads with every tensor in place and logits equal to lab's; Hugging Face
weights become a lab checkpoint that `lab serve` decodes greedily into transformers' `generate` tokens and that
`lab.train --resume` trains from; what does not map is refused in one line; and the README's recipe for the
single-file format gives a model on the CPU holding the saved weights.

Everything is tiny and local: no download, the Hugging Face models are built from a config written to a tmp dir.
The shapes are chosen so that every convention shows: GQA (4 query heads, 2 KV heads), a head_dim that is not
d_model / n_heads, an rms eps and a rope theta that are neither library's default, a vocabulary that is no Hugging
Face default, and norm weights drawn away from one (at one, a dropped or swapped norm would change nothing).

Tolerance: the logits of the two libraries agree to ULPS fp32 ulps of the largest logit. The models compute the same
operations; what may differ is the order of some sums (Mixtral adds the experts' outputs expert by expert, lab in
one index_add over its sorted assignments; grouped-query attention repeats KV heads or not), each a relative error of
an ulp or so, carried through two layers. Measured (torch 2.13 CPU, transformers 5.24): 0 for both models here, bit for
bit; 1.8e-7 at a largest logit of 0.93, 1.6 ulps, for another draw of a Mixtral whose experts are narrower."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from lab import checkpoint, hf, serve, train
from lab.config import Config, ModelConfig, load_config
from lab.data import SyntheticTokens
from lab.inference.engine import EngineConfig
from lab.inference.sampling import SamplingParams
from lab.model import build_model, materialize

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e .[test]")

ULPS = 8
SHAPE = dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, d_ff=96,
             max_seq_len=128, norm_eps=1e-4, rope_theta=5e5)
DENSE = ModelConfig(name="dense", tie_embeddings=True, **SHAPE)
MOE = ModelConfig(name="moe", n_experts=4, top_k=2, moe_gate_norm="topk", aux_loss_coef=0.01, **SHAPE)


def randomized(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """lab's model with every weight drawn (norms around one rather than at it)."""
    model = materialize(build_model(cfg), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    diff = (ours - theirs).abs().max().item()
    bound = ULPS * torch.finfo(torch.float32).eps * ours.abs().max().item()
    assert diff <= bound, f"max |logits difference| {diff:.3g} > {ULPS} ulps of the largest logit ({bound:.3g})"


def convert(*args: str | Path) -> int:
    return checkpoint.main(["convert", *map(str, args)])


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["llama", "mixtral"])
def test_lab_to_hf_logits_equal_and_back(cfg, tmp_path):
    model = randomized(cfg)
    hf.write_checkpoint(Config(model=cfg), model.state_dict(), str(tmp_path / "ckpt"))
    assert convert(tmp_path / "ckpt", "--to", "hf", "--out", tmp_path / "hf") == 0
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(theirs).__name__ == ("MixtralForCausalLM" if cfg.is_moe else "LlamaForCausalLM")
    assert not any(info.values()), f"transformers did not load every tensor as written: {info}"  # else: random init
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_close(model(tokens), theirs(tokens).logits)

    assert convert(tmp_path / "hf", "--from", "hf", "--out", tmp_path / "back") == 0
    state, config = checkpoint.to_single_file(checkpoint.newest(str(tmp_path / "back"))[0])
    assert config.model == ModelConfig(**{**vars(cfg), "name": "hf"})
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name


HF_SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-4, max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 5e5}, initializer_range=0.1,
                bos_token_id=None, eos_token_id=None)  # no tokenizer: generate must not stop at token 2


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def hf_model(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A Hugging Face model built from a config.json in a tmp dir, saved by `save_pretrained` (the file layout of
    the Hub: Mixtral's experts one tensor each), and converted into a lab checkpoint."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=True, **HF_SHAPE)
    else:
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **HF_SHAPE)
    config.save_pretrained(root / "config")
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(root / "config"))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape) * 0.3)
    theirs.save_pretrained(root / "hf")
    assert convert(root / "hf", "--from", "hf", "--out", root / "ckpt") == 0
    return theirs.eval(), root / "ckpt"


def test_hf_to_lab_serve_greedy_equals_generate(hf_model):
    theirs, ckpt = hf_model
    config = load_config(ckpt / "lab.toml")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    _, ours = serve.serve(config, EngineConfig(), params, requests=6, prompt_len=(4, 20), checkpoint=str(ckpt))
    prompts = serve.make_prompts(config, 6, (4, 20), seed=0)
    for prompt, generated in zip(prompts, ours, strict=True):
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert generated == out[0, len(prompt):].tolist(), f"prompt {prompt}"


def test_hf_to_lab_resumes_in_lab_train(hf_model, tmp_path):
    """Step 0 of `lab.train --resume` runs on the converted weights: its loss is transformers' on that batch."""
    theirs, ckpt = hf_model
    log, run = tmp_path / "log.jsonl", tmp_path / "run"
    shutil.copytree(ckpt, run)  # the run saves its own steps beside the converted one
    assert train.main(["--config", str(run / "lab.toml"), "--checkpoint-dir", str(run), "--steps", "2",
                       "--log-json", str(log), "--quiet", "--resume", "--set", "train.device='cpu'"]) == 0
    first = json.loads(log.read_text().splitlines()[0])
    config = load_config(ckpt / "lab.toml")
    t = config.train
    data = SyntheticTokens(config.model.vocab_size, t.seq_len, t.global_batch, t.seed, t.data_branching)
    inputs, targets = data.batch(0)  # the batch of step 0: the converted checkpoint's stream is at 0
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(theirs(inputs).logits.flatten(0, 1), targets.flatten())
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize("args, names", [
    ({"n_experts": 4, "n_shared_experts": 1, "n_dense_layers": 1, "moe_gating": "sigmoid", "moe_route_scale": 2.5},
     ["n_shared_experts=1", "n_dense_layers=1", "moe_gating='sigmoid'", "moe_route_scale=2.5"]),
    ({"n_experts": 4, "top_k": 1}, ["moe_gate_norm='auto' with top_k=1"]),
    ({"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
      "head_dim": 16}, ["attention='mla'"]),
], ids=["deepseek-v3-moe", "switch-top1", "mla"])
def test_what_does_not_map_is_refused_in_one_line(args, names, tmp_path, capsys):
    cfg = ModelConfig(**{**SHAPE, "name": "refused", **args})
    hf.write_checkpoint(Config(model=cfg), materialize(build_model(cfg)).state_dict(), str(tmp_path / "ckpt"))
    assert convert(tmp_path / "ckpt", "--to", "hf", "--out", tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(name in err for name in names), err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("config, says", [
    ({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_type"),
    ({"model_type": "qwen2"}, "model_type='qwen2' does not map to lab's model; valid: 'llama', 'mixtral'"),
    ({"model_type": "mixtral", "num_experts_per_tok": 1, "rope_theta": 1e6}, "num_experts_per_tok=1"),
], ids=["llama3-rope-scaling", "qwen2", "mixtral-top1"])
def test_hf_that_does_not_map_is_refused_in_one_line(config, says, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert convert(tmp_path / "hf", "--from", "hf", "--out", tmp_path / "ckpt") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_missing_out_is_one_line(tmp_path, capsys):
    assert convert(tmp_path, "--to", "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--to hf needs --out OUT" in err, err


def test_readme_single_file_recipe_gives_a_cpu_model_with_the_saved_weights(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    recipe = next((block for block in blocks if "load_state_dict" in block), None)
    assert recipe, "README.md shows no ```python block with load_state_dict"
    model = randomized(DENSE)
    hf.write_checkpoint(Config(model=DENSE), model.state_dict(), str(tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    assert convert("ckpt", "--to-single-file", "model.pt") == 0
    namespace: dict = {}
    exec(recipe, namespace)
    loaded = namespace["model"]
    assert loaded.output.weight is loaded.tok_embeddings.weight
    for name, value in model.state_dict().items():
        assert loaded.state_dict()[name].device.type == "cpu", name
        assert torch.equal(loaded.state_dict()[name], value), name
