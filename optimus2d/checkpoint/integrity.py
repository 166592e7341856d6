"""What every rank reads is the same checkpoint, and what it reads is what was written.

Identity (``load_pretrained``). Before reading, the ranks agree (``comm.agreement.agree``: one
all-gather of a few words) on a digest of the directory each found: its files' names and sizes,
their safetensors headers (raw bytes), ``model.safetensors.index.json``, and, for a file without
checksums, 32 bytes at the start, the middle and the end of each tensor's data (two checkpoints of
the same shapes have the same headers: their data tells them apart). Only on a difference, a
second exchange names each rank's path: paths may differ (node-local copies) where contents agree.

Checksums (``save_pretrained``, verified by ``load_pretrained``). safetensors has none, so the
writer puts them in each file's own header, under ``__metadata__`` (a ``str → str`` map that
Hugging Face's loaders carry and ignore), where they cannot go stale or be left behind::

    "optimus2d.checksums": "crc32:1048576:<crc32 of the header's tensor entries>:<crc32 of chunk 0><...>"

each crc32 as 8 hex digits, chunk k being bytes [k·2²⁰, (k+1)·2²⁰) of the file's data region
(after the header). The header is written with zeros in their place, the data streamed through the
sums, then the zeros overwritten (the same length). A rank checks the entries' crc32 of every file
it opens (a flipped bit in a header that still parses), and, before reading a run of rows, the
chunks that overlap those rows' bytes and it has not checked yet: it reads no chunk it does not
touch, and none twice. A file written by another tool has no checksums: it is read unverified, and
the summary line says so. (A tool that rewrites the data but copies the header's metadata leaves
stale checksums: refused as damaged, the message says how to drop them.)
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import struct
import zlib
from collections.abc import Iterable

import torch.distributed as dist

from optimus2d.checkpoint.progress import mib
from optimus2d.comm import replicas
from optimus2d.comm.agreement import agree

KEY = "optimus2d.checksums"
CHUNK = 1 << 20  # bytes of a file's data region under one crc32
_SAMPLE = 32  # bytes of a tensor's data, at 3 places, in the identity of a file without checksums
_MAX_HEADER = 100_000_000  # safetensors' own limit


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _entries_crc(entries: dict) -> int:
    """crc32 of a header's tensor entries, in a canonical form (any JSON spelling of them agrees)."""
    tensors = {k: v for k, v in entries.items() if k != "__metadata__"}
    return zlib.crc32(json.dumps(tensors, sort_keys=True, separators=(",", ":")).encode())


# ---- save --------------------------------------------------------------------------------------
def header(entries: dict, chunk: int | None = None) -> bytes:
    """A safetensors header for ``entries`` (key → dtype, shape, data_offsets, in data order),
    with room for the checksums of its data (per ``chunk`` bytes, default ``CHUNK``): what
    ``Writer`` fills in."""
    chunk = chunk or CHUNK
    size = max((e["data_offsets"][1] for e in entries.values()), default=0)
    zeros = "0" * 8 * math.ceil(size / chunk)
    metadata = {"format": "pt", KEY: f"crc32:{chunk}:{_entries_crc(entries):08x}:{zeros}"}
    raw = json.dumps({**entries, "__metadata__": metadata}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class Writer:
    """A safetensors file being written: ``header(...)``, then its data, every byte into the crc32
    of its chunk. ``flush()`` first writes the checksums into the header (every byte the header
    promises must have been written), so ``flush``, ``fsync``, ``close`` leave a complete file."""

    def __init__(self, file, raw_header: bytes) -> None:
        self.file, self.sums, self.crc, self.filled, self.sealed = file, [], 0, 0, False
        entries = json.loads(raw_header[8:])
        value = entries["__metadata__"][KEY]
        self.chunk = int(value.split(":")[1])
        self.expected = len(value.split(":")[3]) // 8
        self.at = raw_header.index(f'"{KEY}":"'.encode()) + len(KEY) + 4 + value.rindex(":") + 1
        file.write(raw_header)

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.file.write(view)
        while len(view):
            piece = view[: self.chunk - self.filled]
            self.crc, self.filled = zlib.crc32(piece, self.crc), self.filled + len(piece)
            if self.filled == self.chunk:
                self.sums.append(self.crc)
                self.crc, self.filled = 0, 0
            view = view[len(piece) :]

    def flush(self) -> None:
        if not self.sealed:
            if self.filled:
                self.sums.append(self.crc)
                self.crc, self.filled = 0, 0
            if len(self.sums) != self.expected:
                raise ValueError(
                    f"save_pretrained: {self.file.name!r}: {len(self.sums)} chunks of data written, its header "
                    f"promises {self.expected}"
                )
            end = self.file.tell()
            self.file.seek(self.at)
            self.file.write("".join(f"{s:08x}" for s in self.sums).encode())
            self.file.seek(end)
            self.sealed = True
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()


# ---- load --------------------------------------------------------------------------------------
class _File:
    """One safetensors file as its header says: where its data starts, its tensors' byte ranges,
    and its checksums (None: none), with the chunks this rank has checked."""

    def __init__(self, name: str) -> None:
        self.name, self.size = name, os.path.getsize(name)
        with open(name, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"load_pretrained: {name!r} is not a safetensors file (a header of {length} bytes)")
            self.raw = f.read(length)
        self.start = 8 + length
        entries = json.loads(self.raw)
        self.tensors = {k: v for k, v in entries.items() if k != "__metadata__"}
        self.order = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in self.tensors.items())
        self.sums, self.chunk, self.checked = None, CHUNK, set()
        value = (entries.get("__metadata__") or {}).get(KEY)
        if value is not None:
            self._parse(value)

    def _parse(self, value: str) -> None:
        match = re.fullmatch(r"crc32:(\d+):([0-9a-f]{8}):((?:[0-9a-f]{8})*)", value)
        if match is None or int(match.group(1)) <= 0:
            raise ValueError(f"load_pretrained: {self.name!r} is damaged: its header's {KEY} is not readable")
        self.chunk = int(match.group(1))
        if int(match.group(2), 16) != _entries_crc(self.tensors):
            raise ValueError(
                f"load_pretrained: {self.name!r} is damaged: its header's tensor entries have crc32 "
                f"{_entries_crc(self.tensors):08x}, its checksum says {match.group(2)} (found on rank {_rank()})"
            )
        digits = match.group(3)
        self.sums = [int(digits[n : n + 8], 16) for n in range(0, len(digits), 8)]
        want = math.ceil((self.size - self.start) / self.chunk)
        if len(self.sums) != want:
            raise ValueError(
                f"load_pretrained: {self.name!r} is truncated or extended: {self.size - self.start} bytes of data "
                f"({want} chunks of {self.chunk}), its checksums cover {len(self.sums)} chunks"
            )

    def digest(self, h) -> None:
        """Into the identity: name, size, header; samples of the data where there are no checksums."""
        h.update(f"{os.path.basename(self.name)}\0{self.size}\0{len(self.raw)}\0".encode())
        h.update(self.raw)
        if self.sums is not None:
            return  # the header holds the checksums of all of the data
        with open(self.name, "rb") as f:
            for begin, end, _ in self.order:
                for at in sorted({begin, (begin + end) // 2, max(begin, end - _SAMPLE)}):
                    f.seek(self.start + at)
                    h.update(f.read(max(0, min(_SAMPLE, end - at))))

    def verify(self, key: str, first_row: int, last_row: int) -> int:
        """Check the chunks overlapping rows ``[first_row, last_row)`` of ``key`` (a 0-d tensor: all
        of it) not checked yet; the bytes read."""
        if self.sums is None:
            return 0
        entry = self.tensors[key]
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        if shape:
            row = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + first_row * row, begin + last_row * row
        if end <= begin:
            return 0
        todo = [k for k in range(begin // self.chunk, (end - 1) // self.chunk + 1) if k not in self.checked]
        if not todo:
            return 0
        read = 0
        with open(self.name, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)  # no copy: crc32 reads the pages the block's read then finds cached
            try:
                for k in todo:
                    data = view[self.start + k * self.chunk : self.start + (k + 1) * self.chunk]
                    read += len(data)
                    crc = zlib.crc32(data)
                    data.release()
                    if crc != self.sums[k]:
                        raise ValueError(self._damaged(k, crc, key))
                    self.checked.add(k)
            finally:
                view.release()
        return read

    def _damaged(self, k: int, crc: int, reading: str) -> str:
        a, b = k * self.chunk, min((k + 1) * self.chunk, self.size - self.start)
        names = [key for begin, end, key in self.order if begin < b and end > a]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return (
            f"load_pretrained: {self.name!r} is damaged: bytes {a}..{b - 1} of its data (chunk {k} of "
            f"{len(self.sums)}, holding {shown or 'no tensor'}) have crc32 {crc:08x}, its checksum says "
            f"{self.sums[k]:08x} (found on rank {_rank()}, reading its block of {reading}; a file rewritten by a "
            f"tool that kept its header's metadata keeps stale checksums: drop its {KEY!r})"
        )


class Checked:
    """The checkpoint's files as read on this rank: their identity, and the checks of what is read."""

    def __init__(self, files: Iterable[str], index: str) -> None:
        """``files``: the checkpoint's safetensors files; ``index``: the name of its index file
        (``model.safetensors.index.json``), part of the identity if it is there."""
        self.files = {name: _File(name) for name in sorted(set(files))}
        first = next(iter(self.files), "")
        self.index = os.path.join(os.path.dirname(first), index) if first else None
        self.index = self.index if self.index is not None and os.path.isfile(self.index) else None

    def identity(self) -> tuple[str, tuple[int, int]]:
        """(a summary: files, bytes, checksums and digest; the digest as two int64)."""
        h = hashlib.blake2b(digest_size=16)
        if self.index is not None:
            with open(self.index, "rb") as f:
                h.update(f.read())
        for f in self.files.values():
            f.digest(h)
        raw = h.digest()
        words = tuple(int.from_bytes(raw[n : n + 8], "little", signed=True) for n in (0, 8))
        n = len(self.files)
        total = sum(f.size for f in self.files.values())
        return f"{n} file{'s' if n != 1 else ''}, {mib(total)}, {self.checksums()}, digest {raw.hex()[:16]}", words

    def checksums(self) -> str:
        summed = sum(f.sums is not None for f in self.files.values())
        if summed == len(self.files):
            return "checksummed"
        if summed == 0:
            return "no checksums"
        return f"checksums in {summed} of {len(self.files)} files"

    def verify(self, name: str, key: str, first_row: int, last_row: int) -> None:
        """Check the chunks under rows ``[first_row, last_row)`` of ``key`` in ``name`` (see ``_File.verify``)."""
        self.files[name].verify(key, first_row, last_row)

    def note(self) -> str:
        """For the summary line: what was verified, or that nothing could be."""
        unchecked = sum(f.sums is None for f in self.files.values())
        if not unchecked:
            return ", checksums verified"
        if unchecked == len(self.files):
            return ", no checksums: data not verified"
        return f", {unchecked} without checksums: {'its' if unchecked == 1 else 'their'} data not verified"


def agree_identity(mesh, path: str, checked: Checked | None) -> None:
    """Every rank of ``mesh`` found the same checkpoint (``Checked.identity``), or every rank raises
    ``ValueError`` naming each rank's path and what it found. Collective; the planning's errors
    are settled before (``checked`` is None only where one was)."""
    if mesh is None or mesh.size == 1 or checked is None:
        return
    summary, words = checked.identity()
    try:
        agree(mesh, "load_pretrained", description=f"a checkpoint of {summary}", content=words)
        return
    except ValueError as err:  # no rank refused (settled before): the contents differ
        first = err
    where = os.path.dirname(next(iter(checked.files))) if checked.files else path
    try:  # every rank is here: name the paths (the summaries differ, so this raises)
        agree(mesh, "load_pretrained", description=f"{os.path.abspath(where)!r}: {summary}")
    except ValueError as err:
        raise ValueError(
            f"{err} (not the same checkpoint on every rank; compared: its files' names, sizes, headers, "
            f"and their data's checksums or samples)"
        ) from None
    raise first


def agree_path(mesh, what: str, path: str, optimizer=None) -> None:
    """Every rank that saves with ``mesh`` names the same directory (its absolute, normalised path)
    and passes an optimizer alike (``describe_optimizer``), or every rank raises ``ValueError``
    naming each rank's, before anything is written. Over the mesh; over the world where the mesh is
    one of several data-parallel replicas (they commit together). Collective."""
    if mesh is None:
        return
    description = f"the directory {os.path.abspath(os.fspath(path))!r}, {describe_optimizer(optimizer)}"
    if dist.is_available() and dist.is_initialized() and len(getattr(mesh, "replicas", ()) or ()) > 1:
        replicas.agree_world(f"{what} over replica meshes", description, None, mesh.timeout)
    elif mesh.size > 1:
        agree(mesh, what, description=description)


def describe_optimizer(optimizer) -> str:
    """``"optimizer AdamW (2 groups, 8 parameters)"``, or ``"no optimizer"``: what every rank of a
    save or load must pass alike (one rank's missing optimizer was left fresh by a load)."""
    if optimizer is None:
        return "no optimizer"
    groups = getattr(optimizer, "param_groups", [])
    count = sum(len(g.get("params", ())) for g in groups)
    return f"optimizer {type(optimizer).__name__} ({len(groups)} groups, {count} parameters)"


def agree_optimizer(mesh, what: str, optimizer) -> None:
    """Every rank of ``mesh`` passes ``what`` an optimizer alike (``describe_optimizer``), or every
    rank raises ``ValueError`` naming each rank's. Collective over the mesh."""
    if mesh is not None and mesh.size > 1:
        agree(mesh, what, description=describe_optimizer(optimizer))
