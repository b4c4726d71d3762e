"""`torch.compile` applied to a built model block by block, as TorchTitan applies it (its
`torchtitan/models/llama3/infra/parallelize.py`, `apply_compile`): each transformer block compiled on its own, after
the parallelisms have rewritten it and before the optimizer is built. The model itself knows nothing of it.

Why per block and not the whole model: every block has the same code, so one graph serves them all (compiled once,
not `n_layers` times), a pipeline stage compiles only the blocks it holds, and what runs *between* blocks stays
eager — ZeRO-3's gather and free, which `lab.parallel.zero` hooks around each block as FSDP2 hooks around
TorchTitan's compiled block.

How: the block's `forward` is replaced by its compiled version, in place. The block stays the same `Block` object
under the same name (parameters, checkpoints and placements keep their names; TorchTitan's `torch.compile(block)`
wrapper would add `_orig_mod.` to each), and the hooks registered on it by `Module.__call__` still run around the
compiled forward, outside the graph. Tracing is lazy (at the first call), so the graph holds whatever modules
tensor, context and expert parallelism put into the block.

What belongs here: applying compile (`apply_compile`), counting the compiled blocks (`compiled_blocks`), the
one-line reason a layout cannot make one graph per block (`graph_breaks`), which backend a mode means on a device
(`compile_backend`), and whether compile works on this machine (`compile_works`: `lab doctor` reports it, and
`--compile auto` asks it on a GPU).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from lab.config import ModelConfig, ParallelConfig
from lab.model import Attention, Block, LatentAttention, MoE, causal_attention


def apply_compile(model: nn.Module, backend: str, fullgraph: bool) -> int:
    """Compile the `forward` of every transformer block in `model` (a model, a pipeline rank's ModuleList of
    stages) with `backend`, after keeping its communication out of the graph (`_keep_eager`); `fullgraph=True`
    makes any graph break an error instead of a silent split. Returns the number of blocks compiled."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        _keep_eager(block)
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)
    return len(blocks)


def _keep_eager(block: Block) -> None:
    """Mark with `torch.compiler.disable` what in a block communicates or has data-dependent shapes, so that it
    runs eagerly between the compiled pieces (one graph break each) instead of being traced into — where dynamo
    would follow lab's flight recorder into every collective and recompile on its counters: the hooks a
    parallelism registered on the block's submodules (tensor parallelism's all-reduces, all-gathers and
    reduce-scatters), an attention core a parallelism swapped in (context parallelism's ring or all-to-all), and
    a mixture of experts' layer (its routing, and expert parallelism's all-to-alls)."""
    for module in block.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in hooks.items():
                hooks[key] = torch.compiler.disable(hook)
        if isinstance(module, Attention | LatentAttention) and module.core is not causal_attention:
            module.core = torch.compiler.disable(module.core)
        if isinstance(module, MoE):
            module.forward = torch.compiler.disable(module.forward)


def compiled_blocks(model: nn.Module) -> int:
    """How many transformer blocks of `model` run a compiled `forward` (`torch.compile` marks what it wraps)."""
    return sum(hasattr(m.forward, "_torchdynamo_orig_callable") for m in model.modules() if isinstance(m, Block))


def graph_breaks(cfg: ModelConfig, parallel: ParallelConfig) -> str | None:
    """What this layout keeps out of each block's graph (None: one graph per block, `fullgraph=True`): the pieces
    `_keep_eager` marks, which run eagerly between the compiled parts of the block."""
    reasons = []
    if parallel.tp > 1:
        reasons.append("tensor parallelism's collectives")
    if parallel.cp > 1:
        reasons.append(f"context parallelism's {parallel.cp_impl} attention core")
    if cfg.is_moe:
        reasons.append("the MoE layers (tokens per expert are data-dependent shapes" +
                       (", and expert parallelism's all-to-alls" if parallel.ep > 1 else "") + ")")
    return ", ".join(reasons) or None


def compile_backend(mode: str, device: torch.device) -> tuple[str | None, str]:
    """The backend `--compile mode` means on `device` (None: run eagerly) and the start-up line saying why.
    "auto" compiles with inductor on a GPU where `compile_works` says it does, and stays eager on a CPU, where
    inductor's C++ build costs more time than short runs gain."""
    if mode == "eager":
        return None, "eager (--compile eager)"
    if mode != "auto":
        return mode, f"torch.compile per block, backend {mode}"
    if device.type != "cuda":
        return None, "eager (--compile auto on a CPU; --compile inductor to compile)"
    works, report = compile_works(device=device)
    return ("inductor", f"torch.compile per block ({report})") if works else (None, f"eager: {report}")


def compile_works(backend: str = "inductor", device: str | torch.device | None = None) -> tuple[bool, str]:
    """Compile and run a tiny function once on `device` (default: the GPU if there is one): (True, "torch.compile
    works (inductor, 4.1 s)") or (False, the one-line reason it does not — a missing compiler, an unsupported GPU,
    ...). A rank passes its own device, so that eight ranks do not all probe GPU 0."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(4, 32, device=device)
    start = time.perf_counter()
    try:
        out = torch.compile(rms, backend=backend, fullgraph=True)(x)
    except Exception as err:  # noqa: BLE001 - any failure is the answer, reported in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return False, f"torch.compile fails ({backend}): {type(err).__name__}: {first}"[:300]
    if not torch.allclose(out, rms(x), rtol=1e-5, atol=1e-6):
        return False, f"torch.compile ({backend}) runs but differs from eager on {device}"
    return True, f"torch.compile works ({backend}, {time.perf_counter() - start:.1f} s)"
