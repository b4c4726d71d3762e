"""The GPU lane's logic, on a CPU: the one-line refusal, argument handling, the MFU arithmetic, the document's schema,
and its parts run end to end on the CPU (the same code that runs on a GPU, with device="cpu")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_lane  # noqa: E402

from lab.calc.flops import mfu as calc_mfu  # noqa: E402
from lab.calc.flops import training_flops  # noqa: E402
from lab.config import ModelConfig  # noqa: E402


@pytest.mark.parametrize("command, target", [("bench", "make bench-gpu"), ("record", "make record-gpu")])
def test_without_a_gpu_it_prints_one_line_and_exits_2(command, target):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_lane.py"), command], capture_output=True,
                          text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{target} needs an NVIDIA GPU: "), done.stderr


def test_make_targets_run_the_lane():
    makefile = (REPO / "Makefile").read_text()
    for command in ("bench", "record"):
        recipe = makefile.split(f"\n{command}-gpu:")[1].split("\n\n")[0]
        assert f"benchmarks/gpu_lane.py {command}" in recipe
    assert "benchmarks/gpu_lane.py bench --plan issue36" in makefile.split("\nbench-gpu-36:")[1].split("\n\n")[0]


@pytest.mark.parametrize("argv, message", [
    (["bench", "--parts", "memory"], "--parts 'memory': bench has correctness, mfu, nccl"),
    (["record", "--parts", "mfu"], "--parts 'mfu': record has memory, trace, ddp_trace"),
    (["bench", "--mfu-steps", "2"], "--mfu-steps=2 must be > 2"),
    (["bench", "--mfu-mbs", "0"], "--mfu-mbs=0 must be >= 1"),
    (["bench", "--mfu-goal", "45"], "--mfu-goal=45.0 must be in (0, 1]"),
    (["bench", "--budget-s", "0"], "--budget-s=0.0 must be > 0"),
    (["bench", "--plan", "issue63"], "--plan 'issue63': the plans are issue36"),
    (["record", "--plan", "issue36"], "--plan 'issue36' is a list of bench parts"),
    (["bench", "--mfu-long-seq", "-1"], "--mfu-long-seq=-1 must be >= 0"),
])
def test_bad_arguments_are_one_line(capsys, argv, message):
    assert gpu_lane.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_issue36_plan_puts_the_targets_first_and_its_limits_fit_its_budget():
    budget, steps = gpu_lane.plan_steps("issue36")
    assert budget == 480  # one command of a lent GPU's 15 minutes, start-up and a rerun left beside it
    assert [s.part for s in steps] == ["kernels", "mfu", "decode", "fp8_train", "mfu"]
    assert sum(s.limit_s for s in steps if not s.optional) <= budget
    assert [s.optional for s in steps] == [False] * 4 + [True]  # seq 8192 on time left over
    assert all(0 < s.estimate_s <= s.limit_s and s.basis for s in steps)
    dests = vars(gpu_lane._parser().parse_args(["bench"]))
    assert all(set(s.args) <= set(dests) for s in steps)  # each override is an argument the lane has
    mfu = [{**dests, **s.args} for s in steps if s.part == "mfu"]
    # nothing twice: the 2048 step has no second length, the 8192 step keeps the micro-batch's 8192 tokens
    assert [(m["mfu_seq"], m["mfu_long_seq"], m["mfu_mbs"] * m["mfu_seq"]) for m in mfu] == [(2048, 0, 8192),
                                                                                          (8192, 0, 8192)]
    assert steps[0].args == {"kernel_names": ["matmul", "softmax"]}


def _walk_plan(tmp_path, monkeypatch, takes: dict, budget: str = "480") -> tuple[dict, list]:
    """The issue36 plan through `lane` with fake parts on a fake clock: part i "takes" takes[i] seconds (an
    exception: it is raised, as a kill would stop the lane); each call sees the document on disk as it is then."""
    clock, calls = [0.0], []
    monkeypatch.setattr(gpu_lane, "time", type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(gpu_lane, "environment", lambda: _good_document()["environment"])
    path = tmp_path / "t-issue36-bench.json"

    def fake_part(name, args, timeout_s):
        on_disk = json.loads(path.read_text()) if path.exists() else None
        calls.append((name, timeout_s, args.mfu_seq, on_disk))
        took = takes[len(calls) - 1]
        if isinstance(took, BaseException):
            raise took
        clock[0] += took
        cut = took >= timeout_s  # a part that ended is a fail here: a pass would need its metrics
        return {"name": name, "status": "timeout" if cut else "fail", "wall_s": float(took),
                "reason": f"stopped after its {timeout_s:.0f} s" if cut else "a fake part"}

    monkeypatch.setattr(gpu_lane, "run_part", fake_part)
    args = gpu_lane._parser().parse_args(["bench", "--plan", "issue36", "--budget-s", budget, "--out", str(tmp_path),
                                          "--stem", "t"])
    try:
        doc = gpu_lane.lane("bench", args)
    except KeyboardInterrupt:
        doc = None
    return doc or json.loads(path.read_text()), calls


def test_a_lane_killed_during_a_part_leaves_a_valid_document_of_the_finished_parts(tmp_path, monkeypatch):
    doc, calls = _walk_plan(tmp_path, monkeypatch, [60, 160, KeyboardInterrupt()])
    assert calls[0][3] is None  # nothing to keep before the first part
    assert [len(c[3]["parts"]) for c in calls[1:]] == [1, 2]  # rewritten after every part
    assert all(gpu_lane.validate(c[3]) == [] for c in calls[1:])
    assert gpu_lane.validate(doc) == [] and [(p["name"], p["status"]) for p in doc["parts"]] == [
        ("kernels", "fail"), ("mfu", "timeout")]  # the part the lane's deadline cut off says so
    assert doc["plan"]["name"] == "issue36" and len(doc["plan"]["steps"]) == 5
    assert not list(tmp_path.glob(".*"))  # no temporary file left beside it


def test_the_plans_deadline_gives_each_part_what_is_left_and_skips_what_would_not_fit(tmp_path, monkeypatch, capsys):
    doc, calls = _walk_plan(tmp_path, monkeypatch, [60, 160, 65, 105], budget="390")
    # each part its limit while the time left is larger, fp8_train the 105 s left (limit 110, estimate 100)
    assert [(c[0], c[1]) for c in calls] == [("kernels", 90), ("mfu", 160), ("decode", 120), ("fp8_train", 105)]
    assert [p["status"] for p in doc["parts"]] == ["fail", "timeout", "fail", "timeout", "skip"]
    assert doc["parts"][4]["reason"] == "not started: 0 s of the lane's budget (--budget-s 390) were left, it needs " \
                                        "~110 s"
    assert doc["parts"][4]["args"]["mfu_seq"] == 8192 and gpu_lane.validate(doc) == []
    assert "left for a rerun (--parts, or the plan with --budget-s): mfu" in capsys.readouterr().out


def test_mfu_is_the_model_flops_over_the_median_steady_step_times_the_peak():
    cfg, seq, tokens, peak = ModelConfig.from_preset("llama3-1b"), 2048, 16 * 2048, 989e12
    # the two warm-up steps are slow; with them the median would be 1.2 s, without them it is 1.0 s
    metrics = gpu_lane.mfu_of_run([9.0, 8.0, 1.0, 0.9, 1.2, 1.0, 1.3], cfg, seq, tokens, peak)
    assert metrics["step_s"] == 1.0
    estimate = training_flops(cfg, seq, tokens=tokens)
    assert metrics["mfu"] == pytest.approx(calc_mfu(estimate, 1.0, 1, peak))
    # Llama 3.2 1B (1.2355e9 parameters, 16 layers, d_model 2048) at 2048 tokens: 6N + 12·L·d·s FLOPs per token (PaLM,
    # appendix B), 8.2e9; 32,768 tokens in 1 s on a 989 TFLOP/s H100 is 27%
    assert metrics["model_flops_per_step"] / tokens == pytest.approx(6 * 1.2355e9 + 12 * 16 * 2048 * 2048, rel=0.005)
    assert metrics["mfu"] == pytest.approx(0.27, abs=0.01)
    with pytest.raises(ValueError, match="more than the 2 warm-up steps"):
        gpu_lane.mfu_of_run([1.0, 1.0], cfg, seq, tokens, peak)


def test_the_peak_is_the_tables_dense_bf16_for_the_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert gpu_lane._peak_flops("cuda") == pytest.approx(989e12, rel=0.01)  # H100 SXM datasheet, dense bf16
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 PCIe")
    assert gpu_lane._peak_flops("cuda") is None  # not in the table: the part says so instead of guessing


def _good_document() -> dict:
    env = {"devices": [{"name": "NVIDIA H100 80GB HBM3"}], "driver": "580.1", "host": "h",
           "versions": {"python": "3.12", "torch": "2.11", "cuda": "13.0", "nccl": "2.27.7", "triton": "3.6",
                        "lab_commit": "abc"}}
    parts = [{"name": "mfu", "status": "pass", "wall_s": 40.0,
              "metrics": {"mfu": 0.41, "step_s": 0.8, "tokens_per_step": 32768, "model_flops_per_step": 3e14,
                          "peak_flops": 989e12,
                          "compile_rows": [{"seq": 2048, "compile": "eager", "mfu": 0.28, "step_s": 1.1},
                                           {"seq": 8192, "compile": "inductor", "error": "OutOfMemoryError: ..."}]}},
             {"name": "nccl", "status": "skip", "wall_s": 0.0, "reason": "needs 2 GPUs, this machine has 1"}]
    return gpu_lane.document("bench", env, parts)


@pytest.mark.parametrize("break_it, problem", [
    (lambda d: d["parts"][1].pop("reason"), "parts[1] (nccl): a skip part must say why"),
    (lambda d: d["parts"][0].update(status="ok"), "parts[0] (mfu): status 'ok' must be one of"),
    (lambda d: d["parts"][0]["metrics"].pop("mfu"), "parts[0] (mfu): metrics.mfu must be a number"),
    (lambda d: d["parts"][0]["metrics"].pop("compile_rows"), "parts[0] (mfu): metrics.compile_rows must be a list"),
    (lambda d: d["parts"][0]["metrics"]["compile_rows"][1].pop("error"),
     "parts[0] (mfu): metrics.compile_rows[1] needs mfu and step_s, or the error"),
    (lambda d: d["parts"][0]["metrics"]["compile_rows"][0].update(compile="yes"),
     "parts[0] (mfu): metrics.compile_rows[0] needs seq (int) and compile"),
    (lambda d: d["environment"]["versions"].pop("nccl"), "environment.versions.nccl: missing"),
    (lambda d: d["parts"][0].update(name="mystery"), "parts[0] (mystery): name must be one of"),
    (lambda d: d.update(schema="lab-gpu-lane/0"), "schema: 'lab-gpu-lane/0' is not"),
])
def test_the_schema_accepts_a_good_document_and_names_what_is_wrong(break_it, problem):
    doc = _good_document()
    assert gpu_lane.validate(doc) == []
    json.loads(json.dumps(doc))  # plain JSON
    break_it(doc)
    problems = gpu_lane.validate(doc)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_junit_summary_counts_and_names_the_failures():
    xml = """<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">
      <testcase classname="tests.gpu.test_cuda" name="test_a"/>
      <testcase classname="tests.gpu.test_cuda" name="test_b"><failure message="assert 1 == 2">tb</failure></testcase>
      <testcase classname="tests.gpu.test_cuda" name="test_c"><skipped message="needs 2 GPUs"/></testcase>
      <testcase classname="tests.test_kernels_matmul" name="test_d"/></testsuite></testsuites>"""
    summary = gpu_lane.junit_summary(xml)
    assert (summary["passed"], summary["failures"], summary["skipped"]) == (2, 1, 1)
    assert summary["failed"] == ["tests.gpu.test_cuda::test_b: assert 1 == 2"]
    assert summary["skip_reasons"] == ["needs 2 GPUs"]


def test_thinning_a_memory_timeline_keeps_its_peak():
    n = 10_000
    timeline = {"times_ms": [i / 10 for i in range(n)], "phases": [],
                "bytes_by_category": {"activation": [i % 997 for i in range(n)], "parameter": [5] * n}}
    timeline["bytes_by_category"]["activation"][4321] = 10**6
    thin = gpu_lane.thin(timeline, points=500)
    assert len(thin["times_ms"]) <= 500
    totals = [a + p for a, p in zip(*thin["bytes_by_category"].values(), strict=True)]
    assert max(totals) == 10**6 + 5 and 432.1 in thin["times_ms"]


@pytest.mark.slow  # ~25 s of a core: the GPU lane's own parts rehearsed on a CPU (make test runs it)
def test_the_parts_run_on_a_cpu_and_write_documents_that_validate(tmp_path):
    """mfu (lab.train's loop, the tiny model cut to CPU_WALK's layers) and ddp_trace (two gloo ranks under DDP,
    profiled): the code a GPU machine runs, with device="cpu"."""
    tiny = ["--device", "cpu", "--out", str(tmp_path), "--stem", "cpu-test"]
    assert gpu_lane.main(["bench", "--parts", "mfu", *tiny, "--mfu-model", "tiny", "--mfu-seq", "32",
                          "--mfu-long-seq", "64", "--mfu-compile", "aot_eager",
                          "--mfu-mbs", "2", "--mfu-accum", "2", "--mfu-steps", "4", "--mfu-precision", "fp32",
                          "--peak-flops", "1e11", "--mfu-goal", "1e-6"]) == 0
    assert gpu_lane.main(["record", "--parts", "ddp_trace", *tiny]) == 0
    bench = json.loads((tmp_path / "cpu-test-bench.json").read_text())
    record = json.loads((tmp_path / "cpu-test-record.json").read_text())
    assert gpu_lane.validate(bench) == [] and gpu_lane.validate(record) == []
    mfu = bench["parts"][0]["metrics"]
    assert mfu["tokens_per_step"] == 2 * 2 * 32 and 0 < mfu["mfu"] < 1 and len(mfu["losses"]) == 4
    assert mfu["compile"] == "eager"  # lab.train's default on a CPU
    rows = mfu["compile_rows"]  # seq x (eager, compiled), the micro-batch's tokens kept: 2 x 32 = 1 x 64
    assert [(r["seq"], r["compile"], r["micro_batch"]) for r in rows] == [(32, "eager", 2), (32, "aot_eager", 2),
                                                                          (64, "eager", 1), (64, "aot_eager", 1)]
    assert all(0 < r["mfu"] < 1 for r in rows), rows
    assert [r.get("from") for r in rows] == ["the part's default run", None, None, None]  # eager at 32: not run twice
    assert rows[0]["losses"] == rows[1]["losses"] and rows[2]["losses"] == rows[3]["losses"]  # aot_eager: same sums
    profiled = mfu["where_the_time_goes"]  # two steps recorded after two unrecorded ones: no set-up in the table
    assert profiled["profiled_steps"] == 2 and profiled["kernel_ms_per_step"]["matmul"] > 0
    assert sum(profiled["kernel_share"].values()) == pytest.approx(1, abs=0.01)  # lab.measure.kernel_time's categories
    assert not any(row["name"].startswith(("ProfilerStep", "forward")) for row in profiled["top_kernels"])
    assert "aten::randn" not in {row["name"] for row in profiled["top_kernels"]}  # initialisation
    assert {row["name"]: row["calls"] for row in profiled["top_kernels"]}["aten::mm"] == _matmuls_in_one_step()
    ddp = record["parts"][0]
    assert ddp["status"] == "pass" and ddp["metrics"]["backend"] == "gloo"
    assert (tmp_path / ddp["files"][0]).stat().st_size > 1000
    assert "DistributedDataParallel.forward" in {row["name"] for row in ddp["metrics"]["top_ops"]}


def _matmuls_in_one_step() -> int:
    """aten::mm calls of one step of the same run (set-up does none), counted by a profiler around all of it."""
    from torch.profiler import ProfilerActivity, profile

    from lab.config import load_config
    from lab.train import run

    config = load_config(None, ["model.preset='tiny'", f"model.n_layers={gpu_lane.CPU_WALK['layers']}", "train.steps=1",
                                "train.warmup_steps=1", "train.seq_len=32", "train.global_batch=4",
                                "parallel.grad_accum=2", "train.device='cpu'"])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(config, 1, verbose=False)
    return next(event.count for event in prof.key_averages() if event.key == "aten::mm")


def test_the_fp8_training_and_decode_parts_walk_their_rows_on_a_cpu(tmp_path):
    """fp8_train (bf16, lab's FP8 tensorwise and rowwise, torchao's when it runs here) and decode (the graph decoder
    and the torch.compile'd loop, traced by dynamo's eager backend) on the tiny preset, in this process: the rows a
    GPU records, without the GPU's shapes, compilation or goals."""
    args = gpu_lane._parser().parse_args(["bench", "--device", "cpu", "--out", str(tmp_path)])
    fp8 = gpu_lane.part_fp8_train(args)
    rows = {row["variant"]: row for row in fp8["metrics"]["rows"]}
    assert fp8["status"] == "pass" and list(rows) == list(gpu_lane.FP8_VARIANTS)
    assert all(rows[v]["tokens_per_s"] > 0 for v in ("bf16", "lab fp8-tensorwise", "lab fp8-rowwise"))
    tensorwise = rows["lab fp8-tensorwise"]
    assert tensorwise["vs_bf16"] == tensorwise["tokens_per_s"] / rows["bf16"]["tokens_per_s"]
    assert all({"tokens_per_s", "skipped", "error"} & set(rows[v]) for v in ("torchao tensorwise", "torchao rowwise"))
    decode = gpu_lane.part_decode(args)
    assert decode["status"] == "pass"
    assert [(row["preset"], row["decoder"]) for row in decode["metrics"]["rows"]] == [("tiny", "graph"),
                                                                                      ("tiny", "compile")]
    # a rate from the difference of two short runs, or (on loaded cores) the line saying it was lost in the noise
    assert all((row.get("tokens_per_s", 0) > 0) != ("error" in row) and "hbm_fraction" not in row
               for row in decode["metrics"]["rows"])
    parts = [{"name": name, "wall_s": 1.0, **result} for name, result in (("fp8_train", fp8), ("decode", decode))]
    assert gpu_lane.validate(gpu_lane.document("bench", _good_document()["environment"], parts)) == []

