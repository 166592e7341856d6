"""What a module is set to beside its tensors, agreed over the mesh before ``parallelize`` converts.

The serial weights are agreed by checksum (``check_same_tensors``); a setting is not a tensor: one
rank's ``nhead``, activation or ``eps`` (its weights alike) was converted and ran, its blocks
computed otherwise than its peers' (0.07–0.78 off, no error). Each module's class and plain
settings (its public attributes that are numbers, strings, flags or tuples of them, functions by
name, a Hugging Face config's plain entries) are agreed as a text per module, naming the modules
that differ. Devices, paths, private attributes and records of where the model came from are left
out (a rank's own ``cuda:3``, the ``architectures`` a ``save_pretrained`` on one rank sets); so are
the settings of optimus2d's own modules (a part converted already holds its rank's coordinates).
"""

from __future__ import annotations

import types

from torch import nn

from optimus2d.comm.agreement import check_same_texts

_PLAIN = (bool, int, float, str, type(None))
# What records where a model came from, not what it computes: ``save_pretrained`` on one rank sets
# the config's ``architectures`` and ``dtype`` there; ``from_pretrained`` notes each rank's path.
_RECORDS = frozenset(
    "architectures transformers_version dtype torch_dtype auto_map id2label label2id tokenizer_class "
    "task_specific_params finetuning_task".split()
)
_ADVICE = "Build the model from the same code and config on every rank"


def agree_settings(mesh, model: nn.Module, check: bool | None) -> None:
    """Every rank of ``mesh`` holds ``model`` set alike (``settings``), or every rank raises
    ``ValueError`` naming the modules whose settings differ. Collective (one 5-word all-gather)."""
    check_same_texts(mesh, "parallelize: the serial modules' settings", settings(model), _ADVICE, check)


def settings(model: nn.Module) -> list[tuple[str, str]]:
    """``(path, "class; name=value; ...")`` for every module of ``model``."""
    configs: dict[int, str] = {}
    out = []
    for path, module in model.named_modules(remove_duplicate=True):
        cls = type(module)
        items = [f"{cls.__module__}.{cls.__qualname__}"]
        if not cls.__module__.startswith("optimus2d."):
            for name, value in sorted(vars(module).items()):
                text = None if _left_out(name) else _plain(value, configs)
                if text is not None:
                    items.append(f"{name}={text}")
        out.append((path or "(the model)", "; ".join(items)))
    return out


def _left_out(name: str) -> bool:
    """Private, a device, a path, or a record of where the model came from (``_RECORDS``)."""
    return name.startswith("_") or "device" in name or "path" in name or name in _RECORDS


def _plain(value: object, configs: dict[int, str]) -> str | None:
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)) and len(value) <= 64 and all(isinstance(v, _PLAIN) for v in value):
        return repr(tuple(value))
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and type(value).__name__.endswith("Config"):  # transformers' PretrainedConfig
        if id(value) not in configs:
            entries = to_dict()
            plain = {k: v for k, v in entries.items() if not _left_out(k) and isinstance(v, (*_PLAIN, list, dict))}
            configs[id(value)] = repr(sorted((k, repr(v)) for k, v in plain.items()))
        return configs[id(value)]
    return None
