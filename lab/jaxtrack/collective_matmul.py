"""Chapter 04 in JAX: pinning activation layouts with `with_sharding_constraint`, and a collective matmul.

Sequence parallelism keeps the activation x[S_X, D] split along the sequence between the TP regions, and the
column layer x · W[D, F_X] needs all of x: an all-gather along S, on the critical path. Two ways to write it:

* `allgather_then_matmul`: say the layouts and let XLA do it. `with_sharding_constraint(x, P(None, None))`
  pins x whole at that point of the program, so XLA inserts one all-gather before a purely local matmul.
* `collective_matmul`: the all-gather decomposed by hand inside `shard_map`. Each device multiplies the
  sequence block it holds while `ppermute` passes the blocks one step around the ring, so after n steps every
  device has multiplied every block — the same result, n − 1 collective-permutes instead of an all-gather, and
  each transfer independent of the matmul running beside it: XLA's scheduler may overlap them (the Scaling
  Book's "collective matmul", ch. 3; async TP in PyTorch does the same with symmetric memory).

`sequence_parallel_mlp` is the whole SP region written with constraints only: x enters split along the sequence,
the hidden activation is pinned split along F (tensor parallel), the output pinned split along the sequence
again — the layouts of chapter 04's SP block, the collectives left to XLA.

Everything takes a 1-D mesh whose one axis is the TP group (`lab.jaxtrack.sim.make_mesh((n,), ("x",))`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _axis(mesh: Mesh) -> str:
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh axes {mesh.axis_names} must be one TP axis, e.g. make_mesh((8,), ('x',))")
    return mesh.axis_names[0]


def allgather_then_matmul(x: jax.Array, w: jax.Array, mesh: Mesh) -> jax.Array:
    """x[S_X, D] · w[D, F_X] -> y[S, F_X] under jit: x pinned whole (one all-gather), then a local matmul."""
    axis = _axis(mesh)
    whole = lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, None)))
    return lax.with_sharding_constraint(whole @ w, NamedSharding(mesh, P(None, axis)))


def collective_matmul(x: jax.Array, w: jax.Array, mesh: Mesh) -> jax.Array:
    """x[S_X, D] · w[D, F_X] -> y[S, F_X] with the all-gather of x as ring steps beside the partial matmuls.

    At step s device i holds sequence block (i + s) mod n (every device passes its block to its left
    neighbour), multiplies it by its columns of w and writes the product into rows of that block."""
    axis = _axis(mesh)
    n = mesh.shape[axis]
    to_the_left = [(j, (j - 1) % n) for j in range(n)]

    def local(x_block: jax.Array, w_block: jax.Array) -> jax.Array:
        me, rows = lax.axis_index(axis), x_block.shape[0]
        out = jnp.zeros((n * rows, w_block.shape[1]), jnp.result_type(x_block, w_block))
        block = x_block
        for step in range(n):
            if step:  # the next block's transfer does not depend on this step's matmul: they may overlap
                block = lax.ppermute(block, axis, perm=to_the_left)
            out = lax.dynamic_update_slice(out, block @ w_block, ((me + step) % n * rows, 0))
        return out

    return jax.shard_map(local, mesh=mesh, in_specs=(P(axis, None), P(None, axis)), out_specs=P(None, axis))(x, w)


def sequence_parallel_mlp(x: jax.Array, w1: jax.Array, w2: jax.Array, mesh: Mesh) -> jax.Array:
    """relu(x · w1) · w2 with chapter 04's SP layouts pinned: h[S, F_X] inside, the output y[S_X, D]."""
    axis = _axis(mesh)
    h = lax.with_sharding_constraint(jax.nn.relu(x @ w1), NamedSharding(mesh, P(None, axis)))
    return lax.with_sharding_constraint(h @ w2, NamedSharding(mesh, P(axis, None)))
