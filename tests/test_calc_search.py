"""lab.calc.search: the playbook's 3-step config search. Its rankings against the published ones (the playbook's
single-node table, TorchTitan's recipes), the playbook's benchmark lessons, and what every proposal must satisfy."""

import time

import pytest

from lab.calc.memory import estimate_memory
from lab.calc.search import drain_exposed, fullest_stage, search
from lab.config import ModelConfig, ParallelConfig, check_supported

# lab's pipeline needs untied embeddings (check_supported): the playbook's 1B-class model is taken untied. Llama 3
# 405B is taken with 128 layers, as the calibration's TorchTitan rows take it, so that these tests keep the even
# split they were written for; its real 126 layers run on Llama 3's uneven split (tests/test_calc_validation.py).
ONE_B = ModelConfig.from_preset("llama3-1b", tie_embeddings=False)
LLAMA_405B = ModelConfig.from_preset("llama3-405b", n_layers=128)


_RESULTS: dict = {}


def _search(model, gpus: int, seq: int, tokens: int, **fixed):
    """search() on nodes of 8 H100, once per set of arguments in this module."""
    key = (repr(model), gpus, seq, tokens, tuple(sorted(fixed.items())))
    if key not in _RESULTS:
        _RESULTS[key] = search(model, gpus, 8, "h100", seq, tokens, fixed=fixed)
    return _RESULTS[key]


def best_of(result, family: str):
    """(rank, candidate) of the fastest layout of a family, e.g. 'dp4·pp2'."""
    return next((i, c) for i, c in enumerate(result.candidates) if c.family == family)


# --- the playbook's single-node ranking ---------------------------------------------------------------------

def test_single_node_ranking_of_the_playbook_1b_model():
    """The playbook, "Finding the best training configuration", benchmark on 1 node of 8 H100, seq 4096, GBS 256 x 4096:
    DP8 (39 % MFU, 40,150 tok/s/GPU) and DP4·PP2 / DP2·PP4 with ZeRO-1 (44 %, 42 %) lead; TP8 (27 % at MBS16,
    6.7 % at MBS1) and PP8 (0.6 %) trail far behind. Checked qualitatively: the DP and DP x PP layouts on top,
    TP8 with MBS1 and pure PP8 at the bottom."""
    result = _search(ONE_B, 8, 4096, 2**20)
    ranking = result.candidates
    assert ranking[0].family == "dp8" and ranking[0].parallel.tp == ranking[0].parallel.pp == 1
    best = ranking[0].tokens_per_s
    dp_pp = [best_of(result, f) for f in ("dp4·pp2", "dp2·pp4")]
    tp8 = [(i, c) for i, c in enumerate(ranking) if c.family == "dp1·tp8"]
    tp8_mbs1 = min(i for i, c in tp8 if c.mbs == 1)
    tp8_mbs16 = min(i for i, c in tp8 if c.mbs == 16)
    pp8 = best_of(result, "dp1·pp8")[0]
    for rank, candidate in dp_pp:  # close behind the best, ahead of every TP8 and PP8 layout
        assert candidate.tokens_per_s > 0.6 * best and rank < min(tp8_mbs16, pp8)
    assert dp_pp[0][0] < dp_pp[1][0]  # DP4·PP2 ahead of DP2·PP4, as in the table
    assert tp8_mbs16 < tp8_mbs1  # a larger micro-batch amortises TP's per-collective latency
    bottom = len(ranking) * 0.85  # the last 15 % of the layouts that fit
    assert tp8_mbs1 > bottom and pp8 > bottom, (tp8_mbs1, pp8, len(ranking))
    assert ranking[pp8].tokens_per_s < 0.5 * best


# --- TorchTitan's recipes -----------------------------------------------------------------------------------

def test_torchtitan_8b_at_128_gpus_is_fsdp():
    """TorchTitan's benchmark (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, T3): Llama 3.1
    8B on 128 H100, seq 8192, global batch 256, FSDP with local batch 2. The search's first choice is FSDP over the
    128 GPUs, its local batch in two micro-batches of one: lab.model keeps its activations in fp32, so one
    micro-batch of two fits 80 GiB only with full recomputation (TorchTitan's op-level SAC keeps half)."""
    result = _search("llama3-8b", 128, 8192, 256 * 8192)
    top = result.candidates[0]
    assert (top.family, top.parallel.zero, top.mbs, top.grad_accum) == ("dp128", 3, 1, 2)
    recipe = next(c for c in result.candidates if (c.family, c.parallel.zero, c.mbs) == ("dp128", 3, 2))
    assert recipe.parallel.recompute == "full"


# Where a recipe lands: its best layout's rank and its share of the best tokens/s. TorchTitan's 2D and 3D recipes
# predate its context parallelism (the paper: CP is "ongoing work"), so cp is pinned to 1 for them. The calibrated
# model prices TP8's collectives at what T4 measured (tests/test_calc_validation.py), which layouts without TP
# or with a deeper pipeline do not pay: the recipes are not in its top 10 (chapter 08, section 5d, says why).
RECIPES = [  # model, GPUs, global batch (sequences of 8192), the recipe's family, rank below, share above; T4, T5
    ("llama3-70b", 256, 512, "dp32·tp8", 60, 0.7),
    (LLAMA_405B, 512, 256, "dp8·tp8·pp8", 25, 0.75),
]


@pytest.mark.parametrize("model, gpus, batch, family, below, share", RECIPES, ids=["70b-fsdp32-tp8",
                                                                                   "405b-fsdp8-tp8-pp8"])
def test_torchtitan_recipes_are_near_the_top(model, gpus, batch, family, below, share):
    result = _search(model, gpus, 8192, batch * 8192, cp=1)
    rank, recipe = best_of(result, family)
    assert rank < below and recipe.tokens_per_s >= share * result.candidates[0].tokens_per_s, (rank, recipe.layout)


def test_torchtitan_70b_fsdp32_tp8_is_within_30_percent():
    """T4: 70B on 256 GPUs as FSDP 32 x TP 8. The calibrated model puts the family within 30 % of its best, which
    has no TP: the difference is TP's exposed collectives, a third of the recipe's compute time or more."""
    result = _search("llama3-70b", 256, 8192, 512 * 8192, cp=1)
    rank, recipe = best_of(result, "dp32·tp8")
    best = result.candidates[0]
    assert recipe.parallel.sp and best.parallel.tp < 8
    assert recipe.tokens_per_s >= 0.7 * best.tokens_per_s and recipe.time.tp > 0.3 * recipe.time.compute


def test_tp_overlap_and_cp_exposure_move_the_70b_ranking():
    """The default model leaves async TP out (lab.train runs none), so for 70B at 8K on 256 GPUs TorchTitan's
    FSDP32 x TP8 with ZeRO-3 (T4) ranks far down. Hiding TP's collectives (`tp_overlap`) raises the recipe,
    exposing the whole ring (`cp_exposed`) lowers dp32·CP8."""
    def ranks(**overlap):
        result = search("llama3-70b", 256, 8, "h100", 8192, 2**22, **overlap)
        titan = next(i for i, c in enumerate(result.candidates) if c.family == "dp32·tp8" and c.parallel.zero == 3)
        cp8 = next(i for i, c in enumerate(result.candidates) if c.family == "dp32·cp8")
        return titan, cp8

    titan, cp8 = ranks()
    assert titan > 50
    assert ranks(tp_overlap=0.8)[0] < titan
    assert ranks(cp_exposed=1.0)[1] > cp8
    with pytest.raises(ValueError, match=r"tp_overlap=1.5 must be in \[0, 1\]"):
        search("llama3-8b", 8, tp_overlap=1.5)


def test_torchtitan_405b_is_among_the_best_pipelines_and_interleaving_beats_1f1b():
    """T5: 405B on 512 GPUs as FSDP 8 x TP 8 x PP 8 with full activation checkpointing; interleaved 1F1B ran 28 %
    faster than 1F1B (100 -> 128 tok/s/GPU). In the model FSDP x TP without a pipeline ranks higher (ZeRO-3's
    gathers hide behind a 405B layer: the overlap ratio is ~0.1 at dp 256), but among pipelined layouts the recipe is
    within 2 % of the best, needs full recomputation to fit, as TorchTitan ran it, and ZeRO-1 (lab runs no
    ZeRO-2/3 with pp), and interleaving shrinks its bubble and wins."""
    result = _search(LLAMA_405B, 512, 8192, 256 * 8192, cp=1)
    best_pipeline = next(c for c in result.candidates if c.parallel.pp > 1)
    _, recipe = best_of(result, "dp8·tp8·pp8")
    assert recipe.tokens_per_s >= 0.95 * best_pipeline.tokens_per_s
    assert best_pipeline.parallel.recompute == "full"
    assert (recipe.parallel.recompute, recipe.parallel.zero, recipe.parallel.pp_schedule) == ("full", 1, "interleaved")
    pinned = {"dp": 8, "tp": 8, "pp": 8, "recompute": "full", "mbs": 1}
    interleaved = _search(LLAMA_405B, 512, 8192, 256 * 8192, pp_schedule="interleaved", **pinned).candidates[0]
    one_f_one_b = _search(LLAMA_405B, 512, 8192, 256 * 8192, pp_schedule="1f1b", **pinned).candidates[0]
    assert interleaved.time.bubble == pytest.approx(one_f_one_b.time.bubble / 2, rel=0.05)  # (p-1)/(v·m), v = 2
    assert interleaved.tokens_per_s > 1.05 * one_f_one_b.tokens_per_s


# --- the playbook's benchmark lessons ----------------------------------------------------------------------

NODES = (1, 8, 64)


def _best_mfu(model, nodes: int) -> float:
    result = _search(model, 8 * nodes, 4096, 2**20)
    return result.candidates[0].mfu if result.candidates else 0.0


def test_efficiency_falls_with_node_count_especially_for_small_models():
    """The playbook, ch. 3 benchmark (1-64 nodes of 8 H100, seq 4096, GBS 1M tokens), finding 1: efficiency falls
    as nodes are added, most for small models, because the fixed batch leaves each GPU fewer tokens to hide the
    same gradient traffic behind."""
    drops = {}
    for model in (ONE_B, "llama3-8b"):
        mfus = [_best_mfu(model, n) for n in NODES]
        assert all(a >= b - 0.005 for a, b in zip(mfus, mfus[1:], strict=False)), (model, mfus)
        assert mfus[-1] < mfus[0]
        drops[model if isinstance(model, str) else "1b"] = mfus[-1] / mfus[0]
    assert drops["1b"] < drops["llama3-8b"] < 0.95, drops


def test_large_models_do_not_fit_on_few_nodes():
    """Finding 2: large models do not fit on few nodes (the heatmap's blank corner), or fit only near the memory
    limit and run inefficiently (its 80B on 4 nodes). 70B: nothing fits on one node; on two the best layout
    needs full recomputation and > 90 % of the memory, and runs 10 % below its four-node best."""
    one = _search("llama3-70b", 8, 4096, 2**20)
    assert one.candidates == [] and one.rejected_by_reason()["memory"] > 0
    two = _search("llama3-70b", 16, 4096, 2**20).candidates[0]
    assert two.parallel.recompute == "full" and two.memory.per_gpu["total"] > 0.9 * 80 * 2**30
    assert two.mfu <= _best_mfu("llama3-70b", 4)


# --- what every proposal satisfies ------------------------------------------------------------------------

CASES = [(ONE_B, 8, 4096, 2**20), ("llama3-1b", 8, 4096, 2**20), ("llama3-70b", 256, 8192, 2**22),
         ("mixtral-8x7b", 32, 4096, 2**21)]


@pytest.mark.parametrize("case", CASES, ids=["1b-untied", "1b-tied", "70b", "mixtral"])
def test_every_proposal_runs_fits_and_splits_the_batch(case):
    """Each candidate passes Config.validate and check_supported (what lab.train refuses), fits the GPU, and
    splits exactly the global batch: dp x mbs x grad_accum sequences."""
    model, gpus, seq, tokens = case
    result = _search(model, gpus, seq, tokens)
    assert result.candidates
    for c in result.candidates:
        config = c.config(result.model, seq)
        config.validate()
        check_supported(config)
        p = c.parallel
        assert p.world_size == gpus and p.tp <= 8
        assert p.dp * c.mbs * c.grad_accum == result.global_batch
        assert c.memory.per_gpu["total"] <= 80 * 2**30
        assert c.time.total == pytest.approx(c.time.compute + c.time.comms + c.time.bubble)
        assert (c.time.bubble > 0) == (p.pp > 1) and (c.time.tp > 0) == (p.tp > 1)
        assert 0 < c.mfu <= result.efficiency
    speeds = [c.tokens_per_s for c in result.candidates]
    assert speeds == sorted(speeds, reverse=True)
    if result.model.is_moe:
        assert any(c.parallel.ep > 1 and c.time.ep > 0 for c in result.candidates)


def test_rejections_are_counted_per_family_with_a_reason():
    result = _search("llama3-1b", 8, 4096, 2**20)  # tied embeddings: lab.train pipelines none of them
    families = result.rejected_families()
    assert "dp4·pp2" in families and not any(c.parallel.pp > 1 for c in result.candidates)
    reason, message = families["dp4·pp2"].main_reason()
    assert reason == "unsupported" and "pp with tied embeddings" in message
    assert families["dp4·pp2"].total == 3 * 4 * 2  # (zero 0-3) x (1f1b, interleaved, zb-h1) x (none, full)
    none = _search("llama3-70b", 8, 4096, 2**20).rejected_families()
    assert none["dp8"].main_reason()[0] == "memory" and "GiB per GPU > 80 GiB" in none["dp8"].main_reason()[1]


def test_the_global_batch_is_rounded_to_whole_sequences():
    """4e6 tokens of 8192 are 488.28 sequences: 488 = 8 x 61, which dp8 splits and dp16, 32, 64 do not."""
    result = search("llama3-8b", 64, 8, "h100", 8192, 4_000_000, fixed={"cp": 1, "pp": 1})
    assert result.global_batch == 488 and result.tokens_per_step == 488 * 8192
    assert {c.family for c in result.candidates} == {"dp8·tp8"}
    for family in ("dp64", "dp32·tp2", "dp16·tp4"):
        assert result.rejected_families()[family].main_reason() == (
            "batch", f"the global batch of 488 sequences is not a multiple of dp={family[2:4]}")


@pytest.mark.parametrize("parallel", [
    ParallelConfig(dp=2, tp=2, sp=True, pp=4, grad_accum=8),
    ParallelConfig(dp=2, pp=8, pp_schedule="interleaved", pp_virtual_stages=2, grad_accum=16, zero=1),
    ParallelConfig(dp=4, pp=4, pp_schedule="zb-h1", grad_accum=4),
    ParallelConfig(dp=2, pp=2, cp=2, grad_accum=2, recompute="full"),
    ParallelConfig(dp=1, pp=16, grad_accum=32),
])
def test_fullest_stage_is_estimate_memory_over_every_stage(parallel):
    """The search looks at the first and last stage only; estimate_memory(stage=None) walks them all."""
    cfg = ONE_B if parallel.pp <= 8 else LLAMA_405B
    assert fullest_stage(cfg, 4096, 2, parallel) == estimate_memory(cfg, 4096, 2, parallel, precision="mixed",
                                                                    flash=True)


def test_groups_across_nodes_cost_more_than_inside_one():
    """Ranks are numbered TP, CP, PP, DP: dp2·tp8·pp2 on nodes of 8 sends the pipeline's activations from node
    to node (one 50 GB/s NIC per GPU), on nodes of 16 over NVLink (450 GB/s); TP stays inside a node either way."""
    def times(gpus_per_node: int):
        pins = {"dp": 2, "tp": 8, "pp": 2, "pp_schedule": "1f1b", "recompute": "full", "mbs": 1}
        return search(ONE_B, 32, gpus_per_node, "h100", 4096, 2**20, fixed=pins).candidates[0].time

    across, inside = times(8), times(16)
    assert across.pp > 5 * inside.pp > 0
    assert across.tp == pytest.approx(inside.tp)


def test_pins_and_bad_input_are_one_line_errors():
    pinned = _search("llama3-70b", 256, 8192, 2**22, tp=8, cp=1, pp=1)
    assert {c.family for c in pinned.candidates} == {"dp32·tp8"}
    for kwargs, message in [
        ({"gpus": 0}, "gpus=0 must be an integer >= 1"),
        ({"gpus": 12}, "gpus=12 must be a multiple of gpus_per_node=8"),
        ({"seq": 10**6}, "seq=1000000 must be <= max_seq_len=131072"),
        ({"global_batch_tokens": 100}, "global_batch_tokens=100 must be at least one sequence"),
        ({"hardware": "tpu-v5e"}, "system='tpu-v5e' must be one of"),
        ({"hardware": "gpu9000"}, "gpu='gpu9000' must be one of"),
        ({"efficiency": 0}, "efficiency=0 must be in (0, 1]"),
        ({"fixed": {"zero": 4}}, "zero=4 must be one of 0, 1, 2, 3"),
        ({"fixed": {"sp": True}}, "fixed['sp'] is not a setting the search can pin"),
        ({"fixed": {"recompute": "some"}}, "recompute='some' must be one of"),
    ]:
        args = {"gpus": 16, "seq": 4096, "global_batch_tokens": 2**20, **kwargs}
        with pytest.raises(ValueError) as info:
            search("llama3-8b", args.pop("gpus"), **args)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_512_gpus_search_in_seconds():
    """Kept fast: a ZeRO stage whose most frugal setting does not fit is not estimated further, pipelines are no
    deeper than n_layers/2, CP ranks keep >= 1024 tokens, the fullest stage comes from two estimates. CPU time,
    so that other processes on the machine do not count (about 1.5 s for this, the slowest case met)."""
    started = time.process_time()
    search(LLAMA_405B, 512, 8, "h100", 8192, 2**21)
    assert time.process_time() - started < 6


@pytest.mark.parametrize("seq", [256, 8192])
def test_zero3_gathers_hide_when_the_a3_ratio_is_below_1(seq):
    """The playbook's appendix "Math for Compute/Communication Overlap" (comms.zero3_overlap_ratio): a ZeRO-3
    all-gather hides behind the previous layer's forward when bytes_per_param·(dp-1)/dp·F / (2·tokens·B) <= 1. 8B
    on dp64 (8 nodes, multi-rail 400 GB/s per node): at 8192 tokens per micro-batch the ratio is 0.18 and next to
    nothing is exposed; at 256 it is 5.7 and the exposed gathers outlast the compute."""
    from lab.calc.comms import multi_rail_link, zero3_overlap_ratio
    from lab.calc.network import SYSTEMS

    result = search("llama3-8b", 64, 8, "h100", seq, 64 * seq, fixed={"dp": 64, "zero": 3, "mbs": 1,
                                                                      "recompute": "none"})
    step = result.candidates[0].time
    ratio = zero3_overlap_ratio(seq, 64, result.efficiency * 989.4e12, multi_rail_link(SYSTEMS["h100"], 8).bandwidth)
    if ratio < 1:  # what stays exposed: the first layer's gathers of each pass (FSDP2 prefetches one layer)
        assert ratio < 0.25 and step.dp < 0.02 * step.compute
    else:
        assert ratio > 5 and step.dp > step.compute


def test_proposals_build_under_the_dry_run():
    """Issue 16: every layout the search proposes must run under `lab.train --dry-run`: rank 0 of the best
    layouts (and the best with a pipeline, and with experts) is built on meta under a fake process group, and its
    static bytes equal calc.memory's. The dry run's groups follow the order the time model assumes: TP, CP, PP, DP."""
    from lab.dryrun import dry_run

    dense = _search("llama3-70b", 256, 8192, 2**22)
    moe = _search("mixtral-8x7b", 32, 4096, 2**21)
    layouts = [*dense.top(2), next(c for c in dense.candidates if c.parallel.pp > 1),
               next(c for c in moe.candidates if c.parallel.ep > 1)]
    for candidate, result in zip(layouts, (dense, dense, dense, moe), strict=True):
        run = dry_run(candidate.config(result.model, result.seq), 0)
        assert run.mismatches == [], (candidate.layout, run.measured, run.estimated)
        p = candidate.parallel
        assert run.groups["tp"] == list(range(p.tp))
        assert run.groups["cp"] == [i * p.tp for i in range(p.cp)]
        assert run.groups["pp"] == [i * p.tp * p.cp for i in range(p.pp)]


def test_gradient_reduction_hides_behind_the_cooldown_chunk_by_chunk():
    """One chunk: the reduction outlasts its own last backward by the difference. Four interleaved chunks whose
    gradients complete a second apart: each chunk's share hides behind the backward that follows, only the last
    one's outlasts the step; chunks completing close together queue on the network instead."""
    assert drain_exposed(3.0, 1, 0.0, 1.0) == 2.0 and drain_exposed(0.5, 1, 0.0, 1.0) == 0.0
    assert drain_exposed(2.0, 4, 1.0, 0.1) == pytest.approx(0.5 - 0.1)
    assert drain_exposed(4.0, 4, 0.1, 0.0) == pytest.approx(4.0 - 3 * 0.1)

