"""Communication on the mesh: the Mesh, collectives, SUMMA, scatter/gather and their accounting."""

from optimus2d.comm.counter import CommCounter, CommRecord, count_comm
from optimus2d.comm.functional import (
    all_gather,
    all_reduce,
    gather,
    reduce_grad,
    reduce_scatter,
    scatter,
    scatter_batch,
    sum_across,
)
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.redistribution import redistribute
from optimus2d.comm.sharding import Sharding, shard, unshard
from optimus2d.comm.stationary import stationary_ab, stationary_abt
from optimus2d.comm.summa import summa_ab, summa_abt, summa_atb

__all__ = [
    "CommCounter",
    "CommRecord",
    "Mesh",
    "Sharding",
    "all_gather",
    "all_reduce",
    "count_comm",
    "gather",
    "redistribute",
    "reduce_grad",
    "reduce_scatter",
    "scatter",
    "scatter_batch",
    "shard",
    "stationary_ab",
    "stationary_abt",
    "sum_across",
    "summa_ab",
    "summa_abt",
    "summa_atb",
    "unshard",
]
