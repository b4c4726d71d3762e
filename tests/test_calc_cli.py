"""`python -m lab calc memory|flops|params|comms|bubble|search|roofline`: tables, JSON, and one-line errors (exit 2)."""

import json
import re
import subprocess
import sys

import pytest

from lab.calc import estimate_memory, training_flops
from lab.calc.cli import RENAMED, VOCABULARY, build_parser, main, parse_bytes, parse_tokens
from lab.config import PRESETS, ParallelConfig


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_json_matches_the_library(capsys):
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--seq", "4096", "--dp", "8", "--zero", "1",
                       "--tp", "2", "--sp", "--pp", "2", "--grad-accum", "4", "--recompute", "selective",
                       "--flash", "--json")
    assert code == 0
    data = json.loads(out)
    parallel = ParallelConfig(dp=8, zero=1, tp=2, sp=True, pp=2, grad_accum=4, recompute="selective")
    est = estimate_memory(PRESETS["llama3-8b"], 4096, 1, parallel, flash=True)
    assert data == {**est.as_dict(), "stage": est.stage, "hardware": "h100", "hardware_memory_bytes": 80 * 2**30,
                    "fits": True}
    assert set(data["per_gpu_bytes"]) == {"params", "grads", "optimizer", "activations", "loss", "total"}
    assert set(data["activations_breakdown"]) == {"layers", "embedding", "logits"}
    assert isinstance(data["num_params"], int) and data["num_params"] == 8_030_261_248


def test_memory_table_labels_units(capsys):
    code, out, _ = run(capsys, "memory", "--model", "tiny", "--seq", "64", "--precision", "fp32",
                       "--activation-model", "exact")
    assert code == 0
    assert "GiB (2^30 B)" in out and "GB (10^9 B)" in out
    for row in ("params", "grads", "optimizer", "activations", "layers", "embedding", "logits", "loss", "total"):
        assert any(line.split()[0] == row for line in out.splitlines() if line.strip())
    bytes_of = {line.split()[0]: int(line.split()[1].replace(",", "")) for line in out.splitlines()
                if line.startswith("  ") and not line.startswith("    ") and line.split()[1][0].isdigit()}
    assert sum(v for k, v in bytes_of.items() if k != "total") == bytes_of["total"], bytes_of  # rows add up


def test_flops_json_with_mfu(capsys):
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--seq", "4096", "--dp", "64", "--grad-accum", "4",
                       "--recompute", "full", "--step-time", "5.0", "--hardware", "h100", "--json")
    assert code == 0
    data = json.loads(out)
    est = training_flops(PRESETS["llama3-8b"], 4096, 4096 * 64 * 4, recompute="full")
    assert data["tokens_per_step"] == 4096 * 64 * 4 and data["n_gpus"] == 64
    assert data["flops_per_step"] == {"model": est.model_flops, "hardware": est.hardware_flops}
    assert data["mfu"] == pytest.approx(est.model_flops / (5.0 * 64 * 989.4e12))
    assert data["hfu"] / data["mfu"] == pytest.approx(8 / 6)


def test_flops_table(capsys):
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--hardware", "h100", "--step-time", "1")
    assert code == 0 and "MFU" in out and "HFU" in out and "tokens per step" in out


@pytest.mark.parametrize("argv, message", [
    (["memory", "--model", "llama3-8b", "--tp", "3"], "tp=3 must divide n_heads=32"),
    (["memory", "--model", "llama3-8b", "--zero", "4"], "zero=4 must be one of 0, 1, 2, 3"),
    (["memory", "--model", "llama3-8b", "--seq", "-1"], "seq=-1 must be an integer >= 1"),
    (["memory", "--model", "llama3-8b", "--sp"], "sp=True needs tp > 1"),
    (["memory", "--model", "llama3-8b", "--activation-model", "exact"], "precision='mixed' must be 'fp32'"),
    (["flops", "--model", "llama3-8b", "--step-time", "2"], "--step-time=2.0 needs --hardware"),
    (["flops", "--model", "gpt-17"], "unknown model preset 'gpt-17'"),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_argparse_errors_and_params_through_python_m_lab():
    def lab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lab", "calc", *args], capture_output=True, text=True,
                              timeout=120)
    bad = lab("memory", "--model", "llama3-8b", "--precision", "fp16")
    assert bad.returncode == 2 and "--precision: invalid choice: 'fp16'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    done = lab("params", "--model", "llama3-8b")
    assert done.returncode == 0 and "8,030,261,248 parameters" in done.stdout


# --- python -m lab calc bubble -----------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, chunks", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                              ("zb-h1", 1)])
def test_bubble_json_is_the_simulator_and_the_closed_form(capsys, schedule, chunks):
    """The playbook's PP=8, m=32 figure: (p-1)/(v·m) = 0.21875 without interleaving, 0.0547 with v = 4."""
    from lab.calc.bubble import bubble_ratio, explore, zb_h1_bubble

    code, out, _ = run(capsys, "bubble", "--pp-schedule", schedule, "--pp", "8", "--grad-accum", "32",
                       *(["--pp-chunks", str(chunks)] if schedule == "interleaved" else []), "--json")
    assert code == 0
    data = json.loads(out)
    sim = explore(schedule, 8, 32, chunks)
    assert {k: data[k] for k in sim.as_dict()} == sim.as_dict()
    assert data["bubble_ratio"] == pytest.approx(sim.idle[0] / sim.busy[0])
    assert data["idle_fraction"] == pytest.approx(sum(sim.idle) / (8 * data["makespan"]))
    assert len(data["peak_activations"]) == 8 and data["closed_form_exact"] is True
    if schedule == "zb-h1":
        assert data["idle_closed_form"] == zb_h1_bubble(8, 1, 2, 1) == max(data["idle"])
        assert data["bubble_ratio_closed_form"] == pytest.approx(7 * (1 + 2 - 2) / (32 * (1 + 2)))
    else:
        assert data["bubble_ratio_closed_form"] == bubble_ratio(8, 32, chunks) == pytest.approx(data["bubble_ratio"])
    assert {"p2p_messages", "tf", "tb", "tw", "p2p", "busy", "idle", "chunks"} <= set(data)


def test_bubble_defaults_costs_and_latency(capsys):
    """--pp-chunks defaults to 2 for interleaved; costs and latency reach the simulator; the closed form says when it
    does not hold (latency; ZB-H1 with W longer than B)."""
    from lab.calc.bubble import explore

    data = json.loads(run(capsys, "bubble", "--pp-schedule", "interleaved", "--pp", "4", "--grad-accum", "8",
                          "--json")[1])
    assert data["chunks"] == 2 and data["bubble_ratio"] == pytest.approx(3 / 16)
    data = json.loads(run(capsys, "bubble", "--pp-schedule", "zb-h1", "--pp", "4", "--grad-accum", "8", "--tf", "2",
                          "--tb", "3", "--tw", "1", "--p2p", "0.5", "--json")[1])
    assert data["makespan"] == explore("zb-h1", 4, 8, tf=2, tb=3, tw=1, p2p=0.5).makespan
    assert data["closed_form_exact"] is False and data["makespan"] > 8 * 5 + 3 * (2 + 3 - 2)
    data = json.loads(run(capsys, "bubble", "--pp-schedule", "zb-h1", "--pp", "2", "--grad-accum", "2", "--tf", "1",
                          "--tb", "1", "--tw", "1", "--json")[1])
    assert data["closed_form_exact"] is False and data["idle_closed_form"] == 0 < max(data["idle"])


def test_bubble_table_has_the_numbers_and_a_timeline(capsys):
    """Playbook exercise: p = 4, m = 8, t_f = 1, t_b = 2: step time 33, 9 idle per rank; rank 3 starts 3 t_f late."""
    code, out, _ = run(capsys, "bubble", "--pp-schedule", "afab", "--pp", "4", "--grad-accum", "8")
    assert code == 0
    for label in ("bubble ratio (idle / useful)  0.375", "closed form 0.375", "idle fraction (idle / total)",
                  "makespan                      33 time units", "peak activations", "(p-1)/(v·m)",
                  "timeline: 1 column = 0.5 time units"):
        assert label in out, label
    timeline = [line.strip() for line in out.splitlines() if line.strip().startswith("rank ") and "|" in line]
    assert len(timeline) == 4
    assert timeline[3] == "rank  3 |" + "." * 6 + "Ff" * 8 + "Bbbb" * 8 + "." * 12 + "|"
    for line in timeline:  # 9 idle time units per rank = 18 columns of 0.5
        assert line.count(".") == 18 and line.count("F") == line.count("B") == 8
    out = run(capsys, "bubble", "--pp-schedule", "zb-h1", "--pp", "4", "--grad-accum", "8")[1]
    assert "W = weight gradient" in out and all(line.count("W") == 8 for line in out.splitlines() if " |" in line)


def test_bubble_help_states_the_time_model(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bubble", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("--tf the forward of one micro-batch through one stage", "--tb its whole backward",
                   "--tw the weight-gradient part of tb", "--p2p the latency", "afab,1f1b,interleaved,zb-h1"):
        assert phrase in text, phrase


@pytest.mark.parametrize("argv, message", [
    (["--pp", "0"], "pp=0 must be an integer >= 1"),
    (["--grad-accum", "0"], "microbatches=0 must be an integer >= 1"),
    (["--pp-schedule", "interleaved", "--pp", "4", "--grad-accum", "6"], "microbatches=6 must be a multiple of pp=4"),
    (["--pp-schedule", "interleaved", "--pp-chunks", "1"], "chunks=1 must be >= 2 for the interleaved schedule"),
    (["--pp-schedule", "1f1b", "--pp-chunks", "2"], "chunks=2: only the interleaved schedule runs several chunks"),
    (["--pp-schedule", "zb-h1", "--tb", "1", "--tw", "2"], "tw=2.0 must be <= tb=1.0"),
    (["--tf", "-1"], "tf=-1.0 must be a finite number >= 0"),
    (["--tf", "inf"], "tf=inf must be a finite number >= 0"),
    (["--tw", "nan"], "tw=nan must be a finite number >= 0"),
    (["--tf", "0", "--tb", "0", "--tw", "0"], "tf=0 and tb=0: at least one of the forward and the backward"),
    (["--p2p", "-0.5"], "p2p=-0.5 must be a finite number >= 0"),
    (["--pp", "1024", "--grad-accum", "1024"], "pp x microbatches x chunks = 1,048,576 must be at most 65,536"),
])
def test_bubble_bad_values_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, "bubble", *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1
    assert err.startswith("python -m lab calc bubble: error: ")


@pytest.mark.parametrize("argv, message", [
    (["--pp-schedule", "gpipe"], "argument --pp-schedule: invalid choice: 'gpipe' (choose from 'afab', '1f1b',"),
    (["--pp", "2.5"], "argument --pp: invalid int value: '2.5'"),
])
def test_bubble_argparse_errors_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["bubble", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


# --- one vocabulary across lab train and lab calc ---------------------------------------------------------

EXAMPLES = {"--model": "tiny", "--seq": "64", "--mbs": "2", "--dp": "2", "--tp": "2", "--cp": "2", "--pp": "2",
            "--ep": "2", "--zero": "1", "--sp": None, "--grad-accum": "4", "--pp-schedule": "interleaved",
            "--pp-chunks": "2", "--recompute": "full", "--precision": "bf16", "--hardware": "h100",
            "--gpus-per-node": "4"}
REQUIRED = {"params": ["--model", "tiny"], "memory": ["--model", "tiny"], "flops": ["--model", "tiny"],
            "comms": ["--bytes", "1e6", "--ranks", "8"], "bubble": [], "train": [],
            "search": ["--model", "tiny", "--gpus", "8", "--gbs-tokens", "1M"], "inference": ["--model", "tiny"]}


def _parse(command: str, argv: list[str]):
    from lab.train import build_parser as train_parser

    if command == "train":
        return train_parser().parse_args([*REQUIRED[command], *argv])
    return build_parser().parse_args([command, *REQUIRED[command], *argv])


@pytest.mark.parametrize("flag, commands", VOCABULARY.items())
def test_every_command_takes_the_one_name_of_a_shared_concept(flag, commands):
    """`lab train` and the `lab calc` subcommands spell a concept alike: --pp-chunks, --grad-accum, --pp-schedule,
    --hardware and --precision everywhere they apply (no --chunks, --microbatches, --schedule, --gpu, --dtype)."""
    assert set(EXAMPLES) == set(VOCABULARY)
    value = EXAMPLES[flag]
    for command in commands:
        args = _parse(command, [flag] if value is None else [flag, value])
        # lab train's flags come from ParallelConfig's fields: --pp-chunks stores into pp_virtual_stages
        stored = getattr(args, "pp_virtual_stages" if command == "train" and flag == "--pp-chunks"
                         else flag.lstrip("-").replace("-", "_"))
        assert stored == (True if value is None else type(stored)(value)), (command, flag)


@pytest.mark.parametrize("what", ["memory", "flops", "comms", "bubble"])
def test_old_spellings_are_hidden_aliases_that_name_the_new_one(capsys, what):
    with pytest.raises(SystemExit):
        main([what, "--help"])
    text = capsys.readouterr().out
    for old in ("--gpu", "--dtype", "--chunks", "--microbatches", "--schedule"):
        assert re.search(rf"(?<![\w-]){old}\b", text) is None, (what, old)
    for new in RENAMED.get(what, {}).values():
        assert new in text


def test_old_spellings_still_work_for_one_release(capsys):
    old = run(capsys, "bubble", "--schedule", "interleaved", "--pp", "4", "--microbatches", "8", "--chunks", "2",
              "--json")
    new = run(capsys, "bubble", "--pp-schedule", "interleaved", "--pp", "4", "--grad-accum", "8", "--pp-chunks", "2",
              "--json")
    assert old[0] == new[0] == 0 and old[1] == new[1]
    assert "--chunks is now --pp-chunks" in old[2] and "--microbatches is now --grad-accum" in old[2]
    old = run(capsys, "flops", "--model", "llama3-8b", "--gpu", "h100", "--dtype", "fp8", "--step-time", "1", "--json")
    new = run(capsys, "flops", "--model", "llama3-8b", "--hardware", "h100", "--precision", "fp8", "--step-time", "1",
              "--json")
    assert old[1] == new[1] and "--gpu is now --hardware" in old[2] and "--dtype is now --precision" in old[2]


# --- --bytes takes units ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("268435456", 268_435_456), ("1e9", 10**9), ("256MB", 256 * 10**6),
                                            ("256MiB", 2**28), ("1GiB", 2**30), ("1.5 GB", 1_500_000_000),
                                            ("64kib", 65_536), ("2TB", 2 * 10**12), ("100B", 100)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["0", "-5", "12XB", "GiB", "1 G i B", "", "0.1B", "nan", "1e9.5"])
def test_bad_bytes_name_the_value_and_the_forms(capsys, text):
    with pytest.raises(ValueError, match=re.escape(f"bytes={text!r} must be a byte count >= 1")):
        parse_bytes(text)
    with pytest.raises(SystemExit) as info:
        main(["comms", "--ranks", "16", "--bytes", text])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"bytes={text!r}" in err and "256MB" in err and "1GiB" in err


def test_comms_bytes_with_a_unit_equal_the_plain_count(capsys):
    plain = json.loads(run(capsys, "comms", "--ranks", "16", "--bytes", "268435456", "--json")[1])
    assert json.loads(run(capsys, "comms", "--ranks", "16", "--bytes", "256MiB", "--json")[1]) == plain
    assert "268,435,456 bytes (268.4 MB, 256.0 MiB)" in run(capsys, "comms", "--ranks", "16", "--bytes", "256MiB")[1]


# --- calc memory: a verdict, and no pipeline stage without a pipeline -------------------------------------

@pytest.mark.parametrize("argv, fits", [
    (["--model", "llama3-8b", "--dp", "8", "--zero", "1", "--tp", "2", "--sp", "--recompute", "selective"], True),
    (["--model", "llama3-70b", "--pp", "4", "--grad-accum", "8", "--hardware", "h200"], False),
])
def test_memory_says_whether_the_layout_fits_the_chosen_gpu(capsys, argv, fits):
    from lab.calc.hardware import HARDWARE

    gpu = argv[argv.index("--hardware") + 1] if "--hardware" in argv else "h100"
    data = json.loads(run(capsys, "memory", *argv, "--json")[1])
    total, capacity = data["per_gpu_bytes"]["total"], HARDWARE[gpu].memory_bytes
    assert data["fits"] is fits is (total <= capacity) and data["hardware_memory_bytes"] == capacity
    verdict = [line for line in run(capsys, "memory", *argv)[1].splitlines() if line.startswith("verdict: ")]
    gib = abs(capacity - total) / 2**30
    assert verdict == [f"verdict: fits on one {gpu} (80 GiB), {gib:,.1f} GiB to spare" if fits else
                       f"verdict: does NOT fit on one {gpu} (141 GiB): {gib:,.1f} GiB over"]


def test_memory_names_a_pipeline_stage_only_with_a_pipeline(capsys):
    out = run(capsys, "memory", "--model", "llama3-8b")[1]
    assert "stage" not in out and "0..0" not in out
    out = run(capsys, "memory", "--model", "llama3-8b", "--pp", "4", "--grad-accum", "4")[1]
    assert "pipeline stage 0 of 0..3 (the fullest)" in out
    out = run(capsys, "memory", "--model", "llama3-8b", "--pp", "4", "--grad-accum", "4", "--stage", "2")[1]
    assert "pipeline stage 2 of 0..3\n" in out


def test_memory_interleaved_defaults_to_2_chunks_like_bubble_and_train(capsys):
    argv = ["memory", "--model", "llama3-8b", "--pp", "4", "--grad-accum", "8", "--pp-schedule", "interleaved"]
    data = json.loads(run(capsys, *argv, "--json")[1])
    assert data == json.loads(run(capsys, *argv, "--pp-chunks", "2", "--json")[1])
    parallel = ParallelConfig(pp=4, grad_accum=8, pp_schedule="interleaved", pp_virtual_stages=2)
    assert data["per_gpu_bytes"] == estimate_memory(PRESETS["llama3-8b"], 4096, 1, parallel).as_dict()["per_gpu_bytes"]


# --- python -m lab calc search ----------------------------------------------------------------------------

SEARCH = ["search", "--model", "llama3-70b", "--gpus", "256", "--gpus-per-node", "8", "--hardware", "h100", "--seq",
          "8192", "--gbs-tokens", "4M"]


def test_search_table_is_the_ranking_with_its_time_split_and_the_rejected_families(capsys):
    """Issue 16's command: the ranked table (layout, mbs, grad-accum, memory, compute/comms/bubble, MFU, tokens/s) and
    one line per rejected family with its reason and count."""
    from lab.calc.search import search

    code, out, err = run(capsys, *SEARCH, "--top", "5")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "global batch 512 sequences = 4,194,304 tokens" in lines[0]
    header = lines[2].split()
    assert header == ["#", "layout", "mbs", "accum", "GiB", "compute", "comms", "bubble", "MFU", "tokens/s",
                      "tok/s/GPU"]
    result = search("llama3-70b", 256, 8, "h100", 8192, 2**22)
    for i, candidate in enumerate(result.top(5), 1):
        row = lines[2 + i]
        assert row.split()[0] == str(i) and candidate.layout in row and f"{candidate.tokens_per_s:,.0f}" in row
    rejected = [line for line in lines if " rejected (" in line]
    assert len(rejected) == len(result.rejected_families()) > 0
    assert any("memory" in line and "GiB per GPU > 80 GiB" in line for line in rejected)
    assert any("memory, 12 unsupported): needs at least" in line for line in rejected)  # ZeRO-2/3 with pp


def test_search_json_is_the_library_result(capsys):
    from lab.calc.search import search

    data = json.loads(run(capsys, *SEARCH, "--top", "3", "--json")[1])
    expected = search("llama3-70b", 256, 8, "h100", 8192, 2**22).as_dict(3)
    data.pop("elapsed_s"), expected.pop("elapsed_s")
    assert data == json.loads(json.dumps(expected))
    assert len(data["candidates"]) == 3
    assert {"layout", "parallel", "mbs", "grad_accum", "memory_bytes", "time_s", "mfu", "tokens_per_s",
            "tokens_per_s_per_gpu"} <= set(data["candidates"][0])
    assert set(data["candidates"][0]["time_s"]) == {"compute", "tp", "cp", "ep", "pp", "dp", "bubble", "comms", "total"}


def test_search_layout_flags_pin_settings(capsys):
    """The flags lab train takes (--tp, --cp, --pp-schedule, ...) pin what the search would vary."""
    data = json.loads(run(capsys, *SEARCH, "--tp", "8", "--cp", "1", "--pp", "1", "--recompute", "none", "--json")[1])
    assert data["candidates"] and all(c["family"] == "dp32·tp8" and c["parallel"]["recompute"] == "none"
                                      for c in data["candidates"])
    out = run(capsys, *SEARCH, "--tp", "8", "--pp", "1", "--cp", "1", "--zero", "0", "--mbs", "64")[1]
    assert "no layout fits with the pinned settings" in out


@pytest.mark.parametrize("text, expected", [("1M", 2**20), ("4M", 4 * 2**20), ("512k", 2**19), ("1.5M", 3 * 2**19),
                                            ("4e6", 4_000_000), ("4194304", 4 * 2**20), ("2G", 2**31)])
def test_parse_tokens_counts_k_m_g_in_powers_of_two(text, expected):
    """Batches are counted in sequences of power-of-two lengths: the playbook's "1M tokens" is 256 x 4096."""
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "250"], "gpus=250 must be a multiple of gpus_per_node=8 (whole nodes) or fit in one node"),
    (["--zero", "5"], "zero=5 must be one of 0, 1, 2, 3"),
    (["--top", "0"], "top=0 must be an integer >= 1"),
    (["--seq", "200000"], "seq=200000 must be <= max_seq_len=131072"),
    (["--gbs-tokens", "100"], "global_batch_tokens=100 must be at least one sequence of seq=8192 tokens"),
    (["--model", "gpt-17"], "unknown model preset 'gpt-17'"),
    (["--gbs-tokens", "4X"], "argument --gbs-tokens: tokens='4X' must be a token count >= 1"),
    (["--hardware", "tpu-v5e"], "argument --hardware: invalid choice: 'tpu-v5e'"),
])
def test_search_bad_values_exit_2_with_one_line(capsys, argv, message):
    try:
        code, out, err = run(capsys, *SEARCH, *argv)
    except SystemExit as exit_:  # argparse's own errors
        code, (out, err) = exit_.code, capsys.readouterr()
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


# --- python -m lab calc roofline ---------------------------------------------------------------------------

def test_roofline_json_is_the_library_and_flash_removes_the_memory_bound_attention(capsys):
    from lab.calc import roofline

    code, out, _ = run(capsys, "roofline", "--model", "llama3-8b", "--seq", "4096", "--hardware", "h100", "--json")
    assert code == 0
    data = json.loads(out)
    placed = [roofline.place(op, "h100") for op in roofline.llama_block_ops(PRESETS["llama3-8b"], 1, 4096)]
    assert [op["name"] for op in data["ops"]] == [p.op.name for p in placed]
    assert [op["bound"] for op in data["ops"]] == [p.bound for p in placed]
    assert data["block_time_s"] == pytest.approx(sum(p.time_s for p in placed))
    assert data["ridge"] == pytest.approx(989.4e12 / 3.35e12)  # H100 bf16, How to Scale Your Model ch. 1: ~295
    naive = {op["name"]: op["bound"] for op in data["ops"]}
    assert naive["softmax"] == naive["scores"] == "memory" and naive["gate_up_proj"] == "compute"
    code, out, _ = run(capsys, "roofline", "--model", "llama3-8b", "--attention", "flash", "--json")
    flash = json.loads(out)
    assert "softmax" not in {op["name"] for op in flash["ops"]}
    assert flash["block_time_s"] < 0.8 * data["block_time_s"]


def test_roofline_table_and_errors(capsys):
    code, out, _ = run(capsys, "roofline", "--model", "llama3-8b")
    assert code == 0 and "ridge point 295 FLOPs/byte" in out and "9 of 13 ops memory-bound" in out
    code, _, err = run(capsys, "roofline", "--model", "tiny-moe")
    assert code == 2 and err.strip().endswith("must be a dense GQA model (attention='gqa', n_experts=0): the block "
                                              "ops cover Llama blocks only")
    code, _, err = run(capsys, "roofline", "--model", "tiny", "--seq", "0")
    assert code == 2 and "seq=0 must be an integer >= 1" in err
