"""FSDP2's knobs and HSDP, on the course's model: `fully_shard` per block then on the root, over a 1-D mesh
(FSDP) or a 2-D ("replicate", "shard") mesh (HSDP), with the options a production run sets.

HSDP (hybrid sharding) shards each parameter over the "shard" dimension — in production the 8 GPUs of a node,
on NVLink — and replicates the shards over the "replicate" dimension, across nodes. Every rank is still a data
parallel rank: gradients are reduce-scattered inside the shard group and then all-reduced across the replicas,
so they equal a single process on the whole batch. What it buys: the all-gathers of every forward and backward
stay on the fast links; only one all-reduce of a 1/shard gradient slice per step crosses the slow network.

The variants (`VARIANTS`), each one call of `fully_shard` away from plain FSDP2:
* "fsdp2": ZeRO-3, parameters resharded after the forward and gathered again for the backward;
* "no-reshard": `reshard_after_forward=False` keeps each block's gathered parameters from its forward until its
  backward — one all-gather per block per step instead of two, at the memory of whole parameters (ZeRO-2's);
* "bf16-params": `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: all-gathers and compute in
  bf16, gradients reduced and kept (sharded) in fp32 beside the fp32 parameter shards;
* "prefetch": explicit prefetching, each block told which block's all-gather to issue next
  (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`), beyond FSDP2's implicit one-ahead;
* "hsdp": the 2-D mesh, `replicate` x (world / replicate).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lab.config import ModelConfig
from lab.data import SyntheticTokens, shard_rows
from lab.model import build_model, materialize

VARIANTS = ("fsdp2", "no-reshard", "bf16-params", "prefetch", "hsdp")


def device_mesh(replicate: int = 1):
    """A ("shard",) mesh over every rank, or with replicate > 1 a ("replicate", "shard") mesh of
    replicate x (world / replicate) ranks: rank r sits in replica r // shard, shard position r % shard."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not isinstance(replicate, int) or replicate < 1 or world % replicate:
        raise ValueError(f"replicate={replicate!r} must be a positive divisor of the world size {world}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if replicate == 1:
        return init_device_mesh(device, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, variant: str = "fsdp2", replicate: int = 2) -> nn.Module:
    """`fully_shard` each block of `model` and then its root the `variant` way (see the module's docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {', '.join(VARIANTS)}")
    mesh = device_mesh(replicate if variant == "hsdp" else 1)
    options = {}
    if variant == "bf16-params":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=variant != "no-reshard", **options)
    fully_shard(model, mesh=mesh, **options)  # the root: embedding, final norm and output layer
    if variant == "prefetch":
        for block, after in zip(blocks, blocks[1:], strict=False):
            block.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([block])
    return model


def held_parameter_bytes(module: nn.Module) -> int:
    """Bytes of parameters this rank holds right now: a shard's local piece, or a whole (gathered) tensor."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in module.parameters())


def _batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return SyntheticTokens(cfg.vocab_size, seq_len, batch, seed=seed).next_batch()


def reference_gradients(cfg: ModelConfig, batch: int = 8, seq_len: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """One process, the whole batch: the gradients every data-parallel variant must reproduce."""
    model = materialize(build_model(cfg), seed=seed)
    inputs, targets = _batch(cfg, batch, seq_len, seed)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def sharded_gradients(cfg: ModelConfig, variant: str, replicate: int = 2, batch: int = 8, seq_len: int = 32,
                      seed: int = 0) -> dict:
    """On each rank of a process group: shard the model the `variant` way, run one forward and backward on this
    rank's rows of the batch, and report the whole gradients (`full_tensor`: gathered, for comparison), what
    the forward computed in, the bytes of block 0's parameters held between forward and backward, and how
    a gradient is laid out over the mesh."""
    model = shard_model(materialize(build_model(cfg), seed=seed), variant, replicate)
    inputs, targets = (shard_rows(t, dist.get_rank(), dist.get_world_size()) for t in _batch(cfg, batch, seq_len, seed))
    logits = model(inputs)
    held = held_parameter_bytes(model.layers["0"])
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    grad = next(model.parameters()).grad
    return {"grads": {name: p.grad.full_tensor() for name, p in model.named_parameters()},
            "forward_dtype": str(logits.dtype).removeprefix("torch."),
            "grad_dtype": str(grad.dtype).removeprefix("torch."),
            "held_after_forward": held, "placements": [repr(p) for p in grad.placements],
            "mesh": dict(zip(grad.device_mesh.mesh_dim_names, grad.device_mesh.shape, strict=True))}
