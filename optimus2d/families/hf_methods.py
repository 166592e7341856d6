"""A converted Hugging Face model's own methods that would read its blocks as whole tensors.

``PreTrainedModel``'s methods read the module's tensors as they are; on a converted model those are
this rank's blocks. ``finish`` gives every ``PreTrainedModel`` in a converted model:

* ``save_pretrained(save_directory, max_shard_size=...)``: ``optimus2d.save_pretrained``, the serial
  model's files (its transformers class's ``from_pretrained`` loads them); collective, every rank
  calls it. transformers' own wrote each rank's blocks under the serial names into one file from
  every rank (rank 0 raised, the others returned). ``is_main_process`` is taken and ignored (every
  rank takes part; the mesh's first rank writes), as are ``token``, ``save_peft_format``,
  ``save_function`` (Accelerate's) and ``save_original_format`` (the names are the model's own,
  which transformers 5 loads); what would write other files (``state_dict=``, ``push_to_hub=True``,
  ``variant=``, ``distributed_checkpoint=True``, ``safe_serialization=False``) is refused before
  anything runs. Called on some ranks only (``if rank == 0:``, transformers' habit), the others'
  wait ends in a ``TimeoutError`` that says every rank calls it.
* ``num_parameters(only_trainable=, exclude_embeddings=)``: the serial model's count (each
  parameter's global size), not this rank's.
* ``resize_token_embeddings``: refused; its embedding (and head) are split over the mesh.

``hf_causal_lm`` adds ``generate`` and ``labels=`` to the causal LMs among them.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import types

from torch import nn

from optimus2d.checkpoint.pretrained import save_pretrained
from optimus2d.comm.mesh import Mesh
from optimus2d.families.hf_seq2seq import HeadTable2D
from optimus2d.layers.base import serial_shape
from optimus2d.layers.embedding import Embedding2D

# save_pretrained's keywords that choose other files than the serial model's safetensors: name → the
# value that writes them as transformers' default does (anything else is refused).
_DEFAULTS = {
    "state_dict": None,
    "push_to_hub": False,
    "variant": None,
    "distributed_checkpoint": False,
    "safe_serialization": True,
}
# Keywords that change nothing in what is written here.
_IGNORED = ("is_main_process", "token", "save_peft_format", "save_original_format", "save_function")


def finish(root: nn.Module, mesh: Mesh) -> None:
    """Answer for the serial model in every Hugging Face model of the converted ``root``."""
    from transformers import PreTrainedModel

    for module in root.modules():
        if isinstance(module, PreTrainedModel):
            for name, fn in (
                ("save_pretrained", _save_pretrained),
                ("num_parameters", _num_parameters),
                ("resize_token_embeddings", _refused_resize),
            ):
                setattr(module, name, types.MethodType(functools.partial(fn, mesh=mesh), module))


def _save_pretrained(self: nn.Module, save_directory: str | os.PathLike, *, mesh: Mesh, **kwargs) -> None:
    """``PreTrainedModel.save_pretrained`` of the serial model: ``optimus2d.save_pretrained``."""
    from transformers import PreTrainedModel

    where = f"save_pretrained on {type(self).__name__} converted by optimus2d.parallelize ({mesh})"
    unknown = sorted(set(kwargs) - {*_DEFAULTS, *_IGNORED, "max_shard_size"})
    if unknown:
        raise TypeError(f"{where}: unexpected keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    refused = [f"{k}={kwargs[k]!r}" for k, default in _DEFAULTS.items() if k in kwargs and kwargs[k] != default]
    if refused:
        raise ValueError(
            f"{where}: {', '.join(refused)} not supported; it writes the serial model's safetensors to "
            f"save_directory (every rank calls it), which from_pretrained loads"
        )
    size = kwargs.get(
        "max_shard_size", inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    )
    try:
        save_pretrained(self, save_directory, max_shard_size=size)
    except TimeoutError as err:  # transformers' habit: `if rank == 0: model.save_pretrained(d)`
        raise TimeoutError(f"{where}: {err}; it is collective: every rank of the mesh calls it") from err


def _num_parameters(
    self: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False, *, mesh: Mesh
) -> int:
    """``PreTrainedModel.num_parameters`` of the serial model: each parameter's global size."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    for _, sub in self.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(id(param), (sub, name))
    tables = (nn.Embedding, Embedding2D, HeadTable2D)  # what transformers counts as embeddings (T5's biases too)
    embeddings = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, tables)}
    total = 0
    for name, param in self.named_parameters():
        if exclude_embeddings and name in embeddings:
            continue
        if param.requires_grad or not only_trainable:
            total += math.prod(serial_shape(*owners[id(param)]))
    return total


def _refused_resize(self: nn.Module, *args, mesh: Mesh, **kwargs):
    raise TypeError(
        f"resize_token_embeddings on {type(self).__name__} converted by optimus2d.parallelize: its embedding "
        f"(and head) are split over {mesh}; resize the serial model, then parallelize it"
    )
