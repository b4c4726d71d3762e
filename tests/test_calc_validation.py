"""lab.calc.search's step-time model against what clusters measured (lab.calc.calibration.RUNS): TorchTitan's
Llama 3.1 benchmarks, Llama 3's Table 4, Megatron-LM 2021's Table 1 and lab's own H100 recording, each predicted
with the search pinned to its layout. Goal: throughput within 15 %, memory within 10 %; a run outside the goal says
why, and is held to its documented error, not a looser one. Then the ranking: where the recipes the field runs land
among the layouts the search keeps, and which layouts the calibration's spread cannot tell apart."""

import json

import pytest

from lab.calc import cli
from lab.calc.calibration import ASYNC_TP, CONSTANTS, RUNS, SPREAD, STACKS
from lab.calc.search import predict_run, predicted_over_measured, recipe_rank, search

THROUGHPUT_GOAL, MEMORY_GOAL = 0.15, 0.10
_PREDICTED: dict = {}


def _predicted(run):
    if run.name not in _PREDICTED:
        candidate = predict_run(run)
        _PREDICTED[run.name] = candidate, predicted_over_measured(run, candidate)
    return _PREDICTED[run.name]


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_throughput_within_the_goal_or_its_documented_error(run):
    """Each run inside the goal, or outside it by no more than the error its `why` explains (and by more than the
    goal: a row that came back inside must lose its excuse)."""
    candidate, (throughput, _) = _predicted(run)
    for key, value in run.pins.items():
        assert getattr(candidate.parallel, key, candidate.mbs if key == "mbs" else None) == value, (key, run.name)
    error = abs(throughput - 1)
    if run.goal_error is None:
        assert error <= THROUGHPUT_GOAL, (run.name, throughput)
    else:
        assert run.why and THROUGHPUT_GOAL < error <= run.goal_error, (run.name, throughput, run.goal_error)


@pytest.mark.parametrize("run", [r for r in RUNS if r.memory_gib], ids=[r.name for r in RUNS if r.memory_gib])
def test_memory_within_the_goal_or_its_documented_error(run):
    _, (_, memory) = _predicted(run)
    error = abs(memory - 1)
    if run.memory_error is None:
        assert error <= MEMORY_GOAL, (run.name, memory)
    else:
        assert run.why and MEMORY_GOAL < error <= run.memory_error, (run.name, memory, run.memory_error)


def test_every_constant_has_a_source_and_fits_name_their_rows():
    """One table: a source for every constant, a spread, and the fitted ones name validation rows that exist; the
    stacks the runs use are the table's."""
    names = {r.name for r in RUNS}
    for name, constant in CONSTANTS.items():
        assert len(constant.source) > 20 and constant.spread >= 0, name
        assert all(row in names for row in filter(None, constant.fitted_on.split(","))), name
    fitted = [n for n, c in CONSTANTS.items() if c.fitted_on]
    assert fitted == ["async_tp_overlap", "titan_clock"], fitted  # and the lab stack's traffic (STACKS["lab"])
    assert "fitted" in STACKS["lab"].source and {r.stack for r in RUNS} <= set(STACKS)
    assert set(SPREAD) == {"compute", "comms", "bubble"}


def test_fitted_constants_reproduce_the_rows_they_were_fitted_on():
    """A fit that no longer fits is a constant without a source: the clock reproduces its 8B run, async TP's overlap
    the gain TorchTitan's Table 4 measured from 2D to 2D + AsyncTP (829 -> 876 tokens/s/GPU), within 1 %."""
    runs = {r.name: r for r in RUNS}
    clock, _ = _predicted(runs["titan-8b-128gpu-compile"])[1]
    assert abs(clock - 1) <= 0.01, clock
    two_d, async_tp = (_predicted(runs[name])[0].tokens_per_s_per_gpu
                       for name in ("titan-70b-2d", "titan-70b-2d-asynctp"))
    assert abs(async_tp / two_d / (876 / 829) - 1) <= 0.01, async_tp / two_d


def test_llama3_405b_layout_on_126_layers_over_16_uneven_stages():
    """Llama 3's own layout (TP8 · PP16 · DP128, 126 layers: 7, 8 x 14, 7) is priced, not refused."""
    run = next(r for r in RUNS if r.name == "llama3-405b-16k-gpus")
    candidate, _ = _predicted(run)
    assert candidate.parallel.pp_layers == "llama3" and run_layers(candidate) == 126


def test_llama3s_rows_are_priced_on_llama3s_cluster_and_only_they():
    """One description of the cluster Llama 3 405B ran on (lab.calc.network's llama3-roce: the paper's §3.3.1) for
    its three rows, the networks named by their hardware for the others. At 16K GPUs the DP group (128 ranks, one
    a node, 128 GPUs apart) reaches 6 of its pods of 3,072 GPUs, 21 nodes in each: a ring ordered pod by pod keeps
    the NICs' rate through the 1:7 aggregation layer, and its reduce-scatter and all-gather hide all but about a
    second of the step (2.6 s on the playbook's network)."""
    from lab.calc.search import _pods

    llama3 = {"llama3-405b-8k-gpus", "llama3-405b-16k-gpus", "llama3-405b-16k-gpus-128k"}
    assert {r.name for r in RUNS if r.system == "llama3-roce"} == llama3
    assert all(r.system == "" for r in RUNS if r.name not in llama3)
    assert _pods(3072, ((128, 128),)) == 6 and _pods(3072, ((128, 64),)) == 3 and _pods(None, ((128, 128),)) == 1
    candidate, _ = _predicted(next(r for r in RUNS if r.name == "llama3-405b-16k-gpus"))
    assert 0.5 < candidate.time.dp < 1.5, candidate.time


def run_layers(candidate) -> int:
    from lab.layout import stage_layers

    p = candidate.parallel
    return sum(stage_layers(126, p.pp * p.pp_virtual_stages, p.pp_layers))


# --- the ranking: where the field's recipes land ---------------------------------------------------------------

# Searched on the recipes' own stack (torch.compile, Float8, async TP), cp pinned to 1 for TorchTitan's 2D and 3D
# recipes, which predate its context parallelism. The 8B recipe is first; the 405B recipe ranks 8th but ties with the
# best (the calibration's spread cannot order them); the 70B recipe does neither, and chapter 08 (section 5d) shows
# why: TP8's collectives, priced as Table 4 measured them, cost it four tenths of its compute, which the best
# layouts' narrower TP does not pay. The test holds the model to the documented rank and share, not looser ones.
RECIPES = [  # model, GPUs, sequences of 8192 a step, the recipe's layout, pins, rank at most, share at least, tie
    ("llama3-8b", 128, 256, {"dp": 128, "zero": 3}, {}, 1, 0.99, True),
    ("llama3-70b", 256, 512, {"dp": 32, "tp": 8, "pp": 1, "cp": 1, "zero": 3}, {"cp": 1}, 60, 0.70, False),
    ("llama3-405b", 512, 256, {"dp": 8, "tp": 8, "pp": 8, "cp": 1}, {"cp": 1}, 8, 0.92, True),
]


def _ranked(model, gpus, batch, fixed):
    return search(model, gpus, 8, "h100", 8192, batch * 8192, fixed=fixed, stack="compiled-fp8", tp_overlap=ASYNC_TP)


@pytest.mark.parametrize("model, gpus, batch, match, fixed, most, least, ties", RECIPES,
                         ids=["8b-fsdp", "70b-fsdp-tp8", "405b-fsdp-tp8-pp8"])
def test_recipes_rank_where_the_chapter_says(model, gpus, batch, match, fixed, most, least, ties):
    result = _ranked(model, gpus, batch, fixed)
    rank, share, tie = recipe_rank(result, match)
    assert rank <= most and share >= least and tie == ties, (model, rank, share, result.candidates[0].layout)
    if rank > 1:  # what separates it from the best: the best layout pays less for TP than the recipe does
        recipe = result.candidates[rank - 1]
        best = result.candidates[0]
        assert best.parallel.tp < 8 and recipe.time.tp > 0.25 * recipe.time.compute > best.time.tp


def test_ties_are_the_layouts_the_spread_cannot_order():
    result = _ranked("llama3-70b", 256, 512, {"cp": 1})
    best_low = result.candidates[0].tokens_per_s_range[0]
    tied = [c for c in result.candidates if c.tokens_per_s_range[1] >= best_low]
    assert result.ties == len(tied) >= 1 and result.candidates[0] in tied
    assert all(low < c.tokens_per_s < high for c in result.candidates for low, high in [c.tokens_per_s_range])
    assert result.as_dict(3)["ties"] == result.ties


def test_the_cli_prices_llama3s_own_layout_and_reports_the_ties(capsys):
    """`python -m lab calc search` pinned to Llama 3's 405B layout (TP8 · PP16 · DP128 on 16,384 GPUs, 126 layers
    over Llama 3's uneven stages) on the compiled stack, and the line that says how many layouts tie with the best.
    Without --run it is a search like any other: on the playbook's H100 network (`--hardware h100`), keeping what
    fits lab.train's memory (full recomputation, which Llama 3 ran without, §3.3.2), so its MFU is the search's
    there, below Table 4's 41 % (the row itself, priced on its own cluster: `--run llama3-405b-16k-gpus`)."""
    from lab.calc.cli import main

    argv = ["search", "--model", "llama3-405b", "--gpus", "16384", "--seq", "8192", "--gbs-tokens", "16M", "--tp",
            "8", "--pp", "16", "--dp", "128", "--cp", "1", "--pp-schedule", "interleaved", "--pp-chunks", "4",
            "--stack", "compiled", "--top", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("  1  "))
    assert "dp128 · tp8 sp · pp16 interleaved x4 llama3" in row
    run = next(r for r in RUNS if r.name == "llama3-405b-16k-gpus")
    mfu = float(row.split("%")[0].split()[-1]) / 100
    playbook = search("llama3-405b", 16384, 8, "h100", 8192, 2048 * 8192, stack="compiled", fixed={
        "tp": 8, "pp": 16, "dp": 128, "cp": 1, "pp_schedule": "interleaved", "pp_virtual_stages": 4})
    assert mfu == pytest.approx(playbook.candidates[0].mfu, abs=0.0006) and "recompute full" in row
    assert mfu < run.mfu < _predicted(run)[0].mfu / (1 - THROUGHPUT_GOAL)
    assert "ties: 1 layout reaches the best one's range" in out and "the calibration's spread" in out
    # --system prices the same search on another network: Llama 3's own fabric of pods
    assert main(argv + ["--system", "llama3-roce"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("  1  "))
    roce = search("llama3-405b", 16384, 8, "h100", 8192, 2048 * 8192, stack="compiled", system="llama3-roce",
                  fixed={"tp": 8, "pp": 16, "dp": 128, "cp": 1, "pp_schedule": "interleaved", "pp_virtual_stages": 4})
    assert float(row.split("%")[0].split()[-1]) / 100 == pytest.approx(roce.candidates[0].mfu, abs=0.0006)
    assert roce.candidates[0].mfu > mfu and "network llama3-roce" in out


def test_the_explorer_widget_reports_the_ties():
    from lab.widgets.search import config_explorer

    widget = config_explorer()
    ties = widget.result.ties
    assert f"{ties} {'layout ties' if ties == 1 else 'layouts tie'} with it" in widget.summary.value
    assert f"{widget.result.candidates[0].tokens_per_s_range[0]:,.0f}" in widget.summary.value


@pytest.mark.parametrize("name", ["llama3-405b-16k-gpus", "titan-405b-3d-interleaved", "titan-8b-8gpu-eager"])
def test_calc_search_run_prints_the_tables_prediction(name, capsys):
    """`python -m lab calc search --run NAME` pins the search to a row of the table and prints the very ratios the
    tests above hold to the goal, so that a reader can reproduce each row from the command line (three rows: Llama
    3's 126 layers over 16 uneven stages, TorchTitan's 3D and 1D runs; every row takes the same path)."""
    run = next(r for r in RUNS if r.name == name)
    assert cli.main(["search", "--run", run.name, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    candidate, (throughput, memory) = _predicted(run)
    assert printed["candidate"]["layout"] == candidate.layout
    assert (printed["throughput_ratio"], printed["memory_ratio"]) == (throughput, memory)
    measured = run.tokens_per_s_per_gpu or run.mfu
    assert measured in printed["measured"].values()


@pytest.mark.parametrize("argv, line", [
    (["search", "--run", "titan-70b-2d", "--tp", "4"], "--run titan-70b-2d decides --tp itself: leave them out"),
    (["search", "--gpus", "8"], "--model, --gbs-tokens required, or --run NAME"),
])
def test_calc_search_run_refuses_what_it_decides_itself(argv, line, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert line in err and "\n" not in err
