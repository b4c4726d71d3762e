"""Ranks, process groups and collective accounting: everything `lab` needs from a cluster.

`run` starts local ranks (notebooks, tests, the grader, `--nproc`), and starts them again after a failure
(`max_restarts`); under torchrun `init_from_env` joins the launched group instead. `restarts` says which
attempt a rank runs in, under either launcher. `Mesh` lays ranks out on the dp x pp x cp x tp grid and builds a
process group per axis; `count_collectives` counts the calls and bytes of every collective (`all_gather_single` and
`reduce_scatter_single` call torch's current names, or on torch < 2.13 the old ones); `flight` keeps each
rank's recent collectives, to say where hung ranks diverged; `health` finds a straggler among the ranks' step times
and compares data-parallel replicas by checksum (silent data corruption); `slurm` writes the sbatch script of a
multi-node run (and a job array for `lab sweep`).
This package knows nothing of the techniques built on it: it imports torch, and from `lab` only `lab.config`
(slurm's layout check).
"""

from lab.distributed.comm import (
    CollectiveCounts,
    OpCounts,
    all_gather_single,
    count_collectives,
    reduce_scatter_single,
)
from lab.distributed.launch import RankError, RankTimeout, init_from_env, launched_by_torchrun, restarts, run
from lab.distributed.mesh import Mesh, axis_groups, layout

__all__ = ["CollectiveCounts", "Mesh", "OpCounts", "RankError", "RankTimeout", "all_gather_single", "axis_groups",
           "count_collectives", "init_from_env", "launched_by_torchrun", "layout", "reduce_scatter_single", "restarts",
           "run"]
