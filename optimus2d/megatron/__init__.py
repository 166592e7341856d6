"""Megatron's 1D tensor parallelism for one module of a model, on torch's ``parallelize_module``:
``parallelize(model, mesh, plan={path: Megatron(mesh)})`` (``region``), the split of each known
module class (``plans``: ``register_split`` teaches another), torch's ``nn.MultiheadAttention`` split
by heads (``attention``), and the boundary's all-gathers (``optimus2d.comm.whole``)."""

from optimus2d.megatron.attention import SplitMultiheadAttention
from optimus2d.megatron.plans import COLWISE, ROWWISE, SPLITS, register_split, split_of, tensor_parallel_plan
from optimus2d.megatron.region import Megatron, runs_split

__all__ = [
    "COLWISE",
    "ROWWISE",
    "SPLITS",
    "Megatron",
    "SplitMultiheadAttention",
    "register_split",
    "runs_split",
    "split_of",
    "tensor_parallel_plan",
]
