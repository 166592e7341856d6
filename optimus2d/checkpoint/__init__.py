"""Checkpoints: sharded save and load that reshard to any mesh, the serial view, Hugging Face files.

- ``save``/``load``/``read`` (``sharded.py``): one checkpoint of the whole model and its optimizer,
  every rank writing its own blocks through torch's DCP, committed atomically with checksums
  (``files.py``); it loads onto any mesh, or into one process (``read``).
- ``save_stages``/``load_stages`` (``stages.py``): the same format, written by every pipeline stage.
- ``serial_state_dict``/``load_serial_state_dict`` (``serial.py``): the serial model's keys and values.
- ``load_pretrained``/``save_pretrained`` (``pretrained.py``): Hugging Face safetensors, each rank
  reading and writing only its blocks.
"""

from optimus2d.checkpoint.pretrained import load_pretrained, save_pretrained
from optimus2d.checkpoint.serial import load_serial_state_dict, serial_state_dict
from optimus2d.checkpoint.sharded import load, read, save
from optimus2d.checkpoint.stages import load_stages, save_stages

__all__ = [
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
