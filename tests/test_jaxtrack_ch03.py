"""Chapter 03's JAX section: FSDP with weights sharded P('x') over 8 simulated devices gives the loss and the
gradients of lab's PyTorch FeedForward on the same weights and tokens, and its compiled program gathers the
weights and reduce-scatters their gradients."""

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lab.jaxtrack.fsdp import compiled_collectives, fsdp_step  # noqa: E402
from lab.jaxtrack.sim import make_mesh, simulated_devices  # noqa: E402
from lab.model import FeedForward  # noqa: E402

D_MODEL, D_FF, TOKENS = 16, 40, 24  # every dimension a multiple of 8 devices


@pytest.fixture(scope="module")
def case():
    simulated_devices(8)
    torch.manual_seed(0)
    ff = FeedForward(D_MODEL, D_FF)
    x, y = torch.randn(TOKENS, D_MODEL), torch.randn(TOKENS, D_MODEL)
    loss = F.mse_loss(ff(x), y)
    loss.backward()
    params = {name: jax.numpy.asarray(getattr(ff, name).weight.detach().numpy()) for name in ("w1", "w3", "w2")}
    grads = {name: getattr(ff, name).weight.grad.numpy() for name in ("w1", "w3", "w2")}
    mesh = make_mesh((8,), ("x",))
    return {"mesh": mesh, "args": (params, jax.numpy.asarray(x.numpy()), jax.numpy.asarray(y.numpy())),
            "loss": loss.item(), "grads": grads}


def test_fsdp_loss_and_gradients_equal_pytorch(case):
    step = fsdp_step(case["mesh"])
    loss, grads = step(*case["args"])
    assert float(loss) == pytest.approx(case["loss"], rel=1e-5)
    for name, want in case["grads"].items():
        np.testing.assert_allclose(np.asarray(grads[name]), want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert grads[name].sharding.spec == jax.sharding.PartitionSpec("x"), name  # each device keeps its rows
        assert {s.data.shape for s in grads[name].addressable_shards} == {(want.shape[0] // 8, want.shape[1])}


def test_the_compiled_step_gathers_weights_and_reduce_scatters_gradients(case):
    ops = compiled_collectives(fsdp_step(case["mesh"]), *case["args"])
    assert ops["all-gather"] == 3 and ops["reduce-scatter"] == 3, ops  # one each per weight
    assert ops["all-reduce"] == 1, ops  # the loss's pmean only: no gradient is all-reduced


def test_a_replicated_weight_is_all_reduced_not_reduce_scattered(case):
    # plain data parallelism for w2: the same numbers, other collectives (the test above fails on this program)
    step = fsdp_step(case["mesh"], sharded=("w1", "w3"))
    loss, grads = step(*case["args"])
    np.testing.assert_allclose(np.asarray(grads["w2"]), case["grads"]["w2"], rtol=1e-5, atol=1e-6)
    ops = compiled_collectives(step, *case["args"])
    assert ops["all-gather"] == 2 and ops["reduce-scatter"] == 2 and ops["all-reduce"] >= 1, ops
