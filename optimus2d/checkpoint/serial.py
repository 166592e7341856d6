"""Serial views of a parallel model: the full tensors under the serial model's keys."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from optimus2d.comm.dtensor import local, stored_state_dict
from optimus2d.layers.base import load_serial_tensor, serial_shape, serial_tensor


def _owners(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """state_dict key → (owning submodule, its local name), for every key of ``module.state_dict()``.

    By path, and where a wrapper rewrites the keys (torch's ``checkpoint_wrapper`` drops its
    ``_checkpoint_wrapped_module.``) by the tensor itself: a state_dict value is its parameter's or
    buffer's data (same storage, shape and strides). A key matched by neither is not a tensor of a
    module (extra state)."""
    owners, by_tensor = {}, {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name in list(sub._parameters) + list(sub._buffers):
            t = getattr(sub, name)
            if t is not None:
                owners[f"{prefix}.{name}" if prefix else name] = (sub, name)
                if not t.is_meta:
                    by_tensor.setdefault(_signature(t), (sub, name))
    with stored_state_dict():
        state = module.state_dict(keep_vars=True)
    for key, value in state.items():
        if key not in owners and isinstance(value, torch.Tensor) and not value.is_meta:
            if _signature(value) in by_tensor:
                owners[key] = by_tensor[_signature(value)]
    return owners


def _signature(t: torch.Tensor) -> tuple:
    t = local(t)
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def serial_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every key of ``module.state_dict()`` with the full serial tensor, on every rank.

    Collective: every rank of the mesh must call it. The keys and shapes are exactly those of the
    serial model the parallel one stands for (padding, e.g. of a vocabulary, is removed).
    """
    owners = _owners(module)
    out = {}
    with stored_state_dict():
        state = module.state_dict()
    for key, value in state.items():
        owner, name = owners.get(key, (None, None))
        if not isinstance(value, torch.Tensor):  # a module's extra state: passed through as it is
            out[key] = value
        else:
            out[key] = serial_tensor(owner, name).clone() if owner is not None else local(value).detach().clone()
    return out


def load_serial_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load full serial tensors (e.g. ``nn_model.state_dict()``) into a parallel model, in place.

    No communication: each rank keeps its blocks. Every key and shape is checked first, so a dict
    that does not fit raises ``ValueError`` and leaves the model unchanged.
    """
    owners = _owners(module)
    with stored_state_dict():
        own_keys = list(module.state_dict().keys())
    missing = [k for k in own_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own_keys]
    if strict and (missing or unexpected):
        raise ValueError(f"load_serial_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    plan = []
    for key in own_keys:
        if key not in state_dict:
            continue
        owner, name = owners[key]
        expected = serial_shape(owner, name)
        got = tuple(state_dict[key].shape)
        if got != expected:
            raise ValueError(f"load_serial_state_dict: {key} has shape {got}, the serial model's is {expected}")
        plan.append((owner, name, state_dict[key]))
    for owner, name, full in plan:
        load_serial_tensor(owner, name, full)
