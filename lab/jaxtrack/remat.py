"""Chapter 01 the JAX way: `jax.checkpoint` (remat) and its policies on `lab.measure.recompute`'s GELU block.

PyTorch decides what to keep op by op (each autograd node saves what its backward needs) and
`torch.utils.checkpoint` throws a region's activations away wholesale. JAX makes the choice a *policy* over the
values of a traced function: under `jax.checkpoint(f, policy=...)` the backward pass may use only what the policy
marks saveable, and recomputes the rest from the inputs.

* `nothing_saveable`: keep only the function's arguments (torch's full recompute: the block's input);
* `dots_saveable`: keep the matmul outputs, recompute the cheap elementwise ops (norm, GELU) from them — the
  JAX spelling of "selective" recompute: save what is expensive to recompute;
* `everything_saveable`: keep every intermediate (no recompute at all).

What a policy keeps is visible without running the backward pass: `jax.vjp` returns the backward function as a
pytree whose leaves are exactly the residuals it will read (`residuals`). The gradients are the same under every
policy; only the memory/compute trade changes (tests/test_jaxtrack_ch01.py checks both against torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

POLICIES: dict[str, Callable | None] = {
    "none": None,  # no jax.checkpoint at all: autodiff keeps what it likes
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
}
Params = Mapping[str, jax.Array | np.ndarray]


def gelu_block(params: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """x + W2·gelu(W1·LayerNorm(x)), with biases: `lab.measure.recompute.Block("gelu")` without dropout, whose
    `state_dict()` (as numpy arrays) is `params` — torch's Linear computes x·Wᵀ + b."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) / jnp.sqrt(var + eps) * params["norm.weight"] + params["norm.bias"]
    hidden = jax.nn.gelu(h @ params["w1.weight"].T + params["w1.bias"], approximate=False)  # torch's exact erf GELU
    return x + hidden @ params["w2.weight"].T + params["w2.bias"]


def rematted(policy: str) -> Callable[[Params, jax.Array], jax.Array]:
    """`gelu_block` under `jax.checkpoint` with the named policy (plain for "none")."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {', '.join(map(repr, POLICIES))}")
    return gelu_block if POLICIES[policy] is None else jax.checkpoint(gelu_block, policy=POLICIES[policy])


def _backward_leaves(params: Params, x: jax.Array, policy: str) -> list:
    """The arrays the backward pass will read under `policy` — the leaves of the function `jax.vjp` returns —
    as shapes and dtypes only (`jax.eval_shape`: traced, never compiled or run)."""
    forward = rematted(policy)
    return jax.eval_shape(lambda p, t: jax.tree_util.tree_leaves(jax.vjp(forward, p, t)[1]), dict(params), x)


def residuals(params: Params, x: jax.Array, policy: str) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of each array the backward pass will read under `policy`, the arguments (weights and
    input) included."""
    return [(tuple(leaf.shape), leaf.size * leaf.dtype.itemsize) for leaf in _backward_leaves(params, x, policy)]


def activation_bytes(params: Params, x: jax.Array, policy: str) -> int:
    """Bytes of the residuals shaped like the tokens, (batch, seq, ...): the activations, weights (and their
    transposes) left out — what `lab.measure.saved.saved_bytes` counts on the torch side."""
    tokens = tuple(x.shape[:-1])
    return sum(nbytes for shape, nbytes in residuals(params, x, policy) if shape[:len(tokens)] == tokens)


def gradients(params: Params, x: jax.Array, cotangent: jax.Array) -> dict[str, dict[str, np.ndarray]]:
    """Per policy: the output, the input's gradient and each parameter's gradient for the output gradient
    `cotangent`, named as `lab.measure.recompute.gradients` names them. All policies in one compiled program, at XLA's
    lowest backend optimisation level: for a program this small, optimising costs more than it saves (op by op,
    every primitive would be compiled on its own)."""

    def run(params: dict, x: jax.Array, dy: jax.Array) -> dict:
        out = {}
        for policy in POLICIES:
            y, backward = jax.vjp(rematted(policy), params, x)
            grad_params, grad_x = backward(dy.astype(y.dtype))
            out[policy] = {"output": y, "input": grad_x, **grad_params}
        return out

    args = (dict(params), jnp.asarray(x), jnp.asarray(cotangent))
    compiled = jax.jit(run).lower(*args).compile({"xla_backend_optimization_level": 0})
    return jax.tree_util.tree_map(np.asarray, compiled(*args))
