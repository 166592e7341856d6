"""Forwards set on one instance: hub kernels set aside, anything else refused.

``parallelize`` judges a module by its class: a converter reproduces ``type(module).forward``, and
the forward reader reads that method's source. A forward assigned to the instance
(``module.forward = ...``) is what ``nn.Module.__call__`` runs instead, and nothing read says it is
correct on blocks, so:

- a kernel from the Hugging Face ``kernels`` package (``kernels.kernelize``, which transformers
  ≥ 5.25 runs in ``from_pretrained`` by default, on CUDA, ROCm and XPU: LigerRMSNorm for every
  RMSNorm, a rotary kernel, fast activations) is a drop-in for its class's forward (the package
  checks it holds no state and takes the same arguments). kernels 0.19 binds the kernel layer's
  forward to the instance and notes the repository beside it (``_kernel_repo``); only such a forward
  is taken for a kernel. It is set aside (``set_aside_hub_kernels``): the module runs its class's
  forward again, the one judged, as ``kernelize`` itself does where no kernel fits; put back if the
  model is refused (``SetAside.put_back``). Values do not change; the kernel's speed is lost on the
  modules kept as they are (the ones converted are replaced anyway).
- any other forward on an instance (a user's patch, accelerate's hooks, a method of another module)
  is refused (``refusals``: every module of the model, and the kernel functions it holds), unless it
  is optimus2d's own (a function defined in optimus2d, bound to this module if bound at all).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field

from torch import nn


@dataclass
class SetAside:
    """What ``set_aside_hub_kernels`` took from the model: (holder, its ``__dict__`` entries) each."""

    taken: list[tuple[object, dict]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # the modules whose kernels were set aside

    def put_back(self) -> None:
        """The model as it was (a refused model is left untouched)."""
        for holder, entries in self.taken:
            holder.__dict__.update(entries)
        self.taken, self.paths = [], []


def set_aside_hub_kernels(model: nn.Module) -> SetAside:
    """Every module of ``model`` back on its class's forward where ``kernels`` bound a kernel's, and
    the kernel functions a module holds (``use_kernelized_func``: the rotary embedding's); a Hugging
    Face model's flags that would kernelize it again on ``train()``/``eval()`` cleared (as its
    ``reset_kernels`` does). An accelerate hook in front of a kernel is not the kernel: left, refused."""
    aside = SetAside()
    for path, module in model.named_modules():
        for holder in (module, *module.__dict__.get("_kernel_funcs", {}).values()):
            if _is_hub_kernel(holder):
                aside.taken.append((holder, {k: holder.__dict__.pop(k) for k in ("forward", "_kernel_repo")}))
                aside.paths.append(path or type(model).__name__)
        flags = {k: module.__dict__[k] for k in ("_use_kernels", "_kernels_mode") if module.__dict__.get(k)}
        if flags:
            aside.taken.append((module, flags))
            module.__dict__.update(dict.fromkeys(flags))
            module.__dict__["_use_kernels"] = False
    return aside


def refusals(model: nn.Module) -> list[str]:
    """``"path (Class): why"`` for every module of ``model`` (and kernel function it holds) whose
    forward is set on the instance and is not optimus2d's own (hub kernels set aside first)."""
    found = []
    for path, module in model.named_modules():
        where = path or "the model itself"
        for name, holder in [("", module), *module.__dict__.get("_kernel_funcs", {}).items()]:
            why = replaced_forward(holder)
            if why is not None:
                at = f"{where} ({type(module).__name__})" + (f", its kernel function {name}" if name else "")
                found.append(f"{at}: {why}")
    return found


def replaced_forward(module: nn.Module) -> str | None:
    """Why ``module`` cannot be judged by its class, or None: a forward assigned to this instance
    that is neither its class's (bound to this module) nor optimus2d's own."""
    if "forward" not in module.__dict__:
        return None
    fn, bound_to = _function(module.__dict__["forward"])
    if (bound_to is module and (fn is type(module).forward or _ours(fn))) or (bound_to is None and _ours(fn)):
        return None
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    other = " of another module" if bound_to is not None and bound_to is not module else ""
    hub = hasattr(type(module), "kernel_layer_name")  # a kernel that noted no repository (an older kernels)
    return (
        f"its forward is replaced on this instance (by {name}{other}), so {type(module).__name__}.forward, "
        "the one judged on blocks, is not what runs: not known to be exact ("
        + ("a hub kernel? load with use_kernels=False or call model.reset_kernels(); " if hub else "")
        + "restore the class's forward, `del module.forward`, or register a converter for a class of its own)"
    )


def _is_hub_kernel(holder) -> bool:
    """A forward kernels bound: a method bound to ``holder`` with the repository noted beside it, not
    optimus2d's own, and no accelerate hook (``_hf_hook``) in front of it."""
    forward = holder.__dict__.get("forward")
    return (
        "_kernel_repo" in holder.__dict__
        and isinstance(forward, types.MethodType)
        and forward.__self__ is holder
        and not _ours(forward.__func__)
        and "_hf_hook" not in holder.__dict__
    )


def _function(forward) -> tuple[object, object | None]:
    """(the function behind a forward set on an instance, the object it is bound to or None): a bound
    method's, a partial's first argument (accelerate's form), or a plain function, unbound."""
    if isinstance(forward, functools.partial):
        return forward.func, (forward.args[0] if forward.args else None)
    if isinstance(forward, types.MethodType):
        return forward.__func__, forward.__self__
    return forward, None


def _ours(fn) -> bool:
    """Defined in optimus2d (context parallelism's sequence layout, a forward drawing dropout per
    shard, the families' wrappers, whose ``functools.wraps`` copies the wrapped ``__module__``)."""
    return (getattr(fn, "__globals__", {}).get("__name__") or "").startswith("optimus2d.")
