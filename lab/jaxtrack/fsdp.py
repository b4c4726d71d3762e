"""FSDP (ZeRO-3) the JAX way: weights sharded `P('x')` over the devices, gathered for the compute, and their
gradients reduce-scattered back to shards — read from the program XLA compiles.

The model is `lab.model.FeedForward` (SwiGLU: w2(silu(w1·x) * w3·x)), its weights in torch's (out, in) layout, so
the PyTorch module and this function compute the same thing from the same numbers. Each weight is split by rows
over the mesh axis "x", as FSDP2 shards every parameter on dim 0 (`Shard(0)`), and so is the batch: every device
holds 1/n of the weights and 1/n of the tokens.

Inside `shard_map` the step is written per device, as the Scaling Book decodes FSDP (ch. 5):
`W = AllGather_x(W[D_x])`, compute with the whole W on the local tokens, and the loss averaged over devices
(`pmean`). `jax.grad` does the rest: the transpose of an all-gather is a reduce-scatter, so the backward sums each
weight's gradient over the devices and leaves each with its own rows — the reduce-scatter of ZeRO-2/3, written by
nobody. XLA keeps each gathered weight from the forward for the backward instead of gathering it again (what
FSDP2 calls `reshard_after_forward=False`): one all-gather and one reduce-scatter per weight.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.jaxtrack.sim import collectives_in

Params = dict[str, jax.Array]  # "w1", "w3": (d_ff, d_model); "w2": (d_model, d_ff), as lab.model.FeedForward


def feed_forward(params: Params, x: jax.Array) -> jax.Array:
    """lab.model.FeedForward in jnp: x (tokens, d_model) → w2(silu(x w1ᵀ) * x w3ᵀ)."""
    return (jax.nn.silu(x @ params["w1"].T) * (x @ params["w3"].T)) @ params["w2"].T


def mse_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """The mean squared error of the feed-forward's output: one device, no sharding (the reference)."""
    return jnp.mean((feed_forward(params, x) - y) ** 2)


def fsdp_step(mesh: Mesh, sharded: tuple[str, ...] = ("w1", "w3", "w2")) -> Callable:
    """A jitted `(params, x, y) -> (loss, grads)` whose weights named in `sharded` (all, by default) live as row
    shards `P('x')` and are all-gathered for the compute; the batch is split over "x" too. A weight left out of
    `sharded` is replicated, as plain data parallelism would keep it (its gradient is then all-reduced)."""
    specs = {name: P("x") if name in sharded else P() for name in ("w1", "w3", "w2")}

    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("x"), P("x")), out_specs=P())
    def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        whole = {name: jax.lax.all_gather(w, "x", tiled=True) if name in sharded else w
                 for name, w in params.items()}  # FSDP: the weights exist whole only here
        return jax.lax.pmean(mse_loss(whole, x, y), "x")  # each device's mean, averaged: the global mean

    weights = {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
    batch = NamedSharding(mesh, P("x"))
    return jax.jit(jax.value_and_grad(loss), in_shardings=(weights, batch, batch),
                   out_shardings=(NamedSharding(mesh, P()), weights))


def compiled_collectives(step: Callable, *args: jax.Array) -> Counter:
    """How many of each collective the program XLA compiled for `step(*args)` contains (from its HLO text)."""
    return collectives_in(step.lower(*args).compile())
