"""Measure the memory a training step really uses, to check `lab.calc.memory` against real tensors on a CPU.

Activations are what the forward pass leaves for the backward pass. Two independent ways to count them:

* `saved_activation_bytes`: a `torch.autograd.graph.saved_tensors_hooks` pack hook sees every tensor autograd
  saves. Views share storage (q is a view of wq's output), so bytes are counted once per storage
  (`untyped_storage().data_ptr()`), at the storage's real size and dtype; parameters are left out.
* `live_activation_bytes`: a `TorchDispatchMode` keeps a weak reference to the storage of every tensor the
  forward pass creates; after the forward pass (logits dropped, loss kept) whatever is still alive is held
  by the graph. It knows nothing of autograd, so it is the referee for the hooks.

Activation checkpointing: inside a non-reentrant `torch.utils.checkpoint` region the checkpoint installs its
own pack hooks, so an outer hook never sees the region's inner tensors — and none are kept: they are
recomputed in backward. What the region does keep, its inputs, it saves through an ordinary autograd node
(`_NoopSaveInputs`), which the outer hook does see. So with full recompute the hook counts each block's input,
with selective recompute the q, k, v handed to the attention core — and `live_activation_bytes` agrees byte
for byte (tests/test_measure.py). Two caveats: this is what is *kept* between forward and backward; during
backward a recomputed region briefly holds its own activations again. And selective checkpointing with a
policy (`create_selective_checkpoint_contexts`) caches the tensors it saves inside the checkpoint, out of
the hook's sight: use `live_activation_bytes` for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lab.calc.memory import estimate_memory
from lab.config import ModelConfig, ParallelConfig
from lab.model import Transformer, build_model, materialize, set_recompute

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _loss(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor, flash: bool,
          loss_fn: LossFn = _cross_entropy) -> torch.Tensor:
    # Checkpointed regions recompute in backward outside this context: the caller must run backward (if at
    # all) under the same backend, or the recomputed tensors would not match the saved ones.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if flash else SDPBackend.MATH):
        return loss_fn(model(tokens), targets)


def _fixed_storages(model: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}


def saved_activation_bytes(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                           flash: bool = False, loss_fn: LossFn = _cross_entropy) -> dict[str, int]:
    """Bytes autograd keeps for backward after forward + loss, by region: `embedding` (until the embedding
    returns), `layers` (the blocks, with the RoPE tables they share), `logits` (final norm, output layer,
    loss), and `total`. `targets` defaults to the tokens shifted by one; `loss_fn(logits, targets)` to
    cross-entropy (a tensor-parallel rank passes `lab.parallel.tp.vocab_parallel_cross_entropy`)."""
    targets = tokens.roll(-1, dims=1) if targets is None else targets
    fixed = _fixed_storages(model)
    seen: dict[int, tuple[str, int]] = {}
    region = ["embedding" if model.tok_embeddings is not None else "layers"]

    def enter(name: str) -> Callable[..., None]:
        return lambda *args: region.__setitem__(0, name)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in fixed:  # a saved tensor stays alive, so its address is not reused
            seen.setdefault(storage.data_ptr(), (region[0], storage.nbytes()))
        return t

    handles = []
    if model.tok_embeddings is not None:  # a post-hook: a checkpointed block 0 saves its input before it runs
        handles.append(model.tok_embeddings.register_forward_hook(enter("layers")))
    handles += [m.register_forward_pre_hook(enter("logits")) for m in (model.norm, model.output) if m is not None]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss(model, tokens, targets, flash, loss_fn)
    finally:
        for handle in handles:
            handle.remove()
    del loss
    out = {name: sum(n for r, n in seen.values() if r == name) for name in ("layers", "embedding", "logits")}
    return {**out, "total": sum(out.values())}


class _StorageRecorder(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                old = self.storages.get(storage.data_ptr())
                if old is None or old() is None:  # a freed storage's address may be handed out again
                    self.storages[storage.data_ptr()] = weakref.ref(storage)
        return out


class PeakAllocation(TorchDispatchMode):
    """The most bytes that storages created inside the block held at once (checked after every op), on the
    CPU as on a GPU — where `torch.cuda.max_memory_allocated` says the same. Meta tensors hold nothing.

        with PeakAllocation() as peak:
            model = build_and_shard(...)
        peak.bytes
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                old = self.storages.get(storage.data_ptr())
                if old is None or old() is None:
                    self.storages[storage.data_ptr()] = weakref.ref(storage)
        live = sum(s.nbytes() for ref in self.storages.values() if (s := ref()) is not None)
        self.bytes = max(self.bytes, live)
        return out


def live_activation_bytes(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                          flash: bool = False) -> int:
    """Bytes of the storages created by forward + loss that are still alive afterwards (the loss excluded).
    Unlike `saved_activation_bytes` it cannot see the inputs (created before), so token ids and targets
    that autograd keeps are added here by hand."""
    targets = tokens.roll(-1, dims=1) if targets is None else targets
    fixed = _fixed_storages(model)
    with _StorageRecorder() as recorder:
        loss = _loss(model, tokens, targets, flash)
    alive = {ptr: ref() for ptr, ref in recorder.storages.items() if ref() is not None and ptr not in fixed}
    alive.pop(loss.untyped_storage().data_ptr(), None)
    inputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (tokens, targets)}
    for ptr in inputs:  # a view of an input made inside the forward pass would count it a second time
        alive.pop(ptr, None)
    return sum(storage.nbytes() for storage in alive.values()) + sum(inputs.values())


def static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters (tied ones once), their gradients and the optimizer's per-parameter state tensors
    (Adam's exp_avg and exp_avg_sq, master copies). Adam's scalar `step` counters, a few bytes per tensor,
    are left out, as the calculator leaves them out."""
    params = list(model.parameters())
    out = {"params": sum(p.numel() * p.element_size() for p in params),
           "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
           "optimizer": 0}
    for p in params if optimizer is not None else []:
        for state in optimizer.state.get(p, {}).values():
            if isinstance(state, torch.Tensor) and state.numel() == p.numel():
                out["optimizer"] += state.numel() * state.element_size()
    return out


# The grid of benchmarks/memory_accuracy.py and tests/test_measure.py: tiny dense GQA models that vary
# sequence, batch, width, heads, KV heads, depth and FFN width (MHA, GQA and MQA; head_dim != d/heads once).
ACCURACY_GRID = [
    dict(seq=16, mbs=1, d_model=32, n_heads=4, n_kv_heads=4, n_layers=1, d_ff=64),
    dict(seq=32, mbs=2, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64),
    dict(seq=64, mbs=1, d_model=32, n_heads=4, n_kv_heads=1, n_layers=2, d_ff=96),
    dict(seq=48, mbs=3, d_model=48, n_heads=6, n_kv_heads=2, n_layers=1, d_ff=128),
    dict(seq=24, mbs=2, d_model=64, n_heads=8, n_kv_heads=8, n_layers=3, d_ff=128),
    dict(seq=40, mbs=1, d_model=64, n_heads=8, n_kv_heads=2, n_layers=2, d_ff=176),
    dict(seq=128, mbs=1, d_model=32, n_heads=2, n_kv_heads=1, n_layers=1, d_ff=64),
    dict(seq=16, mbs=4, d_model=96, n_heads=12, n_kv_heads=4, n_layers=2, d_ff=256),
    dict(seq=96, mbs=2, d_model=64, n_heads=4, n_kv_heads=2, n_layers=1, d_ff=160),
    dict(seq=32, mbs=1, d_model=48, n_heads=3, n_kv_heads=3, n_layers=4, d_ff=96),
    dict(seq=20, mbs=2, d_model=32, n_heads=8, n_kv_heads=4, n_layers=2, d_ff=64),
    dict(seq=64, mbs=2, d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, d_ff=128, head_dim=32),
]
MODES = (("none", False), ("none", True), ("selective", False), ("full", False))  # (recompute, flash)


def accuracy_rows(grid: list[dict] = ACCURACY_GRID, vocab_size: int = 96) -> list[dict]:
    """Measured (hooks) vs `exact` vs `korthikanti` activation bytes for every config and recompute mode."""
    rows = []
    for shape in grid:
        seq, mbs = shape["seq"], shape["mbs"]
        cfg = ModelConfig(name="grid", vocab_size=vocab_size, max_seq_len=seq,
                          **{k: v for k, v in shape.items() if k not in ("seq", "mbs")})
        model = materialize(build_model(cfg), seed=0)
        tokens = torch.randint(0, vocab_size, (mbs, seq), generator=torch.Generator().manual_seed(seq))
        for recompute, flash in MODES:
            set_recompute(model, recompute)
            parallel = ParallelConfig(recompute=recompute)
            measured = saved_activation_bytes(model, tokens, flash=flash)["total"]
            exact, korthikanti = (
                estimate_memory(cfg, seq, mbs, parallel, precision="fp32", flash=flash, activation_model=m,
                                loss="whole").per_gpu["activations"] for m in ("exact", "korthikanti"))  # as measured
            rows.append({**shape, "recompute": recompute, "flash": flash, "measured": measured, "exact": exact,
                         "korthikanti": korthikanti})
    return rows
