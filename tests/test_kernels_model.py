"""The model with lab.kernels' Triton kernels in its seams trains as the eager model does (Triton's interpreter here).

"As the eager model does" is the error-ratio rule (`lab.kernels.accuracy`): the same model and batch run three
times — eager in float64 (the reference), eager in float32 (torch's own error) and patched in float32 — and the
patched run's error against the reference may be at most twice eager float32's. It is applied to every parameter's
gradient right after the first backward (an error in any kernel's backward shows there, before AdamW can hide a
scale) and to the losses of a 30-step run (the issue's mini-model convergence test). The last tests run
`lab.train --kernels triton`, alone and with a zero-bubble pipeline, whose W pass computes RMSNorm's weight
gradient through the seam.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from lab import kernels  # noqa: E402  (first: it decides how kernels run before any is decorated)
from lab.config import ModelConfig  # noqa: E402
from lab.data import SyntheticTokens  # noqa: E402
from lab.kernels.accuracy import assert_error_ratio  # noqa: E402
from lab.loss import cross_entropy  # noqa: E402
from lab.model import RMSNorm, build_model, materialize, rms_norm  # noqa: E402
from lab.parallel.optim import adamw  # noqa: E402
from lab.parallel.pp import weight_gradients  # noqa: E402
from lab.train import main  # noqa: E402

# Triton's interpreter pays per program instance, and attention launches one per (sequence, head): the tiny model
# with 2 layers, 2 heads (one KV head) and 2 sequences a step keeps 30 steps within CI's budget.
SMALL = {"n_layers": 2, "n_heads": 2, "n_kv_heads": 1}
CFG = ModelConfig.from_preset("tiny", **SMALL)
SEQ, BATCH, STEPS = 32, 2, 30


def make_model(dtype: torch.dtype, patched: bool) -> tuple[torch.nn.Module, object]:
    """The tiny model (2 layers) with the same initial weights in `dtype`, and the loss it trains with."""
    model = materialize(build_model(CFG), kernels.DEVICE, seed=0).to(dtype)
    if not patched:
        return model, cross_entropy
    from lab.kernels.cross_entropy import cross_entropy as fused_cross_entropy

    return kernels.patch(model), fused_cross_entropy


def losses_and_first_gradients(dtype: torch.dtype, patched: bool, steps: int) -> tuple[torch.Tensor, dict]:
    model, loss_fn = make_model(dtype, patched)
    optimizer = adamw(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = SyntheticTokens(CFG.vocab_size, SEQ, BATCH, seed=0)
    losses, first = [], {}
    for step in range(steps):
        inputs, targets = (t.to(kernels.DEVICE) for t in data.batch(step))
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if step == 0:
            first = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().double())
    return torch.stack(losses), first


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[torch.Tensor, dict]]:
    return {"reference": losses_and_first_gradients(torch.float64, False, STEPS),
            "eager": losses_and_first_gradients(torch.float32, False, STEPS),
            "kernels": losses_and_first_gradients(torch.float32, True, STEPS)}


def test_patch_swaps_every_seam_and_leaves_a_replaced_core() -> None:
    from lab.kernels.flash_attention import flash_attention
    from lab.kernels.rmsnorm import rms_norm as fused_rms_norm
    from lab.kernels.swiglu import swiglu as fused_swiglu

    model = materialize(build_model(CFG), "cpu", seed=0)
    ring = object()  # what context parallelism would have put there
    model.layers["1"].attn.core = ring
    kernels.patch(model)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * CFG.n_layers + 1 and all(m.kernel is fused_rms_norm for m in norms)
    assert all(block.ffn.kernel is fused_swiglu for block in model.layers.values())
    assert model.layers["0"].attn.core is flash_attention
    assert model.layers["1"].attn.core is ring

    only_norms = kernels.patch(materialize(build_model(CFG), "cpu", seed=0), ["rms_norm"])
    assert only_norms.layers["0"].attn_norm.kernel is fused_rms_norm
    assert only_norms.layers["0"].ffn.kernel is not fused_swiglu


def test_patch_names_the_bad_kernel() -> None:
    with pytest.raises(ValueError, match="unknown kernel 'layer_norm': choose from rms_norm, swiglu, attention"):
        kernels.patch(materialize(build_model(CFG), "cpu", seed=0), ["rms_norm", "layer_norm"])


def test_every_gradient_after_the_first_backward_follows_the_error_ratio_rule(runs) -> None:
    reference, eager, patched = (runs[name][1] for name in ("reference", "eager", "kernels"))
    assert reference.keys() == patched.keys()
    # Each kernel is held to 2x torch's error on its own (tests/test_kernels_*.py); a weight gradient here has
    # gone through every kernel of the model's backward, whose errors add up: 4x.
    for name in reference:
        assert_error_ratio(f"d loss / d {name}", patched[name], eager[name], reference[name], ratio=4.0)


def test_thirty_steps_with_kernels_follow_eager_losses(runs) -> None:
    reference, eager, patched = (runs[name][0] for name in ("reference", "eager", "kernels"))
    assert reference[-1] < reference[0] - 1.0, "the tiny model should learn the synthetic language"
    assert_error_ratio(f"loss over {STEPS} steps", patched.float(), eager.float(), reference)


def test_weight_gradient_of_a_kernel_backed_norm_is_autograds() -> None:
    """The zero-bubble W pass asks RMSNorm for its weight gradient: with the kernel in the seam it must be the
    gradient autograd gets through the kernel (and the eager op's, within the rule)."""
    from lab.kernels.rmsnorm import rms_norm as fused_rms_norm

    torch.manual_seed(0)
    norm = RMSNorm(40, 1e-5).to(kernels.DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm.kernel = fused_rms_norm
    x, dy = torch.randn(3, 7, 40, device=kernels.DEVICE), torch.randn(3, 7, 40, device=kernels.DEVICE)
    x64, w64 = x.double(), norm.weight.detach().double().requires_grad_()
    rms_norm(x64, w64, 1e-5).backward(dy.double())
    w32 = norm.weight.detach().clone().requires_grad_()
    rms_norm(x, w32, 1e-5).backward(dy)
    weight_gradients(norm, x, dy)  # accumulates into norm.weight.grad
    assert_error_ratio("RMSNorm W pass", norm.weight.grad, w32.grad, w64.grad)


def train_losses(tmp_path, name: str, *flags: str) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    small = [f"--set=model.{name}={value}" for name, value in SMALL.items()]
    assert main([*small, "--set=train.global_batch=2", "--steps", "2", "--quiet", "--log-json", str(log),
                 *flags]) == 0
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_lab_train_with_kernels_matches_eager_alone_and_in_a_zero_bubble_pipeline(tmp_path) -> None:
    # On a GPU the kernels' float32 dots run in TF32 (Triton's default), torch's matmuls in float32
    rtol = 1e-3 if kernels.DEVICE == "cuda" else 2e-5
    eager = train_losses(tmp_path, "eager")
    alone = train_losses(tmp_path, "alone", "--kernels", "triton")
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(eager), rtol=rtol, atol=0)
    if kernels.DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("the pipeline half needs 2 GPUs (one per stage); the single-process half passed")
    piped = train_losses(tmp_path, "piped", "--kernels", "triton", "--nproc", "2", "--pp", "2",
                         "--pp-schedule", "zb-h1", "--grad-accum", "2")
    torch.testing.assert_close(torch.tensor(piped), torch.tensor(eager), rtol=rtol, atol=0)


def test_lab_train_refuses_kernels_where_the_model_is_not(monkeypatch, capsys) -> None:
    """Kernels compiled for a GPU cannot take the CPU tensors of a model told to stay on the CPU."""
    monkeypatch.setattr(kernels, "DEVICE", "cuda")
    assert main(["--kernels", "triton", "--set", "train.device='cpu'"]) == 2
    assert "--kernels triton with train.device='cpu': this process runs Triton kernels on the GPU" in \
        capsys.readouterr().err


def test_kernels_run_when_triton_was_imported_before_lab_kernels() -> None:
    """triton.language's helpers (tl.sum, ...) are decorated when triton is imported: a learner (or torch) that
    imports triton first must still get working interpreted kernels."""
    script = ("import triton.language, torch\n"
              "from lab import kernels\n"
              "from lab.kernels.rmsnorm import rms_norm\n"
              "x = torch.randn(3, 5, device=kernels.DEVICE)\n"
              "torch.testing.assert_close(rms_norm(x, torch.ones(5, device=x.device), 1e-5),\n"
              "                           x * (x.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt())\n"
              "print(kernels.MODE)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [kernels.MODE]
