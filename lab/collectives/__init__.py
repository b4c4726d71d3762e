"""Collectives written from point-to-point `isend`/`irecv` only, to compare with `torch.distributed`'s.

`ring` is bandwidth-optimal (large messages), `tree` latency-optimal (small ones); `pairwise` has the
root-based and all-to-all patterns. Every function takes an optional process group, like torch's.
"""

from lab.collectives.pairwise import all_to_all, barrier, gather, scatter
from lab.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from lab.collectives.tree import tree_all_reduce, tree_broadcast, tree_reduce

__all__ = ["all_to_all", "barrier", "gather", "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter", "scatter",
           "tree_all_reduce", "tree_broadcast", "tree_reduce"]
