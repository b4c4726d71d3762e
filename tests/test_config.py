"""Config loading, overrides and one-line validation errors."""

import pytest

from lab.config import PRESETS, Config, ModelConfig, ParallelConfig, TrainConfig, load_config, save_config


def test_tiny_configs_load_and_round_trip(tmp_path):
    for name in ("tiny", "tiny-moe"):
        config = load_config(f"configs/{name}.toml")
        assert config.model == PRESETS[name]
        save_config(config, tmp_path / "c.toml")
        assert load_config(tmp_path / "c.toml") == config


def test_overrides_take_toml_values():
    config = load_config("configs/tiny.toml", ["train.steps=7", "parallel.recompute=full", "train.lr=0.01",
                                               "parallel.sp=false"])
    assert (config.train.steps, config.parallel.recompute, config.train.lr) == (7, "full", 0.01)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=3"], "tp=3 must divide n_heads=4"),
    (["parallel.dp=-2"], "dp=-2 must be an integer >= 1"),
    (["train.steps=0"], "steps=0 must be an integer >= 1"),
    (["parallel.dp=3"], "dp*grad_accum = 3*1 = 3 must divide global_batch=8"),
    (["parallel.pp=3"], "must divide n_layers=8"),
    (["parallel.cp=3"], "seq_len=32 must be divisible by 2*cp = 6 for cp_impl='zigzag'"),
    (["parallel.cp=2", "train.seq_len=30"], "seq_len=30 must be divisible by 2*cp = 4 for cp_impl='zigzag'"),
    (["parallel.cp=3", "parallel.cp_impl='ring'"], "seq_len=32 must be divisible by cp=3"),
    (["parallel.cp_impl='stripes'"], "cp_impl='stripes' must be one of 'ring', 'zigzag', 'ulysses'"),
    (["parallel.ep=2"], "ep=2 must divide dp*cp = 1*1 = 1"),
    (["parallel.sp=true"], "sp=True needs tp > 1"),
    (["parallel.zero=4"], "zero=4 must be one of 0, 1, 2, 3"),
    (["parallel.recompute='some'"], "recompute='some' must be one of 'none', 'selective', 'full'"),
    (["model.preset='gpt-17'"], "unknown model preset 'gpt-17'; valid presets: tiny, tiny-moe"),
    (["model.n_kv_heads=3"], "n_kv_heads=3 must divide n_heads=4"),
    (["model.colour=1"], "unknown field model.colour"),
    (["train.steps='ten'"], "train.steps='ten' must be of type int"),
    (["train.seq_len=512"], "seq_len=512 must be <= max_seq_len=256"),
    (["steps=3"], "must look like section.field=value"),
    (["optim.lr=1"], "unknown config section(s) ['optim']"),
    (["train.warmup_steps=21"], "warmup_steps=21 must be between 0 and steps=20"),
    (["train.steps=1"], "warmup_steps=2 must be between 0 and steps=1"),
])
def test_invalid_configs_fail_with_one_clear_line(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config("configs/tiny.toml", overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_warm_up_as_long_as_the_run_is_accepted():
    """The boundary of the rule above: the peak learning rate is reached at the last step (benchmarks do this)."""
    assert load_config("configs/tiny.toml", ["train.warmup_steps=20"]).train.warmup_steps == 20


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_config(bad)


def test_expert_parallel_needs_experts_that_divide():
    config = Config(ModelConfig.from_preset("tiny"), ParallelConfig(dp=2, ep=2), TrainConfig())
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model"):
        config.validate()
    Config(ModelConfig.from_preset("tiny-moe"), ParallelConfig(dp=2, ep=2), TrainConfig()).validate()


def test_tiny_shapes_divide_every_degree_the_chapters_use():
    for name in ("tiny", "tiny-moe"):
        for tp in (1, 2):
            for pp in (1, 2, 4):
                for cp in (1, 2, 4):
                    Config(ModelConfig.from_preset(name), ParallelConfig(tp=tp, pp=pp, cp=cp), TrainConfig()).validate()
    Config(ModelConfig.from_preset("tiny-moe"), ParallelConfig(dp=4, ep=4), TrainConfig()).validate()


@pytest.mark.parametrize("overrides, message", [
    (["model.moe_gate_norm='softmax'"], "moe_gate_norm='softmax' must be one of 'auto', 'none', 'topk'"),
    (["model.moe_gate_norm='topk'", "model.top_k=1"], "moe_gate_norm='topk' with top_k=1 makes every gate 1"),
    (["model.moe_route_scale=0"], "moe_route_scale=0.0 must be a number > 0"),
    (["model.moe_gating='relu'"], "moe_gating='relu' must be one of 'softmax', 'sigmoid'"),
])
def test_invalid_moe_gates_fail_with_one_clear_line(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config("configs/tiny-moe.toml", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_gate_norm_overrides_and_the_top1_default():
    assert load_config("configs/tiny-moe.toml").model.renormalizes_gates  # top-2: GShard, Mixtral
    assert not load_config("configs/tiny-moe.toml", ["model.top_k=1"]).model.renormalizes_gates  # Switch
    assert not load_config("configs/tiny-moe.toml", ["model.moe_gate_norm='none'"]).model.renormalizes_gates


def test_preset_is_listed_among_the_valid_model_fields():
    """`--set model.preset=...` works, so the message for an unknown model field lists it (issue 14, item 12)."""
    assert load_config("configs/tiny.toml", ["model.preset='tiny-moe'"]).model == PRESETS["tiny-moe"]
    with pytest.raises(ValueError, match=r"unknown field model\.colour; valid fields: .*\bpreset\b"):
        load_config("configs/tiny.toml", ["model.colour=1"])
    with pytest.raises(ValueError, match=r"unknown field train\.colour; valid fields: (?!.*preset)"):
        load_config("configs/tiny.toml", ["train.colour=1"])


@pytest.mark.parametrize("impl", ["zigzag", "ring", "ulysses"])
def test_an_odd_sequence_loads_without_context_parallelism(impl):
    # the zig-zag split into 2*cp chunks applies only when there is a cp > 1 to split over (issue 13)
    cfg = load_config(None, ["train.seq_len=37", f"parallel.cp_impl='{impl}'"])
    assert cfg.train.seq_len == 37 and cfg.parallel.cp == 1
