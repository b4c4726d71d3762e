"""ZeRO-3's parameter bytes on one GPU while it computes: the shards it owns plus the layers gathered whole.

At rest a ZeRO-3 (FSDP) rank keeps 1/dp of every parameter (the playbook's 2Ψ/N_d for bf16 weights). To compute
a layer it all-gathers that layer's full weights and frees them after use; with prefetching it also holds the
*next* layer, whose all-gather runs during this layer's compute ("all-gather layer n+1 during the forward of
layer n", the playbook's ZeRO-3 section; FSDP's `forward_prefetch`). So the parameter bytes during a forward
are the shards plus one layer (no prefetch) or two (prefetch): memory traded for hiding the all-gather.
Layers are taken as equal, Ψ/L each, the embedding and output layer lumped in: a back-of-envelope figure.
"""

from __future__ import annotations


def zero3_param_bytes(n_params: float, n_layers: int, dp: int, gathered: int = 2, bytes_per_param: float = 2) -> float:
    """Parameter bytes on one of dp ZeRO-3 ranks while `gathered` layers are whole: 0 at rest, 1 while a layer
    computes without prefetch, 2 with prefetch. bf16 weights by default (2 bytes a parameter)."""
    if not n_params > 0:
        raise ValueError(f"n_params={n_params!r} must be > 0")
    for name, value, low in (("n_layers", n_layers, 1), ("dp", dp, 1), ("gathered", gathered, 0)):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if gathered > n_layers:
        raise ValueError(f"gathered={gathered} must be at most n_layers={n_layers}")
    if not bytes_per_param > 0:
        raise ValueError(f"bytes_per_param={bytes_per_param!r} must be > 0")
    return bytes_per_param * n_params * (1 / dp + gathered / n_layers)
