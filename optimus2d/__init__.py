"""optimus2d: 2D (Optimus) and 2.5D (Tesseract) tensor parallelism for PyTorch.

Parameters *and* activations are split over a q×q mesh of ranks (``depth`` of them stacked for
2.5D); matrix products run as SUMMA. See docs/DESIGN.md for which block every rank holds, and
docs/ARCHITECTURE.md for where each part lives:

    comm/        the Mesh, collectives, SUMMA, redistribution, agreement between ranks
    layers/      the sharded modules (Linear2D, Embedding2D, norms, attention, the loss)
    convert/     parallelize, the converter registry, the forward judge, per-module layouts
    megatron/    a module with Megatron's 1D tensor parallelism (plan value, on parallelize_module)
    families/    converters for Hugging Face and timm models
    checkpoint/  save/load on any mesh, the serial view, Hugging Face safetensors
    pipeline/    stages, torch's schedules, data-parallel copies, bubbles, stage models
    cost/        the cost model: bytes, memory, step time, layout proposals

The top holds what a training script writes; converter authors use ``optimus2d.convert``; fault
handling is ``optimus2d.faults``.
"""

from optimus2d import _deprecated, checkpoint, comm, convert, cost, families, faults, layers, megatron, pipeline
from optimus2d.checkpoint import load_pretrained, load_serial_state_dict, save_pretrained, serial_state_dict
from optimus2d.comm import Mesh, count_comm, gather, redistribute, scatter, scatter_batch
from optimus2d.comm.dtensor import parameters_in_graph
from optimus2d.comm.rng import shard_rng
from optimus2d.convert import Auto, materialize, parallelize
from optimus2d.launch import World, init, shutdown
from optimus2d.layers import cross_entropy
from optimus2d.training import clip_grad_norm_

__version__ = "0.1.0"

__all__ = [
    "Auto",
    "Mesh",
    "World",
    "__version__",
    "checkpoint",
    "clip_grad_norm_",
    "comm",
    "convert",
    "cost",
    "count_comm",
    "cross_entropy",
    "families",
    "faults",
    "gather",
    "init",
    "layers",
    "load_pretrained",
    "load_serial_state_dict",
    "materialize",
    "megatron",
    "parallelize",
    "parameters_in_graph",
    "pipeline",
    "redistribute",
    "save_pretrained",
    "scatter",
    "scatter_batch",
    "serial_state_dict",
    "shard_rng",
    "shutdown",
]

_deprecated.install()


def __getattr__(name: str):  # the names of release 0.1 that left the top: optimus2d.Linear2D, ...
    return _deprecated.top_attribute(name)
