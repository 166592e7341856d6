"""Forwards set on one instance: hub kernels set aside, anything else refused.

``parallelize`` judges a module by its class: a converter reproduces ``type(module).forward``, and
the forward reader reads that method's source. A forward assigned to the instance
(``module.forward = ...``) is what ``nn.Module.__call__`` runs instead, and nothing read says it is
correct on blocks, so:

- a kernel from the Hugging Face ``kernels`` package (``kernels.kernelize``, which transformers
  ≥ 5.25 runs in ``from_pretrained`` by default, on CUDA, ROCm and XPU: LigerRMSNorm for every
  RMSNorm, a rotary kernel, fast activations) is a drop-in for its class's forward (the package
  checks it holds no state and takes the same arguments; 0.19 notes the repository beside it, in
  ``_kernel_repo``, and only such a forward is taken for a kernel). It is set aside (``set_aside_hub_kernels``):
  the module runs its class's forward again, the one judged, as ``kernelize`` itself does where no
  kernel fits. Values do not change; the kernel's speed is lost on the modules kept as they are (the
  ones converted are replaced anyway).
- any other forward on the instance (a user's patch, accelerate's hooks) is refused
  (``replaced_forward``), naming the module, unless it is optimus2d's own.
"""

from __future__ import annotations

import functools

from torch import nn


def set_aside_hub_kernels(model: nn.Module) -> list[str]:
    """Every module of ``model`` back on its class's forward where ``kernels`` replaced it; the
    paths of those modules. Also the kernel functions a module holds (``use_kernelized_func``: the
    rotary embedding's), and a Hugging Face model's flag that would kernelize it again on
    ``train()``/``eval()``."""
    set_aside = []
    for path, module in model.named_modules():
        for holder in (module, *module.__dict__.get("_kernel_funcs", {}).values()):
            # kernels (0.19, what transformers 5.25 requires) notes the repository beside the forward it
            # sets; a forward set on a kernelizable class without it may be anyone's: refused below
            kernel = "_kernel_repo" in holder.__dict__
            if kernel and "forward" in holder.__dict__ and not _ours(_function(holder.__dict__["forward"])):
                holder.__dict__.pop("forward")
                holder.__dict__.pop("_kernel_repo", None)
                set_aside.append(path or type(model).__name__)
        if module.__dict__.get("_use_kernels"):
            module.__dict__["_use_kernels"] = False
    return set_aside


def replaced_forward(module: nn.Module) -> str | None:
    """Why ``module`` cannot be judged by its class, or None: a forward assigned to this instance
    that is neither its class's nor optimus2d's own (a hub kernel is set aside before this is asked)."""
    if "forward" not in module.__dict__:
        return None
    fn = _function(module.__dict__["forward"])
    if fn is type(module).forward or _ours(fn):
        return None
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    hub = hasattr(type(module), "kernel_layer_name")  # an older kernels' kernel: no repository noted
    return (
        f"its forward is replaced on this instance (by {name}), so {type(module).__name__}.forward, "
        "the one judged on blocks, is not what runs: not known to be exact ("
        + ("a hub kernel? load with use_kernels=False or call model.reset_kernels(); " if hub else "")
        + "restore the class's forward, `del module.forward`, or register a converter for a class of its own)"
    )


def _function(forward):
    """The function behind a forward set on an instance: a bound method's, a partial's (accelerate)."""
    forward = forward.func if isinstance(forward, functools.partial) else forward
    return getattr(forward, "__func__", forward)


def _ours(fn) -> bool:
    """optimus2d's own (context parallelism's sequence layout, a forward drawing dropout per shard)."""
    return (getattr(fn, "__module__", None) or "").startswith("optimus2d.")
