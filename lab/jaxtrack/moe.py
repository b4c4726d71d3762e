"""Expert parallelism the JAX way: an MoE layer whose experts are sharded over the devices, tokens sent to them
and back with `all_to_all` inside `shard_map`.

The layer is `lab.model.MoE` (top-k routing, softmax or sigmoid gates, optional capacity) with weights in torch's
layout: the router (n_experts, d_model) replicated, and every expert's w1, w3 (n_experts, d_ff, d_model) and w2
(n_experts, d_model, d_ff) stacked on a leading expert axis split `P('x')` — device r holds experts
[r·L, (r+1)·L), L = n_experts / devices, the layout of `lab.parallel.ep`. The tokens are split `P('x')` too.

PyTorch's version (`lab.parallel.ep.ExpertParallelCompute`) exchanges counts first, then rows with uneven split
sizes: its shapes change with the routing. XLA compiles static shapes, so here every (device, expert) pair gets a
fixed-size buffer of `capacity` rows, GShard's way: the dispatch is a dense (n_experts, capacity, d_model) array
that `all_to_all` reshuffles whole — no counts to exchange, at the price of padding (empty slots are sent and
computed too). Without a capacity factor the buffer holds every assignment a device could send one expert
(n_tokens: a token picks an expert at most once), so nothing is dropped; with one, an expert takes at most
ceil(c · n_tokens · top_k / n_experts) of each device's assignments, first come first served in token order —
what `MoE.capacity_mask` does on each rank's tokens.

Per device: route; place each kept assignment at (expert, its place in that expert's queue); `all_to_all` the
(devices, L, capacity, d) buffer so that device r receives every device's rows for its own L experts; run them
(`experts_forward`: the local experts' SwiGLUs as batched matmuls); `all_to_all` back; gather each
assignment's row and add it, weighted, into its token.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.jaxtrack.fsdp import feed_forward
from lab.layout import expert_capacity

Params = dict[str, jax.Array]  # "router": (E, d); "w1", "w3": (E, f, d); "w2": (E, d, f)


def route(logits: jax.Array, top_k: int, gating: str) -> tuple[jax.Array, jax.Array]:
    """`MoE.route`: (gates, experts), both (n_tokens, top_k), best first; gates renormalised when top_k > 1."""
    scores = jax.nn.softmax(logits, axis=-1) if gating == "softmax" else jax.nn.sigmoid(logits)
    gates, experts = jax.lax.top_k(scores, top_k)
    if top_k > 1:
        gates = gates / gates.sum(axis=-1, keepdims=True)
    return gates, experts


def experts_forward(params: Params, rows: jax.Array) -> jax.Array:
    """Each local expert, `lab.model.FeedForward` (w2(silu(w1·x) * w3·x)), on its own rows: rows (L, R, d) and
    weights stacked on the expert axis L; `vmap` turns the one-expert function into batched matmuls."""
    return jax.vmap(feed_forward)({name: params[name] for name in ("w1", "w3", "w2")}, rows)


def capacity_of(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Rows one expert takes from one device: `MoE.capacity_mask`'s ceil(c·n·k/E), or n (a token picks an expert
    at most once) without a capacity factor — then nothing is dropped."""
    return expert_capacity(n_tokens, top_k, n_experts, capacity_factor) if capacity_factor else n_tokens


def moe_ep(mesh: Mesh, top_k: int, gating: str = "softmax", capacity_factor: float = 0.0) -> Callable:
    """A jitted `(params, tokens) -> out` on `mesh` (one axis, "x"): the MoE layer with experts and tokens split
    over the devices, rows moved by two `all_to_all`s."""
    devices = mesh.shape["x"]

    @partial(jax.shard_map, mesh=mesh, in_specs=({"router": P(), "w1": P("x"), "w3": P("x"), "w2": P("x")}, P("x")),
             out_specs=P("x"))
    def layer(params: Params, x: jax.Array) -> jax.Array:
        (n, d), n_experts = x.shape, params["router"].shape[0]
        local = n_experts // devices
        capacity = capacity_of(n, top_k, n_experts, capacity_factor)
        gates, experts = route(x @ params["router"].T, top_k, gating)
        chosen = jax.nn.one_hot(experts.reshape(-1), n_experts, dtype=jnp.int32)  # assignments in token order
        place = (jnp.cumsum(chosen, axis=0) * chosen).sum(axis=-1) - 1  # 0-based place in its expert's queue
        keep = place < capacity
        token = jnp.repeat(jnp.arange(n), top_k)
        slot = jnp.where(keep, place, capacity)  # out of range: dropped by the scatter below
        dispatch = jnp.zeros((n_experts, capacity, d), x.dtype).at[experts.reshape(-1), slot].set(x[token],
                                                                                                  mode="drop")
        # (devices, local, capacity, d): block r goes to device r; what arrives is stacked by source device
        arrived = jax.lax.all_to_all(dispatch.reshape(devices, local, capacity, d), "x", 0, 0, tiled=True)
        rows = arrived.transpose(1, 0, 2, 3).reshape(local, devices * capacity, d)  # per local expert
        done = experts_forward(params, rows).reshape(local, devices, capacity, d).transpose(1, 0, 2, 3)
        back = jax.lax.all_to_all(done, "x", 0, 0, tiled=True).reshape(n_experts, capacity, d)
        picked = back.at[experts.reshape(-1), slot].get(mode="fill", fill_value=0)  # dropped: 0
        weighted = picked * (gates.reshape(-1) * keep)[:, None]
        return jnp.zeros_like(x).at[token].add(weighted)

    weights = {"router": NamedSharding(mesh, P()), **{w: NamedSharding(mesh, P("x")) for w in ("w1", "w3", "w2")}}
    split = NamedSharding(mesh, P("x"))
    return jax.jit(layer, in_shardings=(weights, split), out_shardings=split)
