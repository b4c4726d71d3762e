"""Chapter 05 in JAX: ring attention with `ppermute` inside `shard_map`.

q, k, v [B, H, T, D] are split along the sequence T over the mesh's one axis, device i holding chunk i (the
contiguous layout). Inside `shard_map` each device keeps its queries and passes its K/V block one step around the
ring with `lax.ppermute` (device i sends to i + 1), so at step s it holds the block of device (i − s) mod n. Each
block's attention is folded into a running (out, lse) with the online-softmax merge of `lab.parallel.ring_attention`:

    lse = log(e^lse + e^lse_block)        out = e^(lse_old − lse) · out + e^(lse_block − lse) · out_block

The causal rule compares *global* positions: a key is visible when its position (its source device's chunk,
offset) is at most the query's. One difference from lab's PyTorch ring: there a rank skips a later chunk's block
(no work), while here every device runs the same traced program, whose source chunk is a traced value
(`axis_index`), so a later block is computed and masked out whole (its lse is −inf, its weight 0). The
wasted work is the causal imbalance the chapter's zig-zag layout removes.

The n − 1 `ppermute`s compile to XLA `collective-permute`s (read them in the compiled HLO); each step's transfer
does not depend on that step's attention, so the scheduler may run them side by side.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def _axis(mesh: Mesh) -> str:
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh axes {mesh.axis_names} must be one CP axis, e.g. make_mesh((8,), ('x',))")
    return mesh.axis_names[0]


def block_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                    scale: float) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of q [..., Tq, D] attending to one block of keys, where `visible` [Tq, Tk] allows it; a row that
    sees no key gets lse = −inf and out = 0."""
    scores = jnp.where(visible, jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    weights = jnp.exp(scores - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v), lse


def merge(out: jax.Array, lse: jax.Array, block_out: jax.Array,
          block_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Fold one block's (out, lse) into the running result (online softmax); rows empty on both sides stay empty."""
    new_lse = jnp.logaddexp(lse, block_lse)
    safe = jnp.where(jnp.isneginf(new_lse), 0.0, new_lse)
    return (out * jnp.exp(lse - safe)[..., None] + block_out * jnp.exp(block_lse - safe)[..., None]), new_lse


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, causal: bool = True) -> jax.Array:
    """softmax(q kᵀ / √D + mask) v over the whole sequence, for q, k, v [B, H, T, D] sharded P(None, None, axis,
    None): K/V blocks passed around the ring with `ppermute`, merged by log-sum-exp. Returns the same sharding."""
    axis = _axis(mesh)
    n = mesh.shape[axis]
    to_next = [(j, (j + 1) % n) for j in range(n)]
    scale = q.shape[-1] ** -0.5

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        me, chunk = lax.axis_index(axis), q.shape[2]
        offsets = jnp.arange(chunk)
        out, lse = jnp.zeros_like(q), jnp.full(q.shape[:-1], -jnp.inf, q.dtype)
        for step in range(n):
            if step:  # the block of device me − step arrives from the previous device
                k, v = lax.ppermute((k, v), axis, perm=to_next)
            source = (me - step) % n
            visible = jnp.ones((chunk, chunk), bool)
            if causal:  # global positions: key source·chunk + j is visible to query me·chunk + i when not later
                visible = (source * chunk + offsets)[None, :] <= (me * chunk + offsets)[:, None]
            out, lse = merge(out, lse, *block_attention(q, k, v, visible, scale))
        return out

    spec = P(None, None, axis, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)
