"""Where each rank sits in the 4-D grid of parallelisms, and one process group per axis.

The world is laid out as `arange(world).view(dp, pp, cp, tp)`: tensor parallelism innermost, so the ranks
of a TP group are neighbours — on a GPU cluster, GPUs of the same node, where the bandwidth that TP's
per-layer collectives need is. Then context, pipeline and data parallelism, which talk less often.

A rank's group along an axis is the line of the grid through it along that axis: e.g. its TP group
is every rank with the same (dp, pp, cp) coordinates. Two more groups are built from the same grid:

- dp_cp: the dp x cp ranks with this rank's (pp, tp). Context parallelism splits the sequence, so each CP
  rank holds gradients of a different part of the batch: gradients are averaged over dp x cp, not dp.
- ep: expert parallelism reuses the dp x cp ranks (as TorchTitan does) rather than adding an axis: the EP
  groups are consecutive runs of `ep` ranks along the flattened (dp, cp) axes, at fixed (pp, tp); ep_dp
  groups take the rank at the same place in every EP group (they hold the same experts).

`layout` and `axis_groups` need no process group, so notebooks and widgets can draw the grid.
`Mesh` builds the groups inside an initialised process group; every rank must build the same mesh,
because `dist.new_group` must be called by every rank, in the same order, for every group (also for the
groups the rank is not in): that is how ranks agree on which group is which.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lab.layout import AXES, check_mesh

GROUPS = AXES + ("dp_cp", "ep", "ep_dp")


def layout(world_size: int, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1) -> torch.Tensor:
    """The grid: `layout(...)[d, p, c, t]` is the global rank with those coordinates (`lab.layout.strides`)."""
    check_mesh(world_size, dp, pp, cp, tp)
    return torch.arange(world_size).view(dp, pp, cp, tp)


def axis_groups(world_size: int, axis: str, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1,
                ep: int = 1) -> list[list[int]]:
    """Every group along `axis` ("dp", "pp", "cp", "tp", "dp_cp", "ep" or "ep_dp"), as lists of global ranks, in the
    order `Mesh` creates them. E.g. `axis_groups(8, "tp", dp=2, tp=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]`."""
    check_mesh(world_size, dp, pp, cp, tp, ep)
    grid = layout(world_size, dp, pp, cp, tp)
    if axis in AXES:
        dim = AXES.index(axis)
        return grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
    if axis in ("dp_cp", "ep", "ep_dp"):
        dp_cp = grid.permute(1, 3, 0, 2).reshape(pp * tp, dp * cp)  # one row of dp x cp ranks per (pp, tp)
        if axis == "dp_cp":
            return dp_cp.tolist()
        ep_groups = dp_cp.reshape(pp * tp, -1, ep)  # consecutive runs of ep ranks
        # ep_dp: the ranks holding the same experts, one from each EP group
        return (ep_groups.reshape(-1, ep) if axis == "ep" else ep_groups.transpose(1, 2).reshape(-1, dp * cp // ep)
                ).tolist()
    raise ValueError(f"axis={axis!r} must be one of {', '.join(map(repr, GROUPS))}")


def _world_timeout() -> timedelta | None:
    """The collective timeout the world group was made with, for every group the mesh makes: `new_group` would give
    each torch's default instead (30 min on gloo, 10 on NCCL), so a rank missing from a dp or tp collective would
    keep the others waiting that long, whatever `pg_timeout_s` or `--collective-timeout` said. None (torch's
    default) for a backend without options, such as the dry run's fake group."""
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    return getattr(getattr(dist.group.WORLD._get_backend(device), "options", None), "_timeout", None)


class Mesh:
    """This rank's coordinates and process groups for dp, pp, cp, tp, ep (and dp x cp).

    Built by every rank of an initialised default group, e.g. inside `lab.distributed.run`:

        mesh = Mesh(dp=2, tp=2)
        dist.all_reduce(grad, group=mesh.dp_group)
    """

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs an initialised process group: build it inside lab.distributed.run "
                               "(or after lab.distributed.init_from_env under torchrun)")
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.dp, self.pp, self.cp, self.tp, self.ep = dp, pp, cp, tp, ep
        check_mesh(self.world_size, dp, pp, cp, tp, ep)
        self.grid = layout(self.world_size, dp, pp, cp, tp)
        coords = self.coords(self.rank)
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (coords[a] for a in AXES)
        self._groups: dict[str, tuple[dist.ProcessGroup, list[int]]] = {}
        for axis in GROUPS:
            for ranks in axis_groups(self.world_size, axis, dp, pp, cp, tp, ep):
                # collective: every rank creates every group, in this order. The name shows in torch's and
                # lab's flight recorders ("all_reduce #41 on tp group")
                group = dist.new_group(ranks, group_desc=axis, timeout=_world_timeout())
                if self.rank in ranks:
                    self._groups[axis] = (group, ranks)
        (self.dp_group, self.pp_group, self.cp_group, self.tp_group, self.dp_cp_group, self.ep_group,
         self.ep_dp_group) = (self._groups[axis][0] for axis in GROUPS)
        self.ep_rank = self._groups["ep"][1].index(self.rank)
        self._device_mesh: DeviceMesh | None = None

    def coords(self, rank: int) -> dict[str, int]:
        """{"dp": d, "pp": p, "cp": c, "tp": t} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} must be in [0, {self.world_size})")
        index = (self.grid == rank).nonzero()[0].tolist()
        return dict(zip(AXES, index, strict=True))

    def rank_of(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates."""
        return int(self.grid[dp, pp, cp, tp])

    def group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along `axis` (one of GROUPS)."""
        if axis not in self._groups:
            raise ValueError(f"axis={axis!r} must be one of {', '.join(map(repr, GROUPS))}")
        return list(self._groups[axis][1])

    @property
    def pp_is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the next pipeline stage. Wraps around (the last stage's next is the first), as
        interleaved schedules need when a micro-batch moves on to the next chunk of layers."""
        return self.rank_of(self.dp_rank, (self.pp_rank + 1) % self.pp, self.cp_rank, self.tp_rank)

    @property
    def pp_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around like `pp_next_rank`)."""
        return self.rank_of(self.dp_rank, (self.pp_rank - 1) % self.pp, self.cp_rank, self.tp_rank)

    def device_mesh(self) -> DeviceMesh:
        """The same grid as a torch `DeviceMesh` with dims named dp, pp, cp, tp, to compare with DTensor and
        FSDP2 (`fully_shard(model, mesh=mesh.device_mesh()["dp"])`). Built on first call — by every rank,
        as it creates process groups — then reused."""
        if self._device_mesh is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
            self._device_mesh = DeviceMesh(device_type, self.grid, mesh_dim_names=AXES)
        return self._device_mesh

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}, ep={self.ep}) rank {self.rank}: "
                f"dp_rank={self.dp_rank} pp_rank={self.pp_rank} cp_rank={self.cp_rank} tp_rank={self.tp_rank} "
                f"ep_rank={self.ep_rank}")
