"""Checkpoints: sharded save and load that reshard to any mesh, the serial view, Hugging Face files.

- ``save``/``async_save``/``load``/``read`` (``sharded.py``): torch's DCP checkpoint of the whole
  model and its optimizer under ``get_state_dict``'s keys (``torch_state.py``), every rank writing
  its own blocks, committed atomically with checksums (``files.py``); it loads onto any mesh, with
  DCP's own ``load`` too, or into one process (``read``); format 2 still loads (``reading.py``).
- ``save_stages``/``load_stages`` (``stages.py``): the same format, written by every pipeline stage.
- ``serial_state_dict``/``load_serial_state_dict`` (``serial.py``): the serial model's keys and values.
- ``load_pretrained``/``save_pretrained`` (``pretrained.py``): Hugging Face safetensors, each rank
  reading and writing only its blocks.
"""

from optimus2d.checkpoint.pretrained import load_pretrained, save_pretrained
from optimus2d.checkpoint.serial import load_serial_state_dict, serial_state_dict
from optimus2d.checkpoint.sharded import async_save, load, read, save
from optimus2d.checkpoint.stages import load_stages, save_stages

__all__ = [
    "async_save",
    "load",
    "load_pretrained",
    "load_serial_state_dict",
    "load_stages",
    "read",
    "save",
    "save_pretrained",
    "save_stages",
    "serial_state_dict",
]
