"""The 4-D rank grid: layouts checked by hand, and real groups on 4 ranks."""

import pytest
import torch
import torch.distributed as dist

from lab.dist import Mesh, axis_groups, layout, run


def test_layouts_by_hand():
    # 8 ranks as dp=2 x tp=4: TP groups are runs of 4 neighbours
    assert axis_groups(8, "tp", dp=2, tp=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert axis_groups(8, "dp", dp=2, tp=4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # dp=2 x pp=2 x tp=2
    assert axis_groups(8, "tp", dp=2, pp=2, tp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(8, "pp", dp=2, pp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(8, "dp", dp=2, pp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # pp=2 x cp=2 x tp=2
    assert axis_groups(8, "cp", pp=2, cp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(8, "pp", pp=2, cp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # dp=2 x cp=2 x tp=2: gradients average over dp x cp; ep=2 borrows from it
    assert axis_groups(8, "dp_cp", dp=2, cp=2, tp=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert axis_groups(8, "ep", dp=2, cp=2, tp=2, ep=2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout(8, dp=2, pp=2, tp=2)[1, 0, 0, 1] == 5


@pytest.mark.parametrize("degrees, message", [
    (dict(dp=2, tp=2), "dp*pp*cp*tp = 2*1*1*2 = 4 must equal world_size=8"),
    (dict(dp=0, tp=8), "dp=0 must be an integer >= 1"),
    (dict(dp=2, tp=4, ep=4), "ep=4 must divide dp*cp = 2*1 = 2"),
])
def test_bad_degrees(degrees, message):
    with pytest.raises(ValueError) as err:
        axis_groups(8, "tp", **degrees)
    assert str(err.value) == message


def _groups_on_real_ranks():
    mesh = Mesh(dp=2, tp=2)
    sums = {}
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        value = torch.tensor([float(mesh.rank)])
        dist.all_reduce(value, group=getattr(mesh, f"{axis}_group"))
        sums[axis] = value.item()
    return mesh.coords(mesh.rank), sums, mesh.group_ranks("tp"), repr(mesh)


def test_groups_on_four_ranks():
    results = run(_groups_on_real_ranks, 4)
    for rank, (coords, sums, tp_ranks, text) in enumerate(results):
        assert coords == {"dp": rank // 2, "pp": 0, "cp": 0, "tp": rank % 2}
        assert sums["tp"] == {0: 1, 1: 1, 2: 5, 3: 5}[rank]  # TP pairs (0,1) and (2,3)
        assert sums["dp"] == {0: 2, 1: 4, 2: 2, 3: 4}[rank]  # DP pairs (0,2) and (1,3)
        assert sums["pp"] == sums["cp"] == sums["ep"] == rank  # groups of one
        assert tp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
        assert f"rank {rank}: dp_rank={rank // 2}" in text


def _device_mesh_agrees():
    mesh = Mesh(dp=2, tp=2)
    device_mesh = mesh.device_mesh()
    return device_mesh["tp"].mesh.tolist() == mesh.group_ranks("tp"), device_mesh["dp"].get_local_rank() == mesh.dp_rank


def test_device_mesh_has_the_same_layout():
    assert run(_device_mesh_agrees, 4) == [(True, True)] * 4


def _pipeline_neighbours():
    mesh = Mesh(pp=4)
    return mesh.pp_is_first, mesh.pp_is_last, mesh.pp_prev_rank, mesh.pp_next_rank


def test_pipeline_neighbours():
    assert run(_pipeline_neighbours, 4) == [(True, False, 3, 1), (False, False, 0, 2), (False, False, 1, 3),
                                             (False, True, 2, 0)]


def test_mesh_must_cover_the_world():
    with pytest.raises(Exception, match="dp\\*pp\\*cp\\*tp = 1\\*1\\*1\\*2 = 2 must equal world_size=4"):
        run(lambda: Mesh(tp=2), 4)
