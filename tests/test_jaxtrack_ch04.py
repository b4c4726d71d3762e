"""Chapter 04's JAX section: the collective matmul (the all-gather of x as ppermute steps beside partial matmuls,
in shard_map) equals PyTorch's x @ w and the plain all-gather-then-matmul pinned with with_sharding_constraint;
its compiled program has collective-permutes and no all-gather; the SP MLP pinned with constraints equals PyTorch's
MLP and leaves its output split along the sequence."""

from collections import Counter

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lab.jaxtrack.collective_matmul import (  # noqa: E402
    allgather_then_matmul,
    collective_matmul,
    sequence_parallel_mlp,
)
from lab.jaxtrack.sim import collectives_in, make_mesh, simulated_devices  # noqa: E402

SEQ, D_MODEL, D_FF = 40, 12, 24  # the sequence and F multiples of 8 devices; D is not split


def _collectives(fn, *args) -> Counter:
    return collectives_in(jax.jit(fn).lower(*args).compile())


@pytest.fixture(scope="module")
def case():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    simulated_devices(8)
    mesh = make_mesh((8,), ("x",))
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(SEQ, D_MODEL, generator=g), torch.randn(D_MODEL, D_FF, generator=g), \
        torch.randn(D_FF, D_MODEL, generator=g)

    def put(t, *spec):
        return jax.device_put(jax.numpy.asarray(t.numpy()), NamedSharding(mesh, P(*spec)))

    return {"mesh": mesh, "torch": (x, w1, w2), "x": put(x, "x", None), "w1": put(w1, None, "x"),
            "w2": put(w2, "x", None)}


def test_collective_matmul_equals_pytorch_and_the_plain_all_gather(case):
    mesh, (x, w1, _) = case["mesh"], case["torch"]
    ring = jax.jit(lambda a, b: collective_matmul(a, b, mesh))(case["x"], case["w1"])
    plain = jax.jit(lambda a, b: allgather_then_matmul(a, b, mesh))(case["x"], case["w1"])
    np.testing.assert_allclose(np.asarray(ring), (x @ w1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ring), np.asarray(plain), rtol=1e-6, atol=1e-6)
    for y in (ring, plain):  # each device ends with every token and its F/8 columns: y[S, F_X]
        assert y.sharding.spec == jax.sharding.PartitionSpec(None, "x")
        assert {s.data.shape for s in y.addressable_shards} == {(SEQ, D_FF // 8)}


def test_collective_matmul_permutes_instead_of_gathering(case):
    mesh = case["mesh"]
    ring = _collectives(lambda a, b: collective_matmul(a, b, mesh), case["x"], case["w1"])
    plain = _collectives(lambda a, b: allgather_then_matmul(a, b, mesh), case["x"], case["w1"])
    assert ring["collective-permute"] == 7 and ring["all-gather"] == 0, ring  # n − 1 ring steps
    assert plain["all-gather"] == 1 and plain["collective-permute"] == 0, plain


def test_sequence_parallel_mlp_equals_pytorch_and_stays_split_along_the_sequence(case):
    mesh, (x, w1, w2) = case["mesh"], case["torch"]
    y = jax.jit(lambda a, b, c: sequence_parallel_mlp(a, b, c, mesh))(case["x"], case["w1"], case["w2"])
    np.testing.assert_allclose(np.asarray(y), (torch.relu(x @ w1) @ w2).numpy(), rtol=1e-5, atol=1e-5)
    assert y.sharding.spec == jax.sharding.PartitionSpec("x", None)
    assert {s.data.shape for s in y.addressable_shards} == {(SEQ // 8, D_MODEL)}
    ops = _collectives(lambda a, b, c: sequence_parallel_mlp(a, b, c, mesh), case["x"], case["w1"], case["w2"])
    assert ops["all-gather"] >= 1, ops  # the sequence gathered before the column layer


def test_a_mesh_of_two_axes_is_one_clear_line(case):
    with pytest.raises(ValueError, match=r"^mesh axes \('a', 'b'\) must be one TP axis"):
        collective_matmul(case["x"], case["w1"], make_mesh((2, 4), ("a", "b")))
