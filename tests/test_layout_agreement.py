"""Every reader of a layout rule agrees with `lab.layout` and with the rule as the course states it (issue 35).

A grid of model shapes and layouts goes through each reader: `Config` validation, the calculators (`lab.calc`
sharding, memory, moe, schedules, the CLI), the widgets' messages, the JAX track, and the model itself, built on
the `meta` device and sharded by `lab.parallel` under torch's fake process group (no rank started, nothing
allocated). Each must accept and refuse the same layouts, with the same one-line message, and give the same
numbers: KV heads and experts per rank, an expert's capacity, the parameters a rank holds, the micro-batch.
The rules are also written out here, once, as the specification the readers are held to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from lab import layout
from lab.calc import bubble, schedules, sharding
from lab.calc import moe as calc_moe
from lab.calc.cli import main as calc_main
from lab.calc.memory import estimate_memory, stage_params
from lab.config import PRESETS, Config, ModelConfig, ParallelConfig, TrainConfig
from lab.distributed import mesh
from lab.model import MoE, build_model
from lab.parallel.ep import apply_expert_parallel
from lab.parallel.tp import apply_tensor_parallel

TPS = (1, 2, 3, 4, 6, 8)
HEADS = {4: (1, 2, 4), 6: (1, 2, 3, 6), 8: (1, 2, 4, 8), 12: (1, 3, 4, 12)}  # n_heads -> n_kv_heads
WIDTHS = ((96, 192), (128, 256), (96, 200))  # (d_ff, vocab_size): each rule alone refuses some tp
EPS = (1, 2, 3, 4, 6, 8)
EXPERTS = (2, 3, 4, 6, 8)


def tp_allowed(tp: int, cfg: ModelConfig) -> bool:
    """The rule: tp splits the heads, the FFN width and the vocabulary; it divides the KV heads or is a multiple."""
    kv = cfg.n_kv_heads % tp == 0 or tp % cfg.n_kv_heads == 0
    return kv and all(size % tp == 0 for size in (cfg.n_heads, cfg.d_ff, cfg.vocab_size))


def error(call, *args, **kwargs) -> str | None:
    """The one-line message `call(*args, **kwargs)` raises, or None when it accepts."""
    try:
        call(*args, **kwargs)
    except ValueError as err:
        return str(err)
    return None


@contextlib.contextmanager
def fake_group(world_size: int):
    """This process as rank 0 of `world_size` under torch's fake backend: groups exist, nothing is sent."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group("fake", rank=0, world_size=world_size, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def tp_shapes():
    for n_heads, kvs in HEADS.items():
        for n_kv_heads in kvs:
            for d_ff, vocab in WIDTHS:
                yield ModelConfig(name="grid", d_model=8 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff,
                                  vocab_size=vocab, n_layers=1)


@pytest.mark.parametrize("tp", TPS)
def test_tensor_parallel_readers_agree(tp, monkeypatch):
    from lab.widgets.tp import _fits

    disagreements = []
    with fake_group(tp) as group:
        for cfg in tp_shapes():
            monkeypatch.setitem(PRESETS, "grid", cfg)
            shape = f"tp={tp} n_heads={cfg.n_heads} n_kv_heads={cfg.n_kv_heads} d_ff={cfg.d_ff} vocab={cfg.vocab_size}"
            message = layout.tp_problem(tp, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size)
            model = build_model(cfg)
            said = {"lab.layout": message,
                    "Config": error(Config(cfg, ParallelConfig(tp=tp), TrainConfig()).validate),
                    "lab.parallel.tp": error(apply_tensor_parallel, model, group),
                    "lab.widgets.tp": (w := _fits("grid", tp)) and w.replace(" of grid", "")}
            kv_rule = cfg.n_kv_heads % tp == 0 or tp % cfg.n_kv_heads == 0
            calc_kv = error(sharding.kv_weight_bytes, cfg.d_model, cfg.n_kv_heads, cfg.head_dim, tp)
            if (message is None) != tp_allowed(tp, cfg) or set(said.values()) != {message}:
                disagreements.append(f"{shape}: {said}")
            if (calc_kv is None) != kv_rule:
                disagreements.append(f"{shape}: lab.calc.sharding says {calc_kv!r}")
            if message is not None:
                continue
            # the numbers of an accepted layout: KV heads per rank and the parameters a rank holds
            kv_built = model.layers["0"].attn.wk.weight.shape[0] // cfg.head_dim
            kv_bytes = sharding.kv_weight_bytes(cfg.d_model, cfg.n_kv_heads, cfg.head_dim, tp, bytes_per_value=1)
            kv_heads = {"lab.layout": layout.kv_heads_per_rank(cfg.n_kv_heads, tp), "built model": kv_built,
                        "lab.calc.sharding": kv_bytes // (2 * cfg.d_model * cfg.head_dim),
                        "rule": max(cfg.n_kv_heads // tp, 1)}
            params = {"built model": sum(p.numel() for p in model.parameters()),
                      "lab.calc.memory": stage_params(cfg, ParallelConfig(tp=tp), 0)[0]}
            for what, values in (("KV heads per rank", kv_heads), ("parameters per rank", params)):
                if len(set(values.values())) != 1:
                    disagreements.append(f"{shape}: {what} {values}")
    assert not disagreements, "\n".join(disagreements)


MOE = ModelConfig(name="grid-moe", d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=64, n_layers=2,
                  n_experts=2, top_k=2, d_ff_expert=8, n_dense_layers=1)


@pytest.mark.parametrize("ep", EPS)
def test_expert_parallel_readers_agree(ep):
    disagreements = []
    with fake_group(ep) as group:
        for n_experts in EXPERTS:
            cfg = dataclasses.replace(MOE, n_experts=n_experts)
            shape = f"ep={ep} n_experts={n_experts}"
            message = error(layout.experts_per_rank, n_experts, ep)
            model = build_model(cfg)
            said = {"lab.layout": message,
                    "Config": error(Config(cfg, ParallelConfig(dp=ep, ep=ep), TrainConfig(global_batch=24)).validate),
                    "lab.parallel.ep": error(apply_expert_parallel, model, group),
                    "lab.calc.moe rows": error(calc_moe.rows_per_expert, 64, 2, n_experts, ep),
                    "lab.calc.moe bytes": error(calc_moe.expert_bytes_per_gpu, 1, n_experts, 16, 8, ep, 2)}
            if (message is None) != (n_experts % ep == 0) or set(said.values()) != {message}:
                disagreements.append(f"{shape}: {said}")
            if message is not None:
                continue
            per_rank = {"rule": n_experts // ep, "lab.layout": layout.experts_per_rank(n_experts, ep),
                        "built model": len(model.layers["1"].ffn.experts),
                        "lab.calc.moe": calc_moe.expert_bytes_per_gpu(1, n_experts, 16, 8, ep, 1) // (3 * 16 * 8)}
            expert_params = {"built model": sum(p.numel() for p in model.layers["1"].ffn.experts.parameters()),
                             "lab.calc.memory": stage_params(cfg, ParallelConfig(dp=ep, ep=ep), 0)[1]}
            for what, values in (("experts per rank", per_rank), ("expert parameters per rank", expert_params)):
                if len(set(values.values())) != 1:
                    disagreements.append(f"{shape}: {what} {values}")
    assert not disagreements, "\n".join(disagreements)


CAPACITY_GRID = [(tokens, top_k, n_experts, c) for tokens in (1, 7, 64, 1000) for top_k in (1, 2, 3)
                 for n_experts in (3, 8) for c in (0.5, 1.0, 1.1, 1.25, 2.0, 3.3)]


def test_capacity_is_one_formula_everywhere():
    """The model keeps C assignments of one overloaded expert, calc.moe drops the rest, the widget and the JAX
    track size their buffers by C; C is ceil(c·tokens·top_k/n_experts) exactly wherever c is a binary fraction."""
    jax_moe = pytest.importorskip("lab.jaxtrack.moe")
    disagreements = []
    for tokens, top_k, n_experts, c in CAPACITY_GRID:
        capacity = layout.expert_capacity(tokens, top_k, n_experts, c)
        assignments = tokens * top_k
        cfg = dataclasses.replace(MOE, n_experts=n_experts, top_k=top_k, capacity_factor=c)
        moe = MoE(cfg, layer=1).train()
        kept = int(moe.capacity_mask(torch.zeros(tokens, top_k, dtype=torch.long)).sum())  # all want expert 0
        dropped = calc_moe.dropped_assignments(tokens, top_k, n_experts, c, hot_share=1.0)
        seen = {"lab.layout": min(capacity, assignments), "lab.model": kept, "lab.calc.moe": assignments - dropped,
                "lab.jaxtrack": min(jax_moe.capacity_of(tokens, top_k, n_experts, c), assignments)}
        if Fraction(c).denominator in (1, 2, 4):  # exact in binary: the formula has one answer
            seen["rule"] = min(math.ceil(Fraction(c) * assignments / n_experts), assignments)
        if len(set(seen.values())) != 1:
            disagreements.append(f"tokens={tokens} top_k={top_k} n_experts={n_experts} c={c}: {seen}")
    assert not disagreements, "\n".join(disagreements)


@pytest.mark.parametrize(("tokens", "top_k", "n_experts", "c"), [(1000, 2, 8, 1.1), (64, 1, 3, 1.25), (7, 3, 8, 0.5)])
def test_the_capacity_widget_shows_the_layout_capacity(tokens, top_k, n_experts, c):
    from lab.widgets.moe import route_tokens

    assert route_tokens(tokens, n_experts, top_k, c).capacity == layout.expert_capacity(tokens, top_k, n_experts, c)


def test_pipeline_sequence_and_batch_rules_agree():
    """Config against the rules as stated, against calc.schedules' layer split and calc.memory's checks."""
    disagreements = []
    cfg = ModelConfig(name="grid", d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, n_layers=6,
                      max_seq_len=64)
    for pp, schedule, chunks, grad_accum in itertools.product((1, 2, 3, 4), ("1f1b", "interleaved"), (0, 1, 2, 3),
                                                              (1, 2, 4, 6)):
        stages = pp * layout.pp_chunks(schedule, chunks)
        p = ParallelConfig(pp=pp, pp_schedule=schedule, pp_virtual_stages=chunks, grad_accum=grad_accum)
        said = error(Config(cfg, p, TrainConfig(global_batch=12)).validate)
        v = p.pp_virtual_stages
        interleaved_ok = v >= 2 and grad_accum % pp == 0  # rounds of pp micro-batches over the chunks
        schedule_ok = pp == 1 or (interleaved_ok if schedule == "interleaved" else v == 1)
        rule = cfg.n_layers % stages == 0 and schedule_ok and 12 % grad_accum == 0
        split = error(schedules.rank_layers, cfg.n_layers, pp, v)
        if (said is None) != rule or (split is None) != (cfg.n_layers % stages == 0):
            disagreements.append(f"pp={pp} {schedule} chunks={chunks}->{v} grad_accum={grad_accum}: Config {said!r}, "
                                 f"calc.schedules {split!r}")
    for seq, cp, impl, tp, sp in itertools.product((24, 30, 32), (1, 2, 3, 4), ("ring", "zigzag"), (1, 2),
                                                   (False, True)):
        if sp and tp == 1:
            continue
        p = ParallelConfig(cp=cp, cp_impl=impl, tp=tp, sp=sp)
        said = error(Config(cfg, p, TrainConfig(seq_len=seq)).validate)
        chunks = 2 * cp if impl == "zigzag" and cp > 1 else cp
        rule = seq % chunks == 0 and (not sp or (seq // cp) % tp == 0)
        memory = error(estimate_memory, cfg, seq, 1, p)
        if (said is None) != rule or (memory is None) != rule:
            disagreements.append(f"seq={seq} cp={cp} {impl} tp={tp} sp={sp}: Config {said!r}, calc.memory {memory!r}")
    for batch, dp, grad_accum in itertools.product((6, 8, 12), (1, 2, 3, 4), (1, 2, 3)):
        config = Config(cfg, ParallelConfig(dp=dp, grad_accum=grad_accum), TrainConfig(global_batch=batch))
        said = error(config.validate)
        if (said is None) != (batch % (dp * grad_accum) == 0):
            disagreements.append(f"global_batch={batch} dp={dp} grad_accum={grad_accum}: Config {said!r}")
        elif said is None and layout.micro_batch(batch, dp, grad_accum) * dp * grad_accum != batch:
            disagreements.append(f"global_batch={batch} dp={dp} grad_accum={grad_accum}: micro_batch")
    assert not disagreements, "\n".join(disagreements)


def test_uneven_pipeline_splits_agree():
    """One split rule (`layout.stage_layers`) behind Config, calc.schedules' layers, calc.memory's stage parameters
    and the executor's cut: each accepts the same splits, and each stage holds the layers the rule gives it."""
    from lab.parallel.pp import cut_to_stage

    disagreements = []
    cfg = ModelConfig(name="grid", d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, n_layers=10,
                      max_seq_len=64)
    block = stage_params(cfg, ParallelConfig(pp=10, grad_accum=10), 1)[0]  # one layer, on a middle stage
    for pp, chunks, split in itertools.product((1, 2, 3, 4), (1, 2), ("even", "llama3", "4,6", "2,3,3,2", "1,9,0")):
        layout_ = {"pp": pp, "pp_schedule": "interleaved" if chunks > 1 else "1f1b", "pp_virtual_stages": chunks,
                   "grad_accum": pp, "pp_layers": split}
        rule = error(layout.stage_layers, cfg.n_layers, pp * chunks, split)
        said = error(lambda p=layout_: Config(cfg, ParallelConfig(**p), TrainConfig(global_batch=p["pp"])).validate())
        split_ranks = error(schedules.rank_layers, cfg.n_layers, pp, chunks, split)
        if (said is None) != (rule is None) or (split_ranks is None) != (rule is None):
            disagreements.append(f"pp={pp} chunks={chunks} {split}: rule {rule!r}, Config {said!r}, "
                                 f"calc.schedules {split_ranks!r}")
        if rule is not None or said is not None:
            continue
        counts = layout.stage_layers(cfg.n_layers, pp * chunks, split)
        for rank, layers in enumerate(schedules.rank_layers(cfg.n_layers, pp, chunks, split)):
            stages = [schedules.virtual_stage_of(rank, c, pp) for c in range(chunks)]
            own = sum(counts[s] for s in stages)
            built = sum(len(cut_to_stage(build_model(cfg), s, pp * chunks, split).layers) for s in stages)
            costed = stage_params(cfg, ParallelConfig(**layout_), rank)[0]
            if len(layers) != own or built != own or (0 < rank < pp - 1 and costed != own * block):
                disagreements.append(f"pp={pp} chunks={chunks} {split} rank {rank}: rule {own}, calc.schedules "
                                     f"{len(layers)}, built {built}, calc.memory {costed / block}")
    assert not disagreements, "\n".join(disagreements)


def test_the_interleaved_default_is_resolved_once_and_the_cli_and_config_agree():
    """`Config.from_dict` accepts an interleaved layout without chunks, as `lab calc memory` and `lab train` do."""
    config = Config.from_dict({"model": {"preset": "tiny"}, "parallel": {"pp": 2, "pp_schedule": "interleaved",
                                                                         "grad_accum": 2}})
    assert config.parallel.pp_virtual_stages == layout.INTERLEAVED_CHUNKS == 2
    assert bubble.explore("interleaved", 2, 4).schedule.chunks == 2  # the simulator's default
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = calc_main(["memory", "--model", "tiny", "--seq", "32", "--pp", "2", "--pp-schedule", "interleaved",
                          "--grad-accum", "2"])
    assert code == 0 and out.getvalue().splitlines()[1].startswith(layout.describe(config.parallel) + ";")
    assert layout.describe(config.parallel) == "pp=2, pp_schedule=interleaved, pp_chunks=2"
    assert layout.describe(ParallelConfig()) == "one rank"


def test_the_mesh_lays_ranks_out_by_the_layout_strides():
    for dp, pp, cp, tp in [(2, 1, 1, 4), (2, 2, 2, 1), (1, 3, 2, 2), (2, 2, 1, 2)]:
        world, stride = dp * pp * cp * tp, layout.strides(dp, pp, cp, tp)
        grid = mesh.layout(world, dp, pp, cp, tp)
        for index in itertools.product(range(dp), range(pp), range(cp), range(tp)):
            assert grid[index] == sum(i * stride[a] for i, a in zip(index, layout.AXES, strict=True))
        for axis, size in zip(layout.AXES, (dp, pp, cp, tp), strict=True):
            first = mesh.axis_groups(world, axis, dp, pp, cp, tp)[0]
            assert first == [i * stride[axis] for i in range(size)], (axis, first)
