"""Ranks, process groups and collective accounting: everything `lab` needs from a cluster.

`run` starts local ranks (notebooks, tests, the grader, `--nproc`), and starts them again after a failure
(`max_restarts`); under torchrun `init_from_env` joins the launched group instead. `restarts` says which
attempt a rank runs in, under either launcher. `Mesh` lays ranks out on the dp x pp x cp x tp grid and builds a
process group per axis; `count_collectives` counts the calls and bytes of every collective; `flight` keeps each
rank's recent collectives, to say where hung ranks diverged; `slurm` writes the sbatch script of a multi-node run.
This package knows nothing of the techniques built on it: it imports torch, and from `lab` only `lab.config`
(slurm's layout check).
"""

import warnings

from lab.distributed.comm import CollectiveCounts, OpCounts, count_collectives
from lab.distributed.launch import RankError, RankTimeout, init_from_env, launched_by_torchrun, restarts, run
from lab.distributed.mesh import Mesh, axis_groups, layout

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns on every call. The
# course keeps the old names: they are what torch 2.5-2.12 and almost every codebase in the field use.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                        r"is deprecated", category=FutureWarning)

__all__ = ["CollectiveCounts", "Mesh", "OpCounts", "RankError", "RankTimeout", "axis_groups", "count_collectives",
           "init_from_env", "launched_by_torchrun", "layout", "restarts", "run"]
