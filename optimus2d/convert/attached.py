"""What a user attached to a module before ``parallelize``: hooks and parametrizations.

A forward hook set on a serial module sees the serial module's whole tensors; after conversion
the module is replaced (a hook on ``nn.Linear`` would be dropped with it) or kept (a hook on a
container would run on this rank's blocks). A parametrized weight (``torch.nn.utils.
parametrizations.weight_norm``, ``orthogonal``, ``spectral_norm``, the older ``weight_norm``) is
computed from other tensors on each call: a converter reads the computed weight once and trains
it, not the tensors it was computed from. Neither is known to be correct on blocks, so the walk
refuses them, naming each (``walk.py``). Hooks the libraries set themselves are kept:
optimus2d's own, and transformers' (it records outputs for ``output_hidden_states`` and makes the
input embeddings' output require a gradient), both of which act on blocks as on whole tensors.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

_HOOKS = {
    "_forward_pre_hooks": "a forward pre-hook",
    "_forward_hooks": "a forward hook",
    "_backward_pre_hooks": "a backward pre-hook",
    "_backward_hooks": "a backward hook",
}
_KNOWN = ("optimus2d.", "transformers.")  # the modules whose hooks act alike on blocks


def attached(module: nn.Module) -> str | None:
    """Why ``module`` itself (not its children) cannot be converted for what is attached to it, or None."""
    if parametrize.is_parametrized(module):
        names = ", ".join(module.parametrizations.keys())
        return (
            f"its {names} is parametrized (torch.nn.utils.parametrize): a converted layer would train the "
            f"computed tensor, not the tensors it is computed from; remove the parametrization first "
            f"(parametrize.remove_parametrizations)"
        )
    foreign = [f"{_HOOKS[kind]} {_name(hook)}" for kind, hook in _hooks(module)]
    if foreign:
        return (
            f"has {', '.join(foreign)} set before parallelize: on blocks it would see this rank's block, or be "
            f"dropped with the module it was set on; set it on the converted model (it then sees blocks)"
        )
    return None


def _hooks(module: nn.Module):
    for kind in _HOOKS:
        for hook in (getattr(module, kind, None) or {}).values():
            fn = getattr(hook, "func", hook)  # a functools.partial's module is "functools": its function's
            owner = getattr(fn, "__module__", None) or ""
            if not owner.startswith(_KNOWN):
                yield kind, hook


def _name(hook) -> str:
    fn = getattr(hook, "func", hook)
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__
