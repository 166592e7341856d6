"""Parameters shared between modules: which sharing ``parallelize`` keeps, and which it refuses.

Kept: an embedding table shared by ``nn.Embedding`` modules and output heads (plain ``nn.Linear``
layers, as their ``weight``), and such a head's bias shared with holders that are neither Linear
nor Embedding. ``convert/walk.py`` converts the holders onto one block of the table.
"""

from __future__ import annotations

from torch import nn


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
