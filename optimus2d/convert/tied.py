"""Parameters shared between modules: which sharing ``parallelize`` keeps, and which it refuses.

Kept: an embedding table shared by ``nn.Embedding`` modules and output heads (plain ``nn.Linear``
layers, as their ``weight``), and such a head's bias shared with holders that are neither Linear
nor Embedding. ``convert/walk.py`` converts the holders onto one block of the table.

Guarded: a parameter of the model that a module *outside* it also holds (a base model converted
alone, its tied head left serial: ``BertForPreTraining``'s decoder). The model gets blocks, the
outside module keeps the serial tensor: ``held_outside`` finds such holders before the conversion,
``guard_outside`` makes them raise when called, and a later ``parallelize`` of them refuses.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref

import torch
from torch import nn

ELSEWHERE = "_optimus2d_tied_elsewhere"  # on a serial parameter whose tie parallelize broke: to what


class Tied(dict):
    """id(shared embedding weight) → the ``nn.Embedding`` whose conversion holds it (the first one).

    ``co_holders``: id(a tied head's shared bias) → the other modules holding it, as (module, name);
    ``blocks``: id(serial shared bias) → its converted block, once made. The shared serial
    parameters are kept referenced here, so their ids stay theirs during the walk.
    """

    def __init__(self) -> None:
        super().__init__()
        self.co_holders: dict[int, list[tuple[nn.Module, str]]] = {}
        self.blocks: dict[int, nn.Parameter] = {}
        self.serial: list[nn.Parameter] = []


def plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def tied_embeddings(root: nn.Module) -> Tied:
    """Parameters held by more than one module. Supported: an embedding table shared by
    ``nn.Embedding`` modules (as their ``weight``) and output heads (plain ``nn.Linear``s, as their
    ``weight``, biased or not), e.g. BART's ``shared``/``embed_tokens``/``lm_head``; and such a
    head's bias shared with other heads of the same table or with modules that are neither Linear
    nor Embedding (BERT's ``cls.predictions.bias`` is its decoder's bias: that holder, which still
    needs a converter of its own, gets the head's bias block). Any other sharing raises
    ``TypeError`` naming every holder.
    """
    owners: dict[int, dict[int, tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for path, sub in root.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(id(param), {})[id(sub)] = (path or "the model itself", sub, name)
                params[id(param)] = param
    shared = {  # blocks already shared by converted modules (a model converted before) stay as they are
        pid: list(holders.values())
        for pid, holders in owners.items()
        if len(holders) > 1 and getattr(params[pid], "_optimus2d_mesh", None) is None
    }
    tied = Tied()
    for pid, holders in shared.items():  # embedding tables, and the heads that share them
        embeddings = [m for _, m, _ in holders if isinstance(m, nn.Embedding)]
        tables = all((isinstance(m, nn.Embedding) or plain_linear(m)) and name == "weight" for _, m, name in holders)
        if tables and embeddings:
            tied[pid] = embeddings[0]
    for pid, holders in shared.items():
        tied.serial.append(params[pid])
        if pid in tied:
            continue
        heads = [m for _, m, name in holders if plain_linear(m) and name == "bias" and id(m.weight) in tied]
        others = [(m, name) for _, m, name in holders if not any(m is head for head in heads)]
        if (
            heads
            and len({id(head.weight) for head in heads}) == 1
            and not any(isinstance(m, (nn.Linear, nn.Embedding)) for m, _ in others)
        ):
            tied.co_holders[pid] = others
            continue
        where = ", ".join(f"{path}.{name}" for path, _, name in holders)
        raise TypeError(
            f"parallelize: one parameter is shared by {where}; only an embedding table shared by nn.Embedding "
            f"modules and nn.Linear output heads (as their weight), and such a head's bias, are supported"
        )
    return tied


def held_outside(root: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(holder, its name for it, the root's name)`` for each parameter of ``root`` that a module
    outside ``root`` holds too, and ``(optimizer, the parameter, the root's name)`` for each that an
    optimizer holds (found among the live objects, only when some parameter has more
    references than its holders inside give it: a scan of every object is 0.2 s with transformers
    loaded). Raises ``TypeError`` for a parameter whose tie an earlier ``parallelize`` broke."""
    inside = {id(m) for m in root.modules()}
    holders = _holders(root)
    named = list(root.named_parameters())
    probe = nn.Module()  # a parameter one module holds, counted as the model's are (drawing nothing)
    probe.weight = nn.Parameter(torch.empty(1))
    counts = _references([*named, ("probe", probe.weight)])
    base = counts.pop() - 1
    names = {id(p): name for (name, p), n in zip(named, counts, strict=True) if n - holders[id(p)] > base}
    broken = [f"{name} (tied to {getattr(p, ELSEWHERE)})" for name, p in named if hasattr(p, ELSEWHERE)]
    if broken:
        raise TypeError(
            f"parallelize: {', '.join(broken)} of {type(root).__name__} was tied to a parameter of a model that "
            f"parallelize converted before, so it holds the serial tensor, not the blocks: parallelize the module "
            f"that holds both at once"
        )
    if not names:
        return []
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module) and id(obj) not in inside:
            found += [
                (obj, key, names[id(p)]) for key, p in obj._parameters.items() if p is not None and id(p) in names
            ]
        elif issubclass(type(obj), torch.optim.Optimizer):  # built before parallelize: it holds serial tensors
            found += [(obj, p, names[id(p)]) for group in obj.param_groups for p in group["params"] if id(p) in names]
    return found


def _holders(root: nn.Module) -> dict[int, int]:
    """id(parameter) → how many modules of ``root`` hold it."""
    holders: dict[int, int] = {}
    for sub in root.modules():
        for p in sub._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    return holders


def _references(named: list[tuple[str, nn.Parameter]]) -> list[int]:
    """Each parameter's references, every one counted alike (its holders', the list's, the call's)."""
    return [sys.getrefcount(p) for _, p in named]


def guard_outside(found: list[tuple[nn.Module, str, str]], root: nn.Module, mesh) -> None:
    """After ``root`` is converted: each outside holder of its serial parameters (``held_outside``)
    raises ``ValueError`` when called, and its parameter is marked so that a later ``parallelize``
    of it refuses (its tie is broken: the model holds blocks, the holder the serial tensor)."""
    for holder, key, name in found:
        if not isinstance(holder, nn.Module):  # an optimizer: guard_optimizers, once the parameters are final
            continue
        name = f"{name} of {type(root).__name__}"
        setattr(holder._parameters[key], ELSEWHERE, name)
        holder.register_forward_pre_hook(functools.partial(_broken_tie, what=(type(holder).__name__, key, name, mesh)))


def _broken_tie(module: nn.Module, args: tuple, *, what: tuple) -> None:
    cls, key, name, mesh = what
    raise ValueError(
        f"{cls}: its {key} is the {name}, which parallelize converted on {mesh}: that model holds blocks of it now, "
        f"where this module outside that model holds the serial tensor: the tie is broken (BertForPreTraining with "
        f"its bert converted alone trained 0.14 off in one step). Parallelize the module that holds both, or give "
        f"this one its own copy before (nn.Parameter(weight.detach().clone())) to train them apart"
    )


def guard_optimizers(found: list[tuple[object, str | None, str]], root: nn.Module, model: nn.Module, mesh) -> None:
    """After ``root`` is converted into ``model`` (its parameters final): an optimizer built before
    ``parallelize`` that holds serial parameters the model no longer holds raises ``ValueError`` at
    its next step. Stepping it moved the serial tensors, never the blocks: the model did not train,
    with no error (an SGD step changed nothing)."""
    now = {id(p) for p in model.parameters()}
    stale: dict[int, tuple[torch.optim.Optimizer, list]] = {}
    for holder, param, name in found:
        if not isinstance(holder, nn.Module) and id(param) not in now:
            stale.setdefault(id(holder), (holder, []))[1].append((weakref.ref(param), name))
    for optimizer, held in stale.values():
        what = {"names": (type(optimizer).__name__, type(root).__name__, mesh), "held": held}
        what["handle"] = optimizer.register_step_pre_hook(functools.partial(_stale_optimizer, what=what))


def _stale_optimizer(optimizer, args: tuple, kwargs: dict, *, what: dict) -> None:
    """Raise while ``optimizer`` still holds a serial parameter ``parallelize`` replaced; once its
    groups hold none of them (given the model's parameters since), the hook goes."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [name for ref, name in what["held"] if (p := ref()) is not None and id(p) in ids]
    if not names:
        what["handle"].remove()
        return
    cls, model, mesh = what["names"]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise ValueError(
        f"{cls}: it holds {len(names)} parameters of {model} ({shown}) that parallelize replaced on {mesh}: the "
        f"model holds their blocks now, so stepping this optimizer would leave the model as it is. Build the "
        f"optimizer after parallelize, from the converted model's parameters"
    )
