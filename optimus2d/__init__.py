"""optimus2d: 2D (Optimus) and 2.5D (Tesseract) tensor parallelism for PyTorch.

Parameters *and* activations are split over a q×q mesh of ranks (``depth`` of them stacked for
2.5D); matrix products run as SUMMA. See docs/DESIGN.md for which block every rank holds.
"""

from optimus2d import blockwise, checkpoint
from optimus2d.blockwise import as_norm, forward_problems
from optimus2d.comm import Mesh, count_comm, gather, redistribute, scatter, scatter_batch
from optimus2d.comm.watch import PeerFailedError
from optimus2d.launch import World, init, report_failure, shutdown
from optimus2d.layers import (
    MLP2D,
    Dropout2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    MultiheadAttention2D,
    RMSNorm2D,
    TransformerBlock2D,
    cross_entropy,
)
from optimus2d.meta_init import materialize
from optimus2d.parallelize import convert_children, keep, parallelize, register_converter, register_recogniser
from optimus2d.pretrained import load_pretrained, save_pretrained
from optimus2d.random import shard_rng
from optimus2d.serial import load_serial_state_dict, serial_state_dict
from optimus2d.training import clip_grad_norm_

__version__ = "0.1.0"

__all__ = [
    "MLP2D",
    "Dropout2D",
    "Embedding2D",
    "LayerNorm2D",
    "Linear2D",
    "Mesh",
    "MultiheadAttention2D",
    "PeerFailedError",
    "RMSNorm2D",
    "TransformerBlock2D",
    "World",
    "__version__",
    "as_norm",
    "blockwise",
    "checkpoint",
    "clip_grad_norm_",
    "convert_children",
    "count_comm",
    "cross_entropy",
    "forward_problems",
    "gather",
    "init",
    "keep",
    "load_pretrained",
    "load_serial_state_dict",
    "materialize",
    "parallelize",
    "redistribute",
    "register_converter",
    "register_recogniser",
    "report_failure",
    "save_pretrained",
    "scatter",
    "scatter_batch",
    "serial_state_dict",
    "shard_rng",
    "shutdown",
]
