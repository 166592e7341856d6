"""Communication on the mesh: the Mesh, collectives, SUMMA, scatter/gather and their accounting.

The modules import each other one way, lowest first: ``compat``, ``counter``, ``watch`` <
``traced`` (the operators' calls while dynamo traces) < ``agreement`` < ``replicas`` < ``mesh``
(``mpi`` when a mesh uses it) < ``primitives`` < ``compiled`` (the ``optimus2d::`` operators,
imported here so they exist before any compile) and ``sharding`` < ``functional``,
``redistribution``, ``stationary``, ``summa``.
"""

from optimus2d.comm import (
    compiled,  # noqa: F401  (registers the optimus2d:: operators)
    grad_scaler,
)
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
from optimus2d.comm.sequence import gather_sequence, scatter_sequence, scatter_sequence_batch, sequence_sharding
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
    "gather_sequence",
    "redistribute",
    "reduce_grad",
    "reduce_scatter",
    "scatter",
    "scatter_batch",
    "scatter_sequence",
    "scatter_sequence_batch",
    "sequence_sharding",
    "shard",
    "stationary_ab",
    "stationary_abt",
    "sum_across",
    "summa_ab",
    "summa_abt",
    "summa_atb",
    "unshard",
]

grad_scaler.install()  # GradScaler: found_inf over the whole mesh (every rank skips alike)
