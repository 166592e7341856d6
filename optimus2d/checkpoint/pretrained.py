"""Hugging Face checkpoints (safetensors) into a converted model block by block, and back.

``load_pretrained(model, path)``: each rank reads from ``model.safetensors`` (or the shards named
by ``model.safetensors.index.json``) only the slices of its own blocks, with
``safe_open(file).get_slice(key)[slices]``; a tensor is read whole only where this rank holds it
whole (a replicated one, or any on a 1-rank mesh). For a ``Sharding`` whose dim d is split over
axes of total size n, this rank's block along d is ``[b·⌈N/n⌉, (b+1)·⌈N/n⌉) ∩ [0, N)`` with b its
index over those axes (outermost first); the rest of the block is zero padding (a vocabulary of 97
on q = 2: the block of j = 1 holds rows 49..96 and one zero row). A fused projection's parts are
split each on its own: one slice per part (``block_slices``). A tied head (``lm_head.weight``,
which Hugging Face leaves out of the files) is the embedding's Parameter: it is read once.

``save_pretrained(model, path)``: the serial tensors one at a time (each all-gathered, written by
the mesh's rank 0 into the open shard, dropped), in Hugging Face's layout: ``config.json``, shards of
at most ``max_shard_size`` with ``model.safetensors.index.json`` when there are several, a tied
head written once, so ``transformers``' ``from_pretrained`` loads it into the serial class.

Both are collective over the model's mesh; every check is made, and settled between the ranks (an
all-reduce of their verdicts), before anything is read or written: a checkpoint that does not fit
raises the same ``ValueError`` on every rank and leaves the model unchanged. The ranks also agree
that they read the same checkpoint (save: the same path), and ``save_pretrained`` puts crc32s of
the data in each file's header, which ``load_pretrained`` checks on what each rank reads
(``integrity.py``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from optimus2d.checkpoint import integrity
from optimus2d.checkpoint.progress import Progress, mib, on
from optimus2d.checkpoint.serial import _owners
from optimus2d.comm import primitives as P
from optimus2d.comm.dtensor import DTensor, like, local, stored_state_dict
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, Slices, block_slices
from optimus2d.convert.meta_init import materialize
from optimus2d.layers.base import serial_tensor, sharding_of, swap_block

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SAVING, PREVIOUS = ".optimus2d-saving", ".optimus2d-previous"  # beside path, as optimus2d.checkpoint
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_OURS = (WEIGHTS, INDEX, "config.json", "generation_config.json")  # what a save replaces in path
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_TEXT_BYTES = 1024  # of an error's text sent to the other ranks
_SENT = (ValueError, TypeError, OSError)  # error classes the other ranks raise as they are (else RuntimeError)


@dataclass
class _Tensor:
    """One tensor of the model, under all its state_dict keys (a tied head's: two)."""

    keys: list[str]
    holders: list[tuple[nn.Module, str]]  # (module, attribute) for every key
    tensor: torch.Tensor  # this rank's block (a Parameter or buffer)
    sharding: Sharding | None  # None: held whole (replicated)
    mesh: Mesh | None

    @property
    def serial_shape(self) -> tuple[int, ...]:
        return self.sharding.full_shape if self.sharding is not None else tuple(self.block.shape)

    @property
    def block(self) -> torch.Tensor:
        """The block itself (a DTensor parameter's local tensor), to read into."""
        return local(self.tensor)


def _volume(slices: Slices) -> int:
    return math.prod(s.stop - s.start for s in slices)


def _tensors(model: nn.Module) -> list[_Tensor]:
    """The model's tensors in state_dict order, each once (aliases grouped under its first key)."""
    owners, by_id, out = _owners(model), {}, []
    with stored_state_dict():
        state = model.state_dict(keep_vars=True)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"optimus2d.pretrained: {key} is not a tensor (a module's extra state)")
        if id(value) in by_id:
            by_id[id(value)].keys.append(key)
            by_id[id(value)].holders.append(owners[key])
            continue
        owner, name = owners[key]
        sharding, mesh = sharding_of(owner, name)
        if sharding is None and isinstance(value, DTensor) and not all(p.is_replicate() for p in value.placements):
            raise ValueError(
                f"optimus2d.pretrained: {key} is split by torch's parallelize_module (a module in 1D, "
                f"megatron.Megatron): safetensors reading and writing of such a model is not built; load the "
                f"serial model's weights before parallelize, or use optimus2d.checkpoint.save/load"
            )
        by_id[id(value)] = _Tensor([key], [owners[key]], value, sharding, mesh)
        out.append(by_id[id(value)])
    return out


def _model_mesh(tensors: list[_Tensor]) -> Mesh | None:
    meshes = {id(t.mesh): t.mesh for t in tensors if t.mesh is not None}
    if len(meshes) > 1:
        raise ValueError("optimus2d.pretrained: the model's modules live on more than one Mesh")
    return next(iter(meshes.values()), None)


def _agree(mesh: Mesh | None, what: str, error: BaseException | None) -> None:
    """Raise on every rank of ``mesh`` if any rank has an error: a failing rank its own, the others
    the first failing rank's (its class for ValueError, TypeError and OSError; else RuntimeError). Two
    all-reduces, the second only on failure; nothing is left half-exchanged, so (unlike a failed
    collective) the mesh stays usable: a failed save can be retried elsewhere."""
    if mesh is None or mesh.size == 1:
        if error is not None:
            raise error
        return
    flags = torch.zeros(mesh.size, dtype=torch.int64, device=mesh.device)
    flags[mesh.index("mesh")] = int(error is not None)
    P.all_reduce(flags, mesh, "mesh")
    failing = flags.nonzero().flatten().tolist()
    if not failing:
        return
    text = torch.zeros(1 + _TEXT_BYTES, dtype=torch.int64, device=mesh.device)  # [class, bytes of the message]
    if mesh.index("mesh") == failing[0]:
        raw = f"{type(error).__name__}: {error}".encode()[:_TEXT_BYTES]
        text[0] = next((n for n, cls in enumerate(_SENT, 1) if isinstance(error, cls)), 0)
        text[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    P.all_reduce(text, mesh, "mesh")
    if error is not None:
        raise error
    cls = _SENT[int(text[0]) - 1] if text[0] else RuntimeError
    message = bytes(text[1:][text[1:] > 0].tolist()).decode(errors="replace")
    ranks = ", ".join(str(mesh.ranks[n]) for n in failing)
    raise cls(f"{what} on {mesh}: rank {mesh.ranks[failing[0]]} (of the failing ranks {ranks}): {message}") from error


# ---- load ------------------------------------------------------------------------------------
def _checkpoint_files(path: str) -> dict[str, str]:
    """Checkpoint key → file holding it."""
    if not os.path.isdir(path) and os.path.isdir(path + PREVIOUS):  # a save killed between its renames
        path += PREVIOUS
    index, single = os.path.join(path, INDEX), os.path.join(path, WEIGHTS)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {key: os.path.join(path, name) for key, name in weight_map.items()}
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ValueError(
        f"load_pretrained: no {WEIGHTS} or {INDEX} in {path!r} (only safetensors checkpoints are read; "
        f"convert a pytorch_model.bin with transformers' save_pretrained)"
    )


def _headers(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint key → (shape, safetensors dtype), from the files' headers (no tensor read)."""
    out = {}
    for name in sorted(set(files.values())):
        with safe_open(name, "pt") as f:
            present = set(f.keys())
            for key in (k for k, n in files.items() if n == name):
                if key not in present:
                    raise ValueError(f"load_pretrained: {INDEX} places {key} in {name!r}, which does not hold it")
                piece = f.get_slice(key)
                out[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return out


def _ignored(model: nn.Module, which: str) -> re.Pattern | None:
    """transformers' patterns of checkpoint keys to ignore (``_keys_to_ignore_on_load_<which>``)."""
    patterns = set(getattr(model, f"_keys_to_ignore_on_load_{which}", None) or ())
    if which == "unexpected":  # transformers also drops these obsolete buffers of old checkpoints
        patterns |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def _plan_load(model, tensors, mesh, path, strict) -> tuple[list[tuple[_Tensor, str, str]], str, list]:
    """([(tensor, checkpoint key, file)], what was left aside, [(tensor, another key of its, file)]:
    a tied tensor the checkpoint holds under two of its keys, to be compared); raises ``ValueError``
    if the checkpoint does not fit."""
    files = _checkpoint_files(path)
    headers = _headers(files)
    prefix = getattr(model, "base_model_prefix", "") or ""
    own = {k for t in tensors for k in t.keys}
    names = _renamed_by_transformers(model, headers, own)  # the model's name of each checkpoint key → the key
    stored, mine = (any(k.startswith(f"{prefix}.") for k in keys) for keys in (names, own))
    head = []  # a base model read from a checkpoint of a model with a head: the head's keys, not read
    if prefix and mine and not stored:  # a checkpoint of the base model (GPT-2's hub files: "h.0...")
        renamed = {f"{prefix}.{k}": c for k, c in names.items()}
    elif prefix and stored and not mine:  # the base model from its LM's checkpoint ("transformer.h.0...")
        renamed = {k.removeprefix(f"{prefix}."): c for k, c in names.items() if k.startswith(f"{prefix}.")}
        head = sorted(c for k, c in names.items() if not k.startswith(f"{prefix}."))
    else:
        renamed = dict(names)
    plan, missing, shapes, twins = [], [], [], []
    for t in tensors:
        held = [k for k in t.keys if k in renamed]
        if not held:
            missing.append(t.keys[0])
            continue
        key = held[0]
        twins += [(t, renamed[other], files[renamed[other]]) for other in held[1:]]
        stored, dtype = headers[renamed[key]]
        if stored != t.serial_shape:
            shapes.append(f"{key}: checkpoint {list(stored)}, model {list(t.serial_shape)}")
        if dtype not in _CODES.values():
            shapes.append(f"{key}: dtype {dtype} is not one torch reads")
        if t.sharding is not None and tuple(t.block.shape) != t.sharding.local_shape(t.mesh):
            got, want = list(t.block.shape), list(t.sharding.local_shape(t.mesh))
            shapes.append(f"{key}: the model's block is {got}, its Sharding's {want}")
        plan.append((t, renamed[key], files[renamed[key]]))
    ignore_missing, ignore_unexpected = _ignored(model, "missing"), _ignored(model, "unexpected")
    missing = [k for k in missing if not (ignore_missing and ignore_missing.search(k))]
    unexpected = [
        c for m, c in renamed.items() if m not in own and not (ignore_unexpected and ignore_unexpected.search(c))
    ]
    if shapes or (strict and (missing or unexpected)):
        raise ValueError(
            f"load_pretrained: {path!r} does not fit the model on {mesh}: "
            + "; ".join(
                f"{what} ({len(keys)}): {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}"
                for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shapes", shapes))
                if keys and (strict or what == "shapes")
            )
        )
    few = lambda keys: ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")  # noqa: E731
    aside = [f"{len(missing)} keys of the model not in the checkpoint ({few(missing)})"] if missing else []
    aside += [f"{len(unexpected)} keys of the checkpoint not in the model ({few(unexpected)})"] * bool(unexpected)
    aside += [f"{len(head)} keys of a head the model has not ({few(head)})"] * bool(head)
    if (missing or unexpected) and (mesh is None or mesh.index("mesh") == 0):  # said aloud, once, as
        # transformers' load report says it: what is missing is initialised from seed 0
        warnings.warn(f"load_pretrained(strict=False): {'; '.join(aside)}", stacklevel=3)
    return plan, "; ".join(aside), twins


def _renamed_by_transformers(model: nn.Module, headers: dict, own: set[str]) -> dict[str, str]:
    """The model's name for each checkpoint key → the key: transformers' renamings of this model's
    class applied (``conversion_mapping``: ViT's ``encoder.layer.N.attention.attention.query`` is
    ``layers.N.attention.q_proj`` since transformers 5, and its ``save_pretrained`` still writes the
    old names; BERT's legacy ``LayerNorm.gamma``), as its ``from_pretrained`` applies them, where
    the key is not the model's own already. Converters that merge or split tensors are not applied
    (their keys stay unexpected)."""
    names = {k: k for k in headers}
    transformers = sys.modules.get("transformers")  # a transformers model's class imported it
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return names
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # not a transformers release with conversions
        return names
    try:
        renamings = [t for t in get_model_conversion_mapping(model) if type(t) is WeightRenaming]
    except Exception:  # a model class transformers does not map
        return names
    moved = {}
    for key in [k for k in headers if k not in own]:
        name = key
        try:
            for renaming in renamings:
                name, _ = renaming.rename_source_key(name)
        except Exception:  # another release's interface: the keys as they are
            return names
        if name != key and name not in names:
            moved[key] = name
    for key, name in moved.items():
        del names[key]
        names[name] = key
    return names


def _untied(path: str, plan: list, twins: list) -> ValueError | None:
    """The refusal of a checkpoint holding one tied tensor under two keys with different values (an
    LM head saved apart from its table: transformers then unties them), compared block by block."""
    first = {id(t): (key, name) for t, key, name in plan}
    differ = []
    for t, other, name in twins:
        key, file = first[id(t)]
        a, b = (torch.empty(t.block.shape, dtype=t.block.dtype) for _ in range(2))
        _read_block(file, key, t, a)
        _read_block(name, other, t, b)
        if not torch.equal(a, b):
            differ.append(f"{key} and {other}")
    if not differ:
        return None
    return ValueError(
        f"load_pretrained: {path!r} holds {'; '.join(differ)} with different values, which the model ties (one "
        f"tensor): transformers would untie them; build the model untied (tie_word_embeddings=False)"
    )


_CHUNK = 16 << 20  # bytes of a file a rank maps at once: safetensors maps every page a slice reads


def _read_block(name: str, key: str, t: _Tensor, out: torch.Tensor, verify=None) -> None:
    """Copy this rank's block of ``key`` in the file ``name`` into ``out``, slice by slice, each
    slice in runs of rows spanning at most ``_CHUNK`` bytes of the file, opened anew for each: a
    column block of a [V, h] table touches every row's pages, and the pages of one run leave the
    rank's memory before the next is read. (safetensors' slices are views of the mapped file: the
    copy is the one read.) ``verify(name, key, first_row, last_row)`` checks each run's bytes first."""
    verify = verify or (lambda *_: None)
    with safe_open(name, "pt") as f:
        shape = f.get_slice(key).get_shape()
    if t.sharding is None:
        pieces = [(tuple(slice(0, n) for n in shape), tuple(slice(0, n) for n in shape))]
    else:
        pieces = block_slices(t.sharding, t.mesh)
        if sum(_volume(dst) for _, dst in pieces) < out.numel():
            out.zero_()  # padding
    if not shape:  # a scalar
        verify(name, key, 0, 1)
        with safe_open(name, "pt") as f:
            out.copy_(f.get_tensor(key))
        return
    rows = max(1, _CHUNK // max(1, math.prod(shape[1:]) * out.element_size()))
    for src, dst in pieces:
        if not _volume(src):
            continue
        first, last, at = src[0].start, src[0].stop, dst[0].start
        for start in range(first, last, rows):
            stop = min(start + rows, last)
            to = (slice(at + start - first, at + stop - first), *dst[1:])
            verify(name, key, start, stop)
            with safe_open(name, "pt") as f:
                out[to].copy_(f.get_slice(key)[(slice(start, stop), *src[1:])])


def _install(t: _Tensor, block: torch.Tensor) -> None:
    """Put a block read for a tensor that was on the meta device in its place: the same Parameter
    (or buffer) object where ``torch.utils.swap_tensors`` can, else a new one in every holder."""
    old = t.tensor
    try:
        swap_block(old, block)
    except RuntimeError:  # weak references to it (swap_tensors refuses): a new tensor in every holder
        block = like(old, block) if isinstance(old, DTensor) else block
        new = nn.Parameter(block, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else block
        new.__dict__.update(old.__dict__)  # optimus2d's marks
        for module, name in t.holders:
            (module._parameters if isinstance(new, nn.Parameter) else module._buffers)[name] = new
        wanted = new.requires_grad  # a frozen parameter keeps its hooks for when it is unfrozen
        for hook in (getattr(old, "_backward_hooks", None) or {}).values():
            new.requires_grad_(True).register_hook(hook)
        new.requires_grad_(wanted)
        t.tensor = new


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    progress: bool | None = None,
) -> None:
    """Fill ``model`` (converted by ``optimus2d.parallelize``, or plain torch) from the Hugging Face
    checkpoint directory ``path`` (safetensors), in place; collective over the model's mesh.

    Each rank reads only its blocks' slices (see the module's docstring); values are cast to the
    model's dtypes. Tensors on the meta device get this rank's block, allocated on ``device``
    (default: the mesh's device), as the same Parameter objects; those the checkpoint does not hold
    (buffers that are not saved, such as LLaMA's rotary table; with ``strict=False``, missing
    weights) are then initialised as the serial model does (``optimus2d.materialize``, seed 0), so
    the model is whole, as after transformers' ``from_pretrained``. Checkpoints of the base model
    (keys without ``model.base_model_prefix``) are read too, and a base model reads the checkpoint
    of a model with a head (its keys under the prefix; the head's are not read, and the summary
    names them), and transformers' patterns of keys to ignore are honoured. Raises ``ValueError``
    on every rank, before anything is read, listing missing and unexpected keys (``strict=False``:
    those are skipped, and the summary names them) and shapes that differ, or
    naming each rank's directory where the ranks found different checkpoints (their files' names,
    sizes, headers and checksums, or samples of the data where there are none);
    ``RuntimeError`` (or the error itself) on every rank if a rank fails while reading, and
    ``ValueError`` if the data a rank reads fails its checksum (``save_pretrained`` writes them; a
    directory without them, as Hugging Face writes it, is read unverified and the summary says
    so): the model is then partly read.

    ``progress``: a bar over the tensors on the mesh's first rank (None: when stderr is a
    terminal); that rank ends with one summary line (on stderr with the bar, else logged at INFO
    to the ``optimus2d`` logger).
    """
    path = os.fspath(path)
    start = time.perf_counter()
    tensors = _tensors(model)
    mesh = _model_mesh(tensors)
    plan, checked, error, aside, twins = [], None, None, "", []
    try:
        plan, aside, twins = _plan_load(model, tensors, mesh, path, strict)
        checked = integrity.Checked(_checkpoint_files(path).values(), INDEX)  # headers; checksums if any
    except Exception as err:  # a file unreadable or damaged (safetensors' error), on this rank or every one
        error = err if isinstance(err, (ValueError, TypeError)) else ValueError(f"load_pretrained: {path!r}: {err!r}")
    _agree(mesh, "load_pretrained", error)
    integrity.agree_identity(mesh, path, checked)  # the same checkpoint on every rank
    by_file: dict[str, list[tuple[_Tensor, str]]] = {}
    for t, key, name in plan:
        by_file.setdefault(name, []).append((t, key))
    error = None
    bar = Progress("load_pretrained", len(plan), mesh, progress)
    bar.start = start
    try:
        if (untied := _untied(path, plan, twins)) is not None:  # before the model is written
            raise untied
        with bar, torch.no_grad():
            for name, items in sorted(by_file.items()):
                for t, key in items:  # the file opened per run of rows: its pages leave memory at once
                    if t.tensor.is_meta:
                        where = device or (t.mesh.device if t.mesh is not None else "cpu")
                        block = torch.empty(t.block.shape, dtype=t.tensor.dtype, device=where)
                        _read_block(name, key, t, block, checked.verify)
                        _install(t, block)
                    else:
                        _read_block(name, key, t, t.block, checked.verify)
                    bar.update()
    except Exception as err:  # every rank learns of it (none is left waiting): raised below
        error = err
    _agree(mesh, "load_pretrained (reading the blocks)", error)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):  # what no checkpoint holds
        # (LLaMA's rotary table) as the serial model makes it
        materialize(model, seed=0, device=device or (mesh.device if mesh is not None else None))
    nbytes = sum(math.prod(t.serial_shape) * t.tensor.element_size() for t, _, _ in plan)
    where = on(mesh)
    bar.summary(
        f"load_pretrained: {len(plan)} tensors, {mib(nbytes)} from {path} in {bar.seconds():.1f} s{where} "
        f"({len(by_file)} file{'s' if len(by_file) != 1 else ''}{checked.note()})" + (f"; {aside}" if aside else "")
    )


# ---- save ------------------------------------------------------------------------------------
def _shard_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or "5GB" (10⁹), "500MiB" (2²⁰), "30KB"..."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]I?B|B)?\s*", size.upper())
    if not match:
        raise ValueError(f"save_pretrained: max_shard_size {size!r} is not a size such as 5GB or 500MiB")
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    return int(match.group(1)) * units[match.group(2)]


def _plan_save(model, tensors, max_bytes: int) -> list[list[tuple[_Tensor, str]]]:
    """Shards of (tensor, key written), greedily in order as transformers does; each alias group
    under one key: not a key transformers declares tied (``lm_head.weight``), else its first."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    shards, size = [[]], 0
    for t in tensors:
        if t.tensor.is_meta:
            raise ValueError(f"save_pretrained: {t.keys[0]} is on the meta device (load it first)")
        if t.tensor.dtype not in _CODES:
            raise TypeError(f"save_pretrained: {t.keys[0]} has dtype {t.tensor.dtype}, which safetensors lacks")
        key = next((k for k in t.keys if k not in tied), t.keys[0])
        if key in skip:
            continue
        nbytes = math.prod(t.serial_shape) * t.tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((t, key))
        size += nbytes
    return shards


def _header(shard: list[tuple[_Tensor, str]]) -> bytes:
    entries, at = {}, 0
    for t, key in shard:
        end = at + math.prod(t.serial_shape) * t.tensor.element_size()
        entries[key] = {"dtype": _CODES[t.tensor.dtype], "shape": list(t.serial_shape), "data_offsets": [at, end]}
        at = end
    return integrity.header(entries)  # with room for the data's checksums


def _write_tensor(f, full: torch.Tensor, t: _Tensor) -> None:
    if tuple(full.shape) != t.serial_shape or full.dtype != t.tensor.dtype:  # what the header says
        raise ValueError(
            f"save_pretrained: {t.keys[0]} gathered as {full.dtype}{list(full.shape)}, not its serial shape"
        )
    data = full.detach().to("cpu").contiguous().reshape(-1)
    f.write(data.view(torch.uint8).numpy().data)


def _close(f) -> BaseException | None:
    """Flush, fsync and close ``f``; the error, if any."""
    try:
        f.flush()
        os.fsync(f.fileno())
    except Exception as err:
        return err
    finally:
        f.close()
    return None


def _prepare(path: str) -> str:
    """Rank 0: finish what a killed save left, then a fresh temporary directory beside ``path``."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"save_pretrained: {path!r} exists and is not a directory")
    saving, previous = path + SAVING, path + PREVIOUS
    if os.path.isdir(previous):
        if os.path.isdir(path):
            shutil.rmtree(previous)  # its replacement was committed
        else:
            os.rename(previous, path)  # killed between the two renames: the last save is this one
    if os.path.lexists(saving):
        shutil.rmtree(saving)
    os.makedirs(saving)
    return saving


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _commit(saving: str, path: str) -> None:
    """Rank 0: ``saving`` becomes ``path`` by renames; files of ``path`` a save does not write (a
    tokenizer) are carried over, the old weights are not."""
    previous = path + PREVIOUS
    if os.path.isdir(path):
        for name in os.listdir(path):
            if name in _OURS or _SHARD.fullmatch(name) or os.path.lexists(os.path.join(saving, name)):
                continue
            src, dst = os.path.join(path, name), os.path.join(saving, name)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(src, dst)
        os.rename(path, previous)
    os.rename(saving, path)
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    if os.path.isdir(previous):
        shutil.rmtree(previous)


def _write_config(model: nn.Module, saving: str, dtype: torch.dtype | None) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)  # as transformers' save_pretrained sets them, on a copy
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(saving)
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        generation.save_pretrained(saving)


def save_pretrained(
    model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB", progress: bool | None = None
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory; collective: every rank calls it.

    The files are the serial model's (``from_pretrained(path)`` of its transformers class loads
    them): ``config.json`` (and ``generation_config.json``) from ``model.config``, safetensors
    shards of at most ``max_shard_size`` bytes each (an int, or "5GB", "500MiB"; a larger tensor
    alone), ``model.safetensors.index.json`` when there are several, a tied head once. Serial
    tensors are all-gathered one at a time (every rank holds at most one full tensor), rank 0 of
    the mesh streams each into its shard. Atomic: written into ``path.optimus2d-saving`` and
    renamed to ``path`` once complete (an existing ``path`` is replaced, keeping the files it holds
    that a save does not write, such as a tokenizer's), so a killed save leaves ``path`` as it was
    (or, killed between the two renames, at ``path.optimus2d-previous``, which ``load_pretrained``
    and the next save take up). Each file's header holds crc32s of its data, per MiB (``integrity.py``;
    Hugging Face's loaders ignore them). Errors are raised on every rank, and ranks that name
    different paths are refused before anything is written.

    ``progress``: a bar over the tensors on the mesh's first rank (None: when stderr is a
    terminal); that rank ends with one summary line (on stderr with the bar, else logged at INFO
    to the ``optimus2d`` logger).
    """
    start = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    tensors = _tensors(model)
    mesh = _model_mesh(tensors)
    writer = mesh is None or mesh.index("mesh") == 0
    integrity.agree_path(mesh, "save_pretrained", path)  # before rank 0 prepares anything
    shards, saving, error = _plan_and_prepare(model, tensors, max_shard_size, path, writer)
    _agree(mesh, "save_pretrained", error)
    names = _shard_names(len(shards))
    bar = Progress("save_pretrained", sum(len(shard) for shard in shards), mesh, progress)
    bar.start = start
    error = _stream_shards(shards, names, saving, writer, bar)
    if writer and error is None:
        error = _finish_save(model, tensors, shards, names, saving, path)
    if writer and error is not None and saving is not None:
        shutil.rmtree(saving, ignore_errors=True)
    bar.close()
    _agree(mesh, "save_pretrained (writing)", error)  # also the barrier: none returns before the commit
    count = sum(len(shard) for shard in shards)
    nbytes = sum(math.prod(t.serial_shape) * t.tensor.element_size() for shard in shards for t, _ in shard)
    where = on(mesh)
    files = f"{len(names)} file{'s' if len(names) != 1 else ''}"
    bar.summary(f"save_pretrained: {count} tensors, {mib(nbytes)} in {files} to {path} in {bar.seconds():.1f} s{where}")


def _plan_and_prepare(model: nn.Module, tensors: list, max_shard_size: int | str, path: str, writer: bool):
    """The shards, and on the writer the temporary directory; an error is returned, for ``_agree``."""
    shards, saving, error = [], None, None
    try:
        shards = _plan_save(model, tensors, _shard_bytes(max_shard_size))
        if writer:
            saving = _prepare(path)
    except Exception as err:
        error = err
    return shards, saving, error


def _shard_names(count: int) -> list[str]:
    """The files of ``count`` shards, named as Hugging Face names them."""
    return [WEIGHTS] if count == 1 else [f"model-{n + 1:05d}-of-{count:05d}.safetensors" for n in range(count)]


def _stream_shards(
    shards: list, names: list[str], saving: str | None, writer: bool, bar: Progress
) -> BaseException | None:
    """Gather every serial tensor (collective, in order), the writer streaming each into its shard; its error."""
    error = None
    for shard, name in zip(shards, names, strict=True):
        f = None
        if writer and error is None:
            try:
                f = integrity.Writer(open(os.path.join(saving, name), "wb"), _header(shard))  # closed by _close
            except Exception as err:
                error = err
        for t, key in shard:
            full = serial_tensor(*t.holders[t.keys.index(key)])  # collective: every rank, one tensor at a time
            if f is not None and error is None:
                try:
                    _write_tensor(f, full, t)
                except Exception as err:  # rank 0 goes on gathering with the others: none is left waiting
                    error = err
            del full
            bar.update()
        if f is not None:  # closed after an error too
            closed = _close(f)
            error = error or closed
    return error


def _finish_save(
    model: nn.Module, tensors: list, shards: list, names: list[str], saving: str, path: str
) -> Exception | None:
    """The writer, every shard written: the index (several shards), the config, then the commit; its error."""
    try:
        if len(shards) > 1:
            weight_map = {key: name for shard, name in zip(shards, names, strict=True) for _, key in shard}
            total = sum(math.prod(t.serial_shape) * t.tensor.element_size() for s in shards for t, _ in s)
            params = sum(math.prod(t.serial_shape) for s in shards for t, _ in s)
            index = {"metadata": {"total_size": total, "total_parameters": params}, "weight_map": weight_map}
            with open(os.path.join(saving, INDEX), "w") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        floats = [t.tensor.dtype for t in tensors if t.tensor.is_floating_point()]
        _write_config(model, saving, floats[0] if floats else None)
        _commit(saving, path)
    except Exception as err:
        return err
    return None
