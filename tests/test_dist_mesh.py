"""The 4-D rank grid: layouts checked by hand for 8 ranks, and real groups on 4 ranks."""

import pytest
import torch
import torch.distributed as dist

from lab.distributed import Mesh, axis_groups, layout, run


def test_dp2_tp4_by_hand():
    # ranks 0-3 are one TP group (neighbours), 4-7 the other; DP pairs the same TP position
    assert layout(8, dp=2, tp=4).flatten(1, 2).tolist() == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert axis_groups(8, "tp", dp=2, tp=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert axis_groups(8, "dp", dp=2, tp=4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(8, "pp", dp=2, tp=4) == [[r] for r in range(8)]
    assert axis_groups(8, "cp", dp=2, tp=4) == [[r] for r in range(8)]
    assert axis_groups(8, "dp_cp", dp=2, tp=4) == axis_groups(8, "dp", dp=2, tp=4)


def test_dp2_pp2_tp2_by_hand():
    grid = layout(8, dp=2, pp=2, tp=2)  # rank = 4*dp + 2*pp + tp
    assert grid[1, 0, 0, 1] == 5 and grid[0, 1, 0, 0] == 2
    assert axis_groups(8, "tp", dp=2, pp=2, tp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(8, "pp", dp=2, pp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(8, "dp", dp=2, pp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(8, "ep", dp=2, pp=2, tp=2, ep=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pp2_cp2_tp2_by_hand():
    grid = layout(8, pp=2, cp=2, tp=2)  # rank = 4*pp + 2*cp + tp
    assert grid[0, 1, 1, 0] == 6
    assert axis_groups(8, "tp", pp=2, cp=2, tp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(8, "cp", pp=2, cp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(8, "pp", pp=2, cp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(8, "dp", pp=2, cp=2, tp=2) == [[r] for r in range(8)]
    # gradients are averaged over dp x cp: here the CP pairs
    assert axis_groups(8, "dp_cp", pp=2, cp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_expert_groups_borrow_from_dp_times_cp():
    # dp=2 x cp=2 x tp=2: dp x cp at fixed tp is [0, 2, 4, 6] and [1, 3, 5, 7]; ep=2 cuts each in runs of 2
    assert axis_groups(8, "dp_cp", dp=2, cp=2, tp=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert axis_groups(8, "ep", dp=2, cp=2, tp=2, ep=2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert axis_groups(8, "ep", dp=2, cp=2, tp=2, ep=4) == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("degrees, message", [
    (dict(dp=2, tp=2), "dp*pp*cp*tp = 2*1*1*2 = 4 must equal world_size=8"),
    (dict(dp=0, tp=8), "dp=0 must be an integer >= 1"),
    (dict(dp=2, tp=4, ep=4), "ep=4 must divide dp*cp = 2*1 = 2"),
])
def test_bad_degrees_are_one_clear_line(degrees, message):
    with pytest.raises(ValueError) as err:
        axis_groups(8, "tp", **degrees)
    assert str(err.value) == message


def test_unknown_axis():
    with pytest.raises(ValueError, match="axis='xp' must be one of 'dp', 'pp', 'cp', 'tp', 'dp_cp', 'ep'"):
        axis_groups(8, "xp", dp=8)


def _sum_of_ranks_over_each_group(mesh: Mesh) -> dict[str, float]:
    sums = {}
    for axis in ("dp", "pp", "cp", "tp", "dp_cp", "ep"):
        value = torch.tensor([float(mesh.rank)])
        dist.all_reduce(value, group=getattr(mesh, f"{axis}_group"))
        sums[axis] = value.item()
    return sums


def _two_meshes_on_four_ranks():
    dp_tp = Mesh(dp=2, tp=2)
    dp_cp = Mesh(dp=2, cp=2, ep=2)  # every rank builds both meshes, in the same order
    device_mesh = dp_tp.device_mesh()
    tp_sum = torch.tensor([float(dp_tp.rank)])
    dist.all_reduce(tp_sum, group=device_mesh.get_group("tp"))
    return {
        "coords": dp_tp.coords(dp_tp.rank), "sums": _sum_of_ranks_over_each_group(dp_tp),
        "tp_ranks": dp_tp.group_ranks("tp"), "repr": repr(dp_tp),
        "device_mesh_tp_sum": tp_sum.item(), "device_mesh_dp": device_mesh["dp"].mesh.tolist(),
        "cp_coords": dp_cp.coords(dp_cp.rank), "cp_sums": _sum_of_ranks_over_each_group(dp_cp),
        "ep_rank": dp_cp.ep_rank,
    }


def test_groups_on_four_real_ranks():
    for rank, got in enumerate(run(_two_meshes_on_four_ranks, 4)):
        # dp=2 x tp=2: TP pairs (0, 1) and (2, 3); DP pairs (0, 2) and (1, 3)
        assert got["coords"] == {"dp": rank // 2, "pp": 0, "cp": 0, "tp": rank % 2}
        assert got["sums"]["tp"] == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
        assert got["sums"]["dp"] == got["sums"]["dp_cp"] == {0: 2, 1: 4, 2: 2, 3: 4}[rank]
        assert got["sums"]["pp"] == got["sums"]["cp"] == got["sums"]["ep"] == rank  # groups of one
        assert got["tp_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert f"rank {rank}: dp_rank={rank // 2} pp_rank=0 cp_rank=0 tp_rank={rank % 2}" in got["repr"]
        # the DeviceMesh built from the same grid has the same groups
        assert got["device_mesh_tp_sum"] == got["sums"]["tp"]
        assert got["device_mesh_dp"] == [rank % 2, rank % 2 + 2]
        # dp=2 x cp=2: CP pairs (0, 1), (2, 3); gradients over all four; EP pairs (0, 1), (2, 3)
        assert got["cp_coords"] == {"dp": rank // 2, "pp": 0, "cp": rank % 2, "tp": 0}
        assert got["cp_sums"]["cp"] == got["cp_sums"]["ep"] == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
        assert got["cp_sums"]["dp_cp"] == 6
        assert got["ep_rank"] == rank % 2


def _pipeline_neighbours():
    mesh = Mesh(pp=4)
    return mesh.pp_is_first, mesh.pp_is_last, mesh.pp_prev_rank, mesh.pp_next_rank, mesh.rank_of(pp=2)


def test_pipeline_neighbours_wrap_around():
    assert run(_pipeline_neighbours, 4) == [(True, False, 3, 1, 2), (False, False, 0, 2, 2),
                                             (False, False, 1, 3, 2), (False, True, 2, 0, 2)]


def test_mesh_must_cover_the_world():
    with pytest.raises(RuntimeError, match=r"ValueError: dp\*pp\*cp\*tp = 1\*1\*1\*2 = 2 must equal world_size=4"):
        run(lambda: Mesh(tp=2), 4)


def test_mesh_needs_a_process_group():
    assert not dist.is_initialized()  # tests start ranks with run(); the test process never joins a group
    with pytest.raises(RuntimeError, match="Mesh needs an initialised process group"):
        Mesh(dp=1)
