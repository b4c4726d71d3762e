"""What only an NVIDIA GPU can check: lab's CUDA paths, and its parallelisms under NCCL.

Run by `make bench-gpu` (benchmarks/gpu_lane.py, part `correctness`), or directly:

    python -m pytest tests/gpu -p no:xdist -v

Without a CUDA device every test here is skipped with that reason, so the CPU suite collects them and shows the skip.
- fp32 forward and backward on the GPU equal the CPU's (TF32 off, so only summation order differs);
- the bytes a forward pass keeps for backward on the GPU, read off the caching allocator, are what
  `lab.calc.memory`'s `exact` activation model predicts, within 10% (on a CPU the bound is 2%, tests/test_measure.py);
- `lab.measure.memory_timeline`'s memory timeline (chapter 01's figure) works on the GPU;
- `lab.train --precision bf16` trains on the GPU as the fp32 run does;
- every layout of `lab.train` that fits the machine's GPUs (one rank per GPU, NCCL) gives the single-GPU run's
  losses: the same layouts tests/test_train.py proves on gloo ranks. A 1-GPU machine skips them, saying so.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab.calc.memory import estimate_memory
from lab.config import ModelConfig, ParallelConfig, load_config
from lab.measure.memory_timeline import language_model_step, memory_timeline
from lab.model import build_model, materialize
from lab.train import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make bench-gpu)")]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# MHA: the memory-efficient kernel, which fp32 attention takes on a GPU (flash takes 16-bit only), saves the same
# tensors as flash (q, k, v, out, logsumexp); with GQA, torch may route fp32 through a kernel that expands k and v.
MEMORY_CFG = ModelConfig.from_preset("tiny", vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8,
                                     d_ff=1536, max_seq_len=1024)


@pytest.fixture(autouse=True)
def _no_tf32():
    """TF32 matmuls round inputs to 10 mantissa bits (~1e-3): the fp32 comparisons below must see fp32."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _loss_and_grads(device: str) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_preset("tiny")
    model = materialize(build_model(cfg), device, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.item(), {name: p.grad.cpu() for name, p in model.named_parameters()}


def test_fp32_forward_and_backward_on_the_gpu_equal_the_cpus():
    cpu_loss, cpu_grads = _loss_and_grads("cpu")
    gpu_loss, gpu_grads = _loss_and_grads("cuda")
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-5)
    for name, grad in cpu_grads.items():
        error = (gpu_grads[name] - grad).norm() / grad.norm()
        assert error < 1e-4, f"{name}: relative error {error:.2e} between the GPU's gradient and the CPU's"


def test_activation_bytes_on_the_gpu_match_calc_memory_within_10_percent(record_property):
    seq, mbs = 1024, 4
    device = torch.device("cuda")
    model = materialize(build_model(MEMORY_CFG), device, seed=0)
    tokens = torch.randint(0, MEMORY_CFG.vocab_size, (mbs, seq), device=device)
    targets = tokens.roll(-1, 1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - loss.untyped_storage().nbytes()
    peak = torch.cuda.max_memory_allocated() - before
    predicted = estimate_memory(MEMORY_CFG, seq, mbs, ParallelConfig(), precision="fp32", flash=True,
                                activation_model="exact").per_gpu["activations"]
    for name, value in (("kept_bytes", kept), ("forward_peak_bytes", peak), ("predicted_bytes", predicted),
                        ("kept_over_predicted", round(kept / predicted, 4))):
        record_property(name, value)  # into the lane's record (benchmarks/gpu_lane.py reads the junit report)
    assert abs(kept - predicted) <= 0.10 * kept, (kept, predicted)
    loss.backward()  # the graph is whole: what was counted was what backward needs


def _losses(overrides: list[str], nproc: int = 1) -> list[float]:
    config = load_config("configs/tiny.toml", ["train.device='cuda'", "train.steps=8", *overrides])
    return [log.loss for log in run(config, nproc, verbose=False)]


@functools.cache
def _one_gpu_losses() -> tuple[float, ...]:
    """The fp32 single-GPU run every other run here is compared with: computed once per test process."""
    return tuple(_losses([]))


def test_memory_timeline_on_the_gpu_has_every_phase_and_adams_states_from_step_2():
    """lab.measure.memory_timeline's figure of chapter 01, on the GPU: the profiler files allocations under cuda:N,
    so asking for "cuda" must still find them (it found none, before)."""
    cfg = ModelConfig.from_preset("tiny")
    model = materialize(build_model(cfg), "cuda", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 64), device="cuda")
    timeline = memory_timeline(language_model_step(model, optimizer, tokens, tokens.roll(-1, 1)), steps=2,
                               device="cuda")
    assert [phase for _, phase, _, _ in timeline.phases] == ["forward", "backward", "optimizer"] * 2
    params = sum(p.numel() * 4 for p in model.parameters())
    assert max(timeline.bytes_by_category["parameter"]) >= params
    assert max(timeline.bytes_by_category["optimizer_state"]) >= 2 * params  # Adam's m and v
    assert timeline.peak(2) > timeline.peak(1)  # step 2 holds the states step 1 created


def test_bf16_training_on_the_gpu_follows_fp32(record_property):
    fp32, bf16 = _one_gpu_losses(), _losses(["train.precision='bf16'"])
    record_property("fp32_losses", [round(x, 4) for x in fp32])
    record_property("bf16_losses", [round(x, 4) for x in bf16])
    assert bf16[-1] < bf16[0] - 0.1, "bf16 training on the GPU did not lower the loss"
    for step, (a, b) in enumerate(zip(fp32, bf16, strict=True), start=1):
        assert abs(a - b) <= 2e-2 * a, f"step {step}: fp32 {a:.4f} vs bf16 {b:.4f}"


LAYOUTS = [  # (overrides, ranks): tests/test_train.py's layouts, on GPUs
    (["parallel.dp=2"], 2),
    (["parallel.dp=2", "parallel.zero=1", "parallel.grad_accum=2"], 2),
    (["parallel.dp=2", "parallel.zero=3"], 2),
    (["parallel.tp=2", "parallel.sp=true"], 2),
    (["parallel.cp=2"], 2),
    (["parallel.pp=2", "parallel.grad_accum=4"], 2),
    (["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.grad_accum=2"], 4),
    (["parallel.dp=4", "parallel.zero=3"], 4),
    (["parallel.pp=2", "parallel.dp=2", "parallel.grad_accum=2", "parallel.pp_schedule='zb-h1'"], 4),
    (["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.grad_accum=2"], 8),
]


@pytest.mark.parametrize("overrides, nproc", [
    pytest.param(o, n, marks=pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, this machine has {GPUS}"))
    for o, n in LAYOUTS], ids=lambda v: "-".join(x.split(".")[1] for x in v) if isinstance(v, list) else str(v))
def test_layouts_under_nccl_match_one_gpu(overrides, nproc):
    base, parallel = _one_gpu_losses(), _losses(overrides, nproc)
    for step, (a, b) in enumerate(zip(base, parallel, strict=True), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: one GPU {a} vs {nproc} GPUs {b}"
