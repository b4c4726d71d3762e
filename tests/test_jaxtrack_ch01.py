"""Chapter 01's JAX section: `jax.checkpoint` policies on lab.measure.recompute's GELU block give torch's gradients
(same weights, fp32) under every policy, as torch.utils.checkpoint does; what each policy keeps differs as it should."""

import pytest

pytest.importorskip("jax")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from lab.jaxtrack.sim import simulated_devices  # noqa: E402
from lab.measure.recompute import Block, cotangent, example_input  # noqa: E402
from lab.measure.recompute import gradients as torch_gradients  # noqa: E402
from lab.measure.saved import saved_bytes  # noqa: E402

SHAPE = dict(batch=2, seq=5, d_model=12, d_ff=20, seed=3)


@pytest.fixture(scope="module")
def case():
    simulated_devices(8)
    from lab.jaxtrack import remat

    block = Block("gelu", SHAPE["d_model"], SHAPE["d_ff"], seed=SHAPE["seed"])
    x = example_input(SHAPE["batch"], SHAPE["seq"], SHAPE["d_model"], SHAPE["seed"])
    params = {name: value.detach().numpy() for name, value in block.state_dict().items()}
    return remat, block, x, params


def test_every_policy_gives_torchs_gradients(case):
    remat, block, x, params = case
    expected = torch_gradients(block, block, x, SHAPE["seed"])
    checkpointed = torch_gradients(lambda t: checkpoint(block, t, use_reentrant=False), block, x, SHAPE["seed"])
    assert checkpointed == expected  # torch's own recompute: bit for bit
    dy = cotangent((SHAPE["batch"], SHAPE["seq"], SHAPE["d_model"]), SHAPE["seed"]).numpy()
    for policy, got in remat.gradients(params, x.detach().numpy(), dy).items():
        assert set(got) == set(expected)
        for name, values in expected.items():
            np.testing.assert_allclose(got[name].ravel(), values, rtol=1e-5, atol=1e-5, err_msg=f"{policy}: {name}")


def test_what_each_policy_keeps(case):
    """nothing_saveable keeps the input alone, as torch's checkpoint does; dots_saveable adds W1's matmul output
    (W2's output feeds no backward); everything_saveable keeps as much as no remat at all."""
    remat, block, x, params = case
    tokens = SHAPE["batch"] * SHAPE["seq"] * 4
    kept = {policy: remat.activation_bytes(params, x.detach().numpy(), policy) for policy in remat.POLICIES}

    class TorchCheckpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, t):
            return checkpoint(self.block, t, use_reentrant=False)

    assert kept["nothing"] == tokens * SHAPE["d_model"] == saved_bytes(TorchCheckpointed(), x)
    assert kept["dots"] == kept["nothing"] + tokens * SHAPE["d_ff"]
    assert kept["everything"] == kept["none"] > kept["dots"]
    counts = {policy: len(remat.residuals(params, x.detach().numpy(), policy)) for policy in remat.POLICIES}
    assert counts["nothing"] < counts["dots"] < counts["everything"]


def test_an_unknown_policy_is_one_clear_line(case):
    remat, _, x, params = case
    with pytest.raises(ValueError, match="policy='some' must be one of 'none', 'nothing', 'dots', 'everything'"):
        remat.residuals(params, x.detach().numpy(), "some")
