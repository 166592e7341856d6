"""Communication on the mesh: the Mesh, collectives, SUMMA, scatter/gather and their accounting."""

from optimus2d.comm.counter import CommCounter, CommRecord, count_comm
from optimus2d.comm.functional import all_reduce, gather, reduce_grad, scatter, scatter_batch
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, shard, unshard
from optimus2d.comm.summa import summa_ab, summa_abt, summa_atb

__all__ = [
    "CommCounter",
    "CommRecord",
    "Mesh",
    "Sharding",
    "all_reduce",
    "count_comm",
    "gather",
    "reduce_grad",
    "scatter",
    "scatter_batch",
    "shard",
    "summa_ab",
    "summa_abt",
    "summa_atb",
    "unshard",
]
