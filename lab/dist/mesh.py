"""Where each rank sits in the 4-D grid of parallelisms, and one process group per axis.

The world is laid out as `arange(world).view(dp, pp, cp, tp)`: tensor parallelism innermost, so the ranks
of a TP group are neighbours — on a GPU cluster, GPUs of the same node, where the bandwidth that TP's
per-layer collectives need is. Then context, pipeline and data parallelism, which talk less often.

A rank's group along an axis is the line of the grid through it along that axis: e.g. its TP group
is every rank with the same (dp, pp, cp) coordinates. Expert parallelism reuses the dp x cp ranks (as
TorchTitan does): the EP groups are consecutive runs of `ep` ranks along the flattened (dp, cp) axes.

`layout` and `axis_groups` need no process group, so notebooks and widgets can draw the grid.
`Mesh` builds the groups inside an initialised process group; every rank must build the same mesh,
because `dist.new_group` must be called by all ranks, in the same order, for every group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

AXES = ("dp", "pp", "cp", "tp")


def _check(world_size: int, dp: int, pp: int, cp: int, tp: int, ep: int = 1) -> None:
    for name, value in zip(AXES + ("ep",), (dp, pp, cp, tp, ep), strict=True):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if dp * pp * cp * tp != world_size:
        raise ValueError(f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * pp * cp * tp} must equal world_size={world_size}")
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp}")


def layout(world_size: int, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1) -> torch.Tensor:
    """The grid: `layout(...)[d, p, c, t]` is the global rank with those coordinates."""
    _check(world_size, dp, pp, cp, tp)
    return torch.arange(world_size).view(dp, pp, cp, tp)


def axis_groups(world_size: int, axis: str, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1,
                ep: int = 1) -> list[list[int]]:
    """Every group along `axis` ("dp", "pp", "cp", "tp", "ep" or "dp_cp"), as lists of global ranks."""
    _check(world_size, dp, pp, cp, tp, ep)
    grid = layout(world_size, dp, pp, cp, tp)
    if axis in AXES:
        dim = AXES.index(axis)
        lines = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
        return lines.tolist()
    if axis in ("dp_cp", "ep"):
        # (dp, cp) flattened, for every (pp, tp): what gradients are averaged over when cp > 1
        lines = grid.permute(1, 3, 0, 2).reshape(pp * tp, dp * cp)
        if axis == "dp_cp":
            return lines.tolist()
        return lines.reshape(-1, ep).tolist()
    raise ValueError(f"axis={axis!r} must be one of 'dp', 'pp', 'cp', 'tp', 'ep', 'dp_cp'")


class Mesh:
    """This rank's coordinates and process groups for dp, pp, cp, tp, ep (and dp x cp).

    Built by every rank of an initialised default group, e.g. inside `lab.dist.run`:

        mesh = Mesh(dp=2, tp=2)
        dist.all_reduce(grad, group=mesh.dp_group)
    """

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1) -> None:
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.dp, self.pp, self.cp, self.tp, self.ep = dp, pp, cp, tp, ep
        _check(self.world_size, dp, pp, cp, tp, ep)
        self.grid = layout(self.world_size, dp, pp, cp, tp)
        coords = self.coords(self.rank)
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (coords[a] for a in AXES)
        groups = {}
        for axis in AXES + ("dp_cp", "ep"):
            for ranks in axis_groups(self.world_size, axis, dp, pp, cp, tp, ep):
                group = dist.new_group(ranks)  # collective: every rank creates every group
                if self.rank in ranks:
                    groups[axis] = (group, ranks)
        self._groups = groups
        self.dp_group, self.pp_group, self.cp_group, self.tp_group = (groups[a][0] for a in AXES)
        self.dp_cp_group, self.ep_group = groups["dp_cp"][0], groups["ep"][0]
        self.ep_rank = groups["ep"][1].index(self.rank)

    def device_mesh(self, device_type: str | None = None):
        """The same grid as a torch `DeviceMesh` (dims "dp", "pp", "cp", "tp"), to compare lab's
        implementations with DTensor, FSDP2 and `parallelize_module` on identical rank layouts."""
        from torch.distributed.device_mesh import DeviceMesh

        device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        return DeviceMesh(device_type, self.grid, mesh_dim_names=AXES)

    def coords(self, rank: int) -> dict[str, int]:
        index = (self.grid == rank).nonzero()[0].tolist()
        return dict(zip(AXES, index, strict=True))

    def rank_of(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return int(self.grid[dp, pp, cp, tp])

    def group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along `axis`."""
        return list(self._groups[axis][1])

    @property
    def pp_is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def pp_next_rank(self) -> int:
        return self.rank_of(self.dp_rank, (self.pp_rank + 1) % self.pp, self.cp_rank, self.tp_rank)

    @property
    def pp_prev_rank(self) -> int:
        return self.rank_of(self.dp_rank, (self.pp_rank - 1) % self.pp, self.cp_rank, self.tp_rank)

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}, ep={self.ep}) rank {self.rank}: "
                f"dp_rank={self.dp_rank} pp_rank={self.pp_rank} cp_rank={self.cp_rank} tp_rank={self.tp_rank} "
                f"ep_rank={self.ep_rank}")
