"""Reading a checkpoint into a model and its optimizer, or into one process; its two key schemes.

Format 3 (``torch_state.py``) stores the keys torch's ``get_state_dict`` gives; format 2 (optimus2d
before it) stored ``model/<key>`` and ``optim/<key>/<name>``, fused q/k/v as parts ``#0``, ``#1``,
... and a JSON ``meta`` (optimizer class, groups, tied keys, the dim the parts join on). A
``Reading`` gives DCP a fresh tensor for every stored key this rank needs (``torch_state.target``),
checks the whole checkpoint against the model first, and only once DCP has read everything puts
the blocks in place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

from optimus2d.checkpoint import torch_state
from optimus2d.comm.dtensor import like, local
from optimus2d.convert import dtensor_optimizer


class Format3:
    number = 3

    def __init__(self, objects: dict) -> None:
        self.objects = objects  # every non-tensor entry (the settings, optimus2d.*), read already

    def model_key(self, key: str) -> str:
        return f"model.{key}"

    def model_keys(self, metadata) -> dict[str, str]:
        """stored key → serial key, for every model tensor stored."""
        return {k: k[len("model.") :] for k in metadata if k.startswith("model.")}

    def optim_names(self, key: str, metadata) -> dict[str, str]:
        """state name → stored key, for the optimizer state of the tensor stored under ``key``."""
        prefix = f"optim.state.{key}."
        return {k[len(prefix) :]: k for k in metadata if k.startswith(prefix) and "." not in k[len(prefix) :]}

    def parts(self, base: str, metadata) -> list[str]:
        return []

    def optimizer(self) -> str | None:
        """The optimizer's class name; None if the checkpoint has no optimizer state, "" if DCP
        wrote it alone (no class recorded)."""
        if not any(k.startswith("optim.param_groups.") for k in self.objects):
            return None
        return self.objects.get("optimus2d.optimizer") or ""

    def aliases(self) -> dict[str, str]:
        return json.loads(self.objects.get("optimus2d.aliases") or "{}")

    def param_groups(self) -> list[dict]:
        """The saved groups, each with its settings and "params" (keys). DCP's flattened form
        (``StateDictOptions(flatten_optimizer_state_dict=True)``: ``param_groups.<key>.<setting>``)
        gives one group per key."""
        fields = {
            k[len("optim.param_groups.") :]: v for k, v in self.objects.items() if k.startswith("optim.param_groups.")
        }
        nested = any(f.endswith(".params") for f in fields) and all(f.partition(".")[0].isdigit() for f in fields)
        groups: dict[object, dict] = {}
        for f, v in fields.items():
            if nested:
                n, _, field = f.partition(".")
                groups.setdefault(int(n), {})[field] = v
            else:
                key, _, field = f.rpartition(".")
                groups.setdefault(key, {"params": [key]})[field] = v
        return [groups[n] for n in (sorted(groups) if nested else groups)]

    def serial(self, flat: dict) -> dict:
        """``read``'s result from every stored entry."""
        model = {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
        optim: dict[str, dict] = {}
        for k, v in flat.items():
            if k.startswith("optim.state."):
                key, _, name = k[len("optim.state.") :].rpartition(".")
                optim.setdefault(key, {})[name] = v
        self.objects = {k: v for k, v in flat.items() if small(k, v)}
        meta = {"format": 3, "optimizer": self.objects.get("optimus2d.optimizer"), "param_groups": self.param_groups()}
        return {"model": model, "optimizer": optim, "meta": meta}


class Format2:
    number = 2

    def __init__(self, meta: dict) -> None:
        self.meta = meta

    def model_key(self, key: str) -> str:
        return f"model/{key}"

    def model_keys(self, metadata) -> dict[str, str]:
        return {b: b[len("model/") :] for b in {k.partition("#")[0] for k in metadata if k.startswith("model/")}}

    def optim_names(self, key: str, metadata) -> dict[str, str]:
        prefix = f"optim/{key}/"
        return {k[len(prefix) :].partition("#")[0]: k.partition("#")[0] for k in metadata if k.startswith(prefix)}

    def parts(self, base: str, metadata) -> list[str]:
        n, out = 0, []
        while f"{base}#{n}" in metadata:
            out.append(f"{base}#{n}")
            n += 1
        return out

    def optimizer(self) -> str | None:
        return self.meta.get("optimizer")

    def aliases(self) -> dict[str, str]:
        return self.meta.get("aliases", {})

    def param_groups(self) -> list[dict]:
        return self.meta.get("param_groups", [])

    def serial(self, flat: dict) -> dict:
        parts: dict[str, dict[int, torch.Tensor]] = {}
        for key, tensor in flat.items():
            if key != "meta":
                base, _, part = key.partition("#")
                parts.setdefault(base, {})[int(part) if part else 0] = tensor
        dims = self.meta.get("parts_dim", {})
        joined = {
            b: torch.cat([p[n] for n in sorted(p)], dims.get(b, 0)) if len(p) > 1 else p[0] for b, p in parts.items()
        }
        model = {k[len("model/") :]: v for k, v in joined.items() if k.startswith("model/")}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in joined.items():
            if key.startswith("optim/"):
                pkey, _, name = key[len("optim/") :].rpartition("/")
                optim.setdefault(pkey, {})[name] = value
        return {"model": model, "optimizer": optim, "meta": self.meta}


def small(key: str, m) -> bool:
    """Whether a stored entry is a setting (read by every process before the tensors): an object,
    or a tensor among the optimizer's settings (a tensor ``lr``)."""
    return key.startswith(("optim.param_groups.", "optimus2d.")) or isinstance(m, BytesStorageMetadata)


def scheme(path, metadata, load) -> Format3 | Format2:
    """The key scheme of the checkpoint at ``path``, its small entries read (``load``: DCP's, alone)."""
    if "meta" in metadata:  # format 2: a JSON string as bytes in a uint8 tensor
        buf = torch.empty(metadata["meta"].size, dtype=torch.uint8)
        load({"meta": buf}, path, None, True)
        return Format2(json.loads(bytes(buf.tolist()).decode()))
    objects = {k: _holder(m) for k, m in metadata.items() if small(k, m)}
    if objects:
        load(objects, path, None, True)
    return Format3(objects)


def _holder(m):
    """What DCP reads a small entry into: None for an object, a tensor of its size and dtype."""
    return None if isinstance(m, BytesStorageMetadata) else torch.empty(tuple(m.size), dtype=m.properties.dtype)


class Reading:
    """What DCP reads for ``entries`` and ``optimizer`` (``state``), and how it goes in place."""

    def __init__(self, path, metadata, fmt, entries: list, optimizer, dm, only_mine: bool = False) -> None:
        self.path, self.metadata, self.fmt, self.optimizer = os.fspath(path), metadata, fmt, optimizer
        self.entries, self.dm, self.only_mine = entries, dm, only_mine
        self.state: dict[str, torch.Tensor] = {}
        self.model: list[tuple] = []  # (Held, stored keys, dim the parts join on)
        self.optim: list[tuple] = []  # (param, name, Held or None (not laid out like it), stored keys, dim)
        self.shapes: dict[str, tuple[int, ...]] = {}  # stored key (or base of parts) → the shape wanted
        self.unfit: list[str] = []  # optimizer state that cannot be resharded onto its parameter
        self.settings: list[dict] = []  # the saved settings of each of the optimizer's groups
        for e in entries:
            base = fmt.model_key(e.key)
            self.shapes[base] = e.shape
            self.model.append((e, *self._targets(base, e, e.block, e.block.dtype)))
        if optimizer is not None:
            self._optimizer_targets()

    def _targets(self, base: str, e, block, dtype, scalar: bool = False) -> tuple[list[str], int]:
        parts = self.fmt.parts(base, self.metadata)
        if parts:  # format 2's fused parts: each whole on every rank, joined after
            for k in parts:
                self.state[k] = torch.zeros(tuple(self.metadata[k].size), dtype=dtype, device=local(block).device)
            return parts, self.fmt.meta.get("parts_dim", {}).get(base, 0)
        if scalar:  # as stored (its size; its dtype unless given), on ``block``'s device
            m = self.metadata[base]
            self.state[base] = torch.zeros(tuple(m.size), dtype=dtype or m.properties.dtype, device=block.device)
        elif base in self.metadata or not self.only_mine:
            self.state[base] = torch_state.target(e, block, self.dm, dtype)
        return [base], 0

    def _optimizer_targets(self) -> None:
        """Each state tensor stored for a parameter of the optimizer: laid out like the parameter
        (its dtype), or else kept as torch's ``load_state_dict`` keeps it: ``step`` on the CPU as
        stored (on the parameter's device when ``capturable`` or ``fused``), any other on the
        parameter's device, in its dtype when floating. A tensor of neither shape for a parameter
        split over the mesh cannot be resharded (refused by ``check_fits``)."""
        aliases, by_param = self.fmt.aliases(), {}
        for e in self.entries:
            by_param.setdefault(id(e.tensor), []).append(e)
        for group in self.optimizer.param_groups:
            on_device = bool(group.get("capturable") or group.get("fused"))
            for p in group["params"]:
                if id(p) not in by_param:
                    raise ValueError("optimus2d.checkpoint: the optimizer holds a parameter that is not in the model")
                held = by_param[id(p)]
                keys = [e.key for e in held] + [aliases[e.key] for e in held if e.key in aliases]
                stored = [names for names in (self.fmt.optim_names(k, self.metadata) for k in keys) if names]
                if not stored:
                    continue  # no state saved for it (never stepped)
                e, device = held[0], local(p).device
                for name, base in sorted(stored[0].items()):
                    parts = self.fmt.parts(base, self.metadata)
                    m = self.metadata[parts[0] if parts else base]
                    size = tuple(m.size)
                    if parts or (len(size) > 0 and size == e.shape):  # laid out like the parameter
                        self.optim.append((p, name, e, *self._targets(base, e, local(p), p.dtype)))
                        continue
                    if len(size) > 0 and e.sharding is not None:
                        self.unfit.append(f"{base}: {size}, neither the parameter's {e.shape} nor a scalar")
                        continue
                    floating = m.properties.dtype.is_floating_point
                    if name == "step":
                        where, dtype = (device if on_device else torch.device("cpu")), None
                    else:
                        where, dtype = device, (p.dtype if floating else None)
                    holder = torch.empty((), device=where)
                    self.optim.append((p, name, None, *self._targets(base, e, holder, dtype, scalar=True)))

    def _settings(self) -> list[dict]:
        """The saved settings of each of the optimizer's groups, found by its parameters' keys (as
        DCP's ``set_state_dict`` pairs them); ``ValueError`` if a group's parameters have none or
        differ, or the checkpoint's groups are not the optimizer's."""
        saved = self.fmt.param_groups()
        by_key = {}
        for n, group in enumerate(saved):
            for key in group.get("params", []):
                by_key[key] = n
        aliases, first = self.fmt.aliases(), torch_state.first_keys(self.entries)
        out = []
        for g, group in enumerate(self.optimizer.param_groups):
            found = set()
            for p in group["params"]:
                e = first.get(id(p))
                keys = [k for k in (e.key, aliases.get(e.key)) if k is not None] if e is not None else []
                hits = {by_key[k] for k in keys if k in by_key}
                if not hits:
                    raise ValueError(
                        f"optimus2d.checkpoint: {self.path!r}: no saved parameter group holds "
                        f"{e.key if e is not None else 'a parameter'} (of the optimizer's group {g})"
                    )
                found |= hits
            settings = [{k: v for k, v in saved[n].items() if k != "params"} for n in sorted(found)]
            if len({repr(sorted(s.items())) for s in settings}) > 1:
                raise ValueError(
                    f"optimus2d.checkpoint: {self.path!r}: the optimizer's group {g} holds parameters that were saved "
                    f"in groups of other settings ({sorted(found)})"
                )
            out.append(settings[0] if settings else {})
        return out

    def check_fits(self) -> None:
        """``ValueError`` naming what does not fit, before anything is read."""
        where = repr(self.path)
        stored = self.fmt.model_keys(self.metadata)
        wanted = {self.fmt.model_key(e.key) for e in self.entries}
        recorded = self.fmt.optimizer()
        if self.optimizer is not None and recorded != type(self.optimizer).__name__ and recorded != "":
            raise ValueError(
                f"optimus2d.checkpoint: {where} holds {recorded or 'no'} optimizer state, "
                f"not {type(self.optimizer).__name__}"
            )
        missing = sorted(wanted - set(stored))
        unexpected = [] if self.only_mine else sorted(set(stored) - wanted)
        shapes = []
        for base in sorted(wanted & set(stored)):
            if not self.fmt.parts(base, self.metadata) and tuple(self.metadata[base].size) != tuple(self.shapes[base]):
                shapes.append(f"{base}: checkpoint {tuple(self.metadata[base].size)}, model {tuple(self.shapes[base])}")
        if missing or unexpected or shapes or self.unfit:
            raise ValueError(
                f"optimus2d.checkpoint: {where} does not fit this model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, shapes {shapes[:5]}"
                + (f", optimizer state {self.unfit[:5]}" if self.unfit else "")
            )
        if self.optimizer is not None:
            self.settings = self._settings()

    def _value(self, keys: list[str], dim: int) -> torch.Tensor:
        return torch.cat([self.state[k] for k in keys], dim) if len(keys) > 1 else self.state[keys[0]]

    def apply(self, gather: Callable[[object], list] | None = None) -> None:
        """Once DCP has read ``state``: every block into its tensor, and the optimizer's state.
        ``ValueError`` (nothing changed) where the model ties two keys the checkpoint holds apart
        with other values (an untied model's: the last key's would have won), agreed with
        ``gather`` (this rank's object → every reading rank's) on every rank that reads."""
        blocks = [(e, torch_state.to_block(e, self._value(keys, dim))) for e, keys, dim in self.model]
        by_tensor: dict[int, list] = {}
        for e, block in blocks:
            by_tensor.setdefault(id(e.tensor), []).append((e.key, block))
        tied = [held for held in by_tensor.values() if len(held) > 1]
        if tied:  # the same model on every rank: the same verdict asked everywhere
            apart = [
                f"{first} and {key}"
                for (first, value), *others in tied
                for key, other in others
                if not torch.equal(other, value)
            ]
            everyone = gather(apart) if gather is not None else [apart]
            apart = sorted({pair for found in everyone for pair in found})
            if apart:
                raise ValueError(
                    f"optimus2d.checkpoint: {self.path!r}: the model ties {', '.join(apart)} (one tensor), but the "
                    f"checkpoint holds them with other values (an untied model's): nothing was loaded"
                )
        with torch.no_grad():
            for e, block in blocks:
                e.block.copy_(block)
        if self.optimizer is None:
            return
        dtensor_optimizer.attach(self.optimizer)  # the state goes in as blocks: not the serial layout's
        for group in self.optimizer.param_groups:  # the checkpoint's state replaces all of the old one
            for p in group["params"]:
                self.optimizer.state.pop(p, None)
        for p, name, e, keys, dim in self.optim:
            value = self._value(keys, dim)
            if e is not None:
                block = torch_state.to_block(e, value).to(local(p).dtype).contiguous()
                value = like(p, block) if isinstance(p, DTensor) else block
            elif isinstance(p, DTensor) and name != "step" and tuple(value.shape) == tuple(p.shape):
                value = like(p, value)  # a 0-d parameter's moments: DTensors as the optimizer made them
            self.optimizer.state[p][name] = value
        for group, saved in zip(self.optimizer.param_groups, self.settings, strict=True):
            for k, v in saved.items():  # every saved setting (initial_lr too), as torch's load_state_dict
                group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
