"""Chapter 05's JAX section: ring attention with ppermute inside shard_map over 8 simulated devices equals lab's
PyTorch attention on the same inputs (causal and not), its compiled program passes K/V with collective-permutes
(no all-gather), and a ring with a planted bug — the mask left out, the blocks sent the wrong way — does not."""

import inspect

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lab.jaxtrack.ring_attention as jax_ring  # noqa: E402
from lab.jaxtrack.sim import collectives_in, make_mesh, simulated_devices  # noqa: E402
from lab.model import causal_attention  # noqa: E402

SHAPE = (2, 3, 40, 8)  # B, H, T (5 tokens on each of 8 devices), D


@pytest.fixture(scope="module")
def case():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    simulated_devices(8)
    mesh = make_mesh((8,), ("x",))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SHAPE, generator=g) for _ in range(3))
    sharded = [jax.device_put(jax.numpy.asarray(t.numpy()), NamedSharding(mesh, P(None, None, "x", None)))
               for t in (q, k, v)]
    return {"mesh": mesh, "torch": (q, k, v), "jax": sharded}


def _compiled(module, case, causal):
    mesh = case["mesh"]
    return jax.jit(lambda q, k, v: module.ring_attention(q, k, v, mesh, causal)).lower(*case["jax"]).compile()


def _ring(module, case, causal):
    return np.asarray(_compiled(module, case, causal)(*case["jax"]))


@pytest.fixture(scope="module")
def causal_ring(case):
    """The causal ring compiled once: run by one test, its HLO read by another."""
    return _compiled(jax_ring, case, True)


def test_causal_ring_attention_equals_lab_attention(case, causal_ring):
    got = np.asarray(causal_ring(*case["jax"]))
    np.testing.assert_allclose(got, causal_attention(*case["torch"]).numpy(), rtol=1e-5, atol=1e-5)


def test_ring_attention_without_a_mask_equals_torch_attention(case):
    q, k, v = case["torch"]
    expected = F.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(_ring(jax_ring, case, False), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_the_ring_passes_kv_with_collective_permutes(causal_ring):
    ops = collectives_in(causal_ring)
    assert ops["collective-permute"] >= 7 and not ops["all-gather"] and not ops["all-to-all"], ops  # n − 1 steps


def _planted(old: str, new: str):
    """The module with one bug planted: its source with `old` replaced, run as a new module."""
    source = inspect.getsource(jax_ring)
    assert source.count(old) == 1, old
    namespace = {"__name__": "planted_ring_attention"}
    exec(compile(source.replace(old, new), "planted_ring_attention", "exec"), namespace)  # noqa: S102
    return type("Planted", (), {"ring_attention": staticmethod(namespace["ring_attention"])})


@pytest.mark.parametrize("old, new", [
    ("            if causal:  # global", "            if False:  # global"),  # the mask left out
    ("to_next = [(j, (j + 1) % n)", "to_next = [(j, (j - 1) % n)"),  # blocks sent to the previous device
])
def test_a_planted_bug_is_caught(case, old, new):
    q, k, v = case["torch"]
    got = _ring(_planted(old, new), case, causal=True)
    assert not np.allclose(got, causal_attention(q, k, v).numpy(), rtol=1e-5, atol=1e-5)


def test_a_mesh_of_two_axes_is_one_clear_line(case):
    with pytest.raises(ValueError, match=r"^mesh axes \('a', 'b'\) must be one CP axis"):
        jax_ring.ring_attention(*case["jax"], make_mesh((2, 4), ("a", "b")))
