"""Sharding notation, the four sharded-matmul cases, and their execution on real ranks."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from lab.calc.sharding import block_owners, local_shape, matmul_plan, notation  # noqa: E402
from lab.widgets.sharding import draw_matmul, draw_sharded, run_matmul_case  # noqa: E402

MESH = {"X": 2, "Y": 4}


def test_notation_and_local_shapes():
    assert notation("A", ("I", "J"), ("X", None)) == "A[I_X, J]"
    assert notation("B", ("J", "K"), (None, None)) == "B[J, K]"
    assert local_shape((128, 2048), ("X", "Y"), MESH) == (64, 512)
    assert local_shape((128, 2048), (None, "Y"), MESH) == (128, 512)
    with pytest.raises(ValueError, match="twice"):
        local_shape((8, 8), ("X", "X"), MESH)
    with pytest.raises(ValueError, match="not divisible"):
        local_shape((6, 8), ("Y", None), MESH)
    with pytest.raises(ValueError, match="not in the mesh"):
        block_owners(("Z", None), MESH)


def test_block_owners_replicate_over_unused_axes():
    # A[I_X, J] on {X: 2, Y: 4}: two row blocks, each held by the 4 devices of one X coordinate
    assert block_owners(("X", None), MESH) == {(0, 0): [0, 1, 2, 3], (1, 0): [4, 5, 6, 7]}
    # A[I_X, J_Y]: 8 blocks, one device each
    owners = block_owners(("X", "Y"), MESH)
    assert len(owners) == 8 and sorted(d for held in owners.values() for d in held) == list(range(8))
    assert block_owners((None, None), MESH) == {(0, 0): list(range(8))}


@pytest.mark.parametrize(("a", "b", "case", "collectives", "out"), [
    (("X", None), (None, "Y"), 1, (), ("X", "Y")),
    ((None, None), (None, "X"), 1, (), (None, "X")),  # column-parallel linear
    ((None, "X"), (None, None), 2, ("all-gather A over X along J",), (None, None)),
    (("X", None), ("Y", None), 2, ("all-gather B over Y along J",), ("X", None)),
    ((None, "X"), ("Y", None), 2, ("all-gather A over X along J", "all-gather B over Y along J"), (None, None)),
    ((None, "X"), ("X", None), 3, ("all-reduce C over X",), (None, None)),  # row-parallel linear
    (("X", None), (None, "X"), 4, ("all-gather A over X along I",), (None, "X")),
])
def test_matmul_cases(a, b, case, collectives, out):
    plan = matmul_plan(a, b, MESH)
    assert (plan.case, plan.collectives, plan.out) == (case, collectives, out)
    assert f"case {case}" in plan.describe()


def test_case_3_can_reduce_scatter_instead():
    plan = matmul_plan((None, "X"), ("X", None), reduce_scatter=True)
    assert plan.after == ("reduce-scatter C over X along K",) and plan.out == (None, "X")
    with pytest.raises(ValueError, match="two dimensions"):
        matmul_plan(("X", "X"), ("X", None))


def test_pictures_draw_every_block():
    ax = draw_sharded(("X", "Y"), MESH, shape=(8, 8))
    assert len(ax.patches) == 8 and "A[I_X, J_Y]" in ax.get_title() and "(4, 2)" in ax.get_title()
    fig = draw_matmul((None, "X"), ("X", None), {"X": 4})
    assert "case 3" in fig._suptitle.get_text() and "all-reduce" in fig._suptitle.get_text()
    plt.close("all")


@pytest.mark.parametrize(("a", "b", "calls"), [
    ((None, None), (None, "X"), {}),
    ((None, "X"), (None, None), {"all_gather": 1}),
    ((None, "X"), ("X", None), {"all_reduce": 1}),
    (("X", None), (None, "X"), {"all_gather": 1}),
])
def test_cases_on_real_ranks_equal_the_full_product(a, b, calls):
    plan = matmul_plan(a, b, {"X": 2})
    for result in run_matmul_case(a, b, world_size=2):
        assert result["max_error"] < 1e-5
        assert result["calls"] == calls
        assert result["local_c"] == local_shape((8, 16), plan.out, {"X": 2})


def test_reduce_scatter_on_real_ranks():
    results = run_matmul_case((None, "X"), ("X", None), world_size=2, reduce_scatter=True)
    for result in results:
        assert result["max_error"] < 1e-5 and result["calls"] == {"reduce_scatter_single": 1}
        assert result["local_c"] == (8, 8)
