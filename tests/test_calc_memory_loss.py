"""The loss's memory (issues 37 and 36): calc.memory's `loss` entry against the bytes the loss really holds on a CPU.

lab's 1B run on one H100 peaked at 48.5 GiB where calc.memory said 30.9: the cross-entropy works on fp32 (B, T, vocab)
tensors, and at its backward two of them (the gradient in, the gradient out) sit beside the log-probabilities it
keeps (`loss="whole"`, what that run ran). lab.train now takes the chunked cross-entropy at tp = 1 (`loss="chunked"`,
the default): one chunk's logits at a time, the hidden states' and the output weight's gradients kept instead.
`lab.measure.memory.PeakAllocation` counts what storages created inside a block hold at once."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab.calc.memory import chunked_loss_bytes, estimate_memory, loss_bytes
from lab.config import PRESETS, ParallelConfig, load_config
from lab.distributed import run as run_ranks
from lab.loss import chunked_cross_entropy, cross_entropy
from lab.measure.memory import PeakAllocation
from lab.model import build_model, materialize
from lab.parallel.parallelize import build_mesh, parallelize

B, T, VOCAB = 4, 32, 4096


def _viewed_weights(module: torch.nn.Module) -> int:
    """Bytes of the linears' weights, which PeakAllocation sees through the transposed view each matmul takes."""
    return sum(m.weight.nbytes for m in module.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_works_in_three_fp32_copies_of_the_logits(dtype):
    """An output layer's logits (fp32, or bf16 cast to fp32 as lab.parallel.parallelize does) into lab's loss: the
    forward and the backward peak at the kept log-probabilities plus `loss_bytes`, the log-softmax's backward
    holding the gradient it is given and the one it returns beside them."""
    output = torch.nn.Linear(8, VOCAB, bias=False).to(dtype)
    hidden = torch.randn(B, T, 8, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    with PeakAllocation() as peak:
        cross_entropy(output(hidden).float(), targets).backward()
    kept = 4 * B * T * VOCAB  # the fp32 log-probabilities, counted with the activations (`logits`)
    predicted = kept + loss_bytes(B * T, VOCAB, logits_bytes=dtype.itemsize)
    assert peak.bytes - _viewed_weights(output) == pytest.approx(predicted, rel=0.001)


def test_a_step_peaks_at_the_kept_activations_plus_the_loss():
    """A small model whose logits dominate, in fp32: the peak of forward + backward is calc.memory's exact
    activations plus its loss entry; without the loss entry calc would be a third short."""
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, n_layers=2)
    model = materialize(build_model(cfg), seed=0)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with sdpa_kernel(SDPBackend.MATH), PeakAllocation() as peak:  # the kernel calc's exact model counts, flash=False
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    est = estimate_memory(cfg, T, B, ParallelConfig(), precision="fp32", activation_model="exact", loss="whole")
    tokens_held = 2 * 8 * B * T  # the ids and the targets, made before the block (calc counts what they keep)
    predicted = est.per_gpu["activations"] + est.per_gpu["loss"]
    assert est.per_gpu["loss"] == 8 * B * T * VOCAB
    assert peak.bytes - _viewed_weights(model) + tokens_held == pytest.approx(predicted, rel=0.01)
    assert peak.bytes > 1.3 * est.per_gpu["activations"]


def test_the_loss_is_on_the_last_stage_only_and_in_the_total():
    cfg = PRESETS["llama3-8b"]
    parallel = ParallelConfig(pp=4, grad_accum=8)
    stages = [estimate_memory(cfg, 4096, 1, parallel, stage=s, loss="whole").per_gpu for s in range(4)]
    assert [gpu["loss"] for gpu in stages] == [0, 0, 0, 8 * 4096 * cfg.vocab_size]
    assert all(gpu["total"] == sum(v for k, v in gpu.items() if k != "total") for gpu in stages)
    # tensor parallelism: each rank's share of the vocabulary; its forward holds the shifted logits and exp too
    tp = estimate_memory(cfg, 4096, 1, ParallelConfig(tp=8)).per_gpu["loss"]
    assert tp == (2 + 4 + 8) * 4096 * cfg.vocab_size // 8


def test_the_one_h100_run_of_lab_is_nearer():
    """benchmarks/results/2026-11-26-h100-80gb-hbm3-bench.json, part mfu: llama3-1b, bf16 (fp32 master weights and
    gradient sums), 4 x 2048 tokens a micro-batch, flash attention, 52,052,598,272 bytes at peak."""
    measured = 52_052_598_272
    est = estimate_memory(PRESETS["llama3-1b"], 2048, 4, ParallelConfig(grad_accum=4), precision="mixed-fp32-grads",
                          flash=True, loss="whole")  # the run's loss: whole fp32 logits
    assert est.per_gpu["loss"] == 8 * 4 * 2048 * 128_256  # 7.8 GiB
    assert 0.8 < est.per_gpu["total"] / measured < 0.9  # 0.68 without it


@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 48), (torch.float32, 1024), (torch.bfloat16, 48)])
def test_the_chunked_loss_holds_one_chunk_of_logits(dtype, chunk):
    """`chunked_cross_entropy` on hidden states (B, T, d) and an output weight (vocab, d): the peak of its forward
    and backward is the two gradients it keeps for backward plus `chunked_loss_bytes` — one chunk's logits (c =
    min(chunk, tokens)), the fp32 sum of the weight's gradient and one chunk's share, a chunk's hidden gradient."""
    d = 64
    weight = torch.randn(VOCAB, d).to(dtype).requires_grad_()
    hidden = torch.randn(B, T, d, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    with PeakAllocation() as peak:
        chunked_cross_entropy(hidden, weight, targets, chunk).backward()
    kept = dtype.itemsize * (B * T * d + VOCAB * d)  # counted with the activations (`logits`)
    predicted = kept + chunked_loss_bytes(B * T, VOCAB, d, dtype.itemsize, chunk)
    assert peak.bytes - weight.nbytes == pytest.approx(predicted, rel=0.01)


def test_a_chunked_step_peaks_at_the_kept_activations_plus_the_chunked_loss():
    """The model's own loss (`model(inputs, targets=targets)`, what lab.train backpropagates at tp = 1): calc's
    default, loss="chunked", is its peak; the whole-logits estimate is a third too high here."""
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, n_layers=2)
    model = materialize(build_model(cfg), seed=0)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with sdpa_kernel(SDPBackend.MATH), PeakAllocation() as peak:
        model(inputs, targets=targets).backward()
    tokens_held = 2 * 8 * B * T
    est, whole = (estimate_memory(cfg, T, B, ParallelConfig(), precision="fp32", activation_model="exact", loss=loss)
                  for loss in ("chunked", "whole"))
    measured = peak.bytes - _viewed_weights(model) + tokens_held
    assert measured == pytest.approx(est.per_gpu["activations"] + est.per_gpu["loss"], rel=0.01)
    assert whole.per_gpu["activations"] + whole.per_gpu["loss"] > 1.3 * measured


def _last_stage_peak(pp: int = 2) -> tuple[int, dict[str, int]]:
    """One training step of `parallelize` (pp = 2: 1F1B with one micro-batch) of a model whose logits dominate: the
    peak bytes this rank's storages reached, the linears' weights left out, and calc's estimate for the last
    stage."""
    config = load_config("configs/tiny.toml", ["model.n_layers=2", f"model.vocab_size={VOCAB}", f"parallel.pp={pp}",
                                               f"train.seq_len={T}", f"train.global_batch={B}"])
    p = config.parallel
    par = parallelize(config.model, build_mesh(p), p, torch.device("cpu"), 0, T)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = par.batch(tokens[:, :-1], tokens[:, 1:])
    with sdpa_kernel(SDPBackend.MATH), PeakAllocation() as peak:
        par.forward_backward(inputs, targets)
    est = estimate_memory(config.model, T, B, p, precision="fp32", activation_model="exact", stage=p.pp - 1)
    return peak.bytes - _viewed_weights(par.model), est.per_gpu


def test_a_training_step_takes_the_chunked_loss():
    """`Parallelized.forward_backward` in one process (gradient accumulation's path, DP's, ZeRO's): its peak is
    the chunked loss's, not whole logits'."""
    measured, per_gpu = _last_stage_peak(pp=1)
    assert measured == pytest.approx(per_gpu["activations"] + per_gpu["loss"], rel=0.01)


def test_the_pipelines_last_stage_takes_the_chunked_loss():
    """The last stage's peak is its layers' activations plus the chunked loss (whole fp32 logits there would be
    2.07 MB more: 7.05 MB)."""
    _, (measured, per_gpu) = run_ranks(_last_stage_peak, 2)
    assert measured == pytest.approx(per_gpu["activations"] + per_gpu["loss"], rel=0.01)
