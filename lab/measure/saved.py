"""The bytes autograd saves for backward while a module runs forward, counted with saved-tensor hooks.

`torch.autograd.graph.saved_tensors_hooks(pack, unpack)` calls `pack` on every tensor an op saves for its
backward. Two things make counting them right: several saved tensors may share one storage (W1 and W3 of a
SwiGLU both save their common input; q, k and v cut from one matmul's output are views of it), so bytes are
counted once per storage (`untyped_storage().data_ptr()`) — at the storage's full size, since autograd keeps
the whole storage alive, not just the view; and the module's parameters are saved too (a Linear saves its
weight) but are not activations, so their storages are left out. `lab.measure.memory.saved_activation_bytes` does the
same for a whole `lab.model.Transformer`, split by region.

A checkpointed region (torch.utils.checkpoint, non-reentrant) saves its inputs through an ordinary autograd
node, which the hook sees, and nothing inside it: what it keeps is exactly its inputs.
"""

from __future__ import annotations

import torch
from torch import nn


def saved_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves while `module(*inputs)` runs forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # saved tensors stay alive, so no address is reused meanwhile
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    del out
    return sum(storages.values())
