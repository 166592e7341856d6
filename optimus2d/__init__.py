"""optimus2d: 2D (Optimus) and 2.5D (Tesseract) tensor parallelism for PyTorch.

Parameters *and* activations are split over a q×q mesh of ranks (``depth`` of them stacked for
2.5D); matrix products run as SUMMA. See docs/DESIGN.md for which block every rank holds.
"""

from optimus2d.comm import Mesh, count_comm, gather, scatter, scatter_batch
from optimus2d.launch import World, init, shutdown
from optimus2d.layers import Linear2D
from optimus2d.serial import load_serial_state_dict, serial_state_dict

__version__ = "0.1.0"

__all__ = [
    "Linear2D",
    "Mesh",
    "World",
    "__version__",
    "count_comm",
    "gather",
    "init",
    "load_serial_state_dict",
    "scatter",
    "scatter_batch",
    "serial_state_dict",
    "shutdown",
]
