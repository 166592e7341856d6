"""The files of a checkpoint: atomic commit and a verified manifest (used by ``optimus2d.checkpoint``).

Commit. ``save`` never writes into ``path`` (P below) itself:

1. Rank 0 of the model's group (the coordinator) first finishes what an interrupted save left
   behind: P missing but ``P.optimus2d-previous`` there → renamed back to P; both there → the
   latter removed (its replacement was committed); a stale ``P.optimus2d-saving`` removed. It
   refuses (``ValueError``, before anything is written) to remove or replace anything that is not a
   directory of files optimus2d writes. Then it creates ``P.optimus2d-saving`` (beside P: the same
   file system, so renames are atomic) and broadcasts its verdict: the others wait for it.
2. Every rank writes its blocks into ``P.optimus2d-saving`` (DCP, files fsynced), then checksums
   the files it wrote; the coordinator gathers the lists and writes ``manifest.json`` last. With
   data-parallel replicas the group is the world and only replica 0 writes (its blocks are every
   replica's); the other ranks wait in the gather, so that none returns before the commit.
3. The coordinator commits: renames P → ``P.optimus2d-previous`` (if P exists), then
   ``P.optimus2d-saving`` → P, removes ``P.optimus2d-previous``, and broadcasts its verdict: no
   rank returns from ``save`` before the commit, or without its error.

POSIX cannot rename onto a non-empty directory, hence two renames. A process killed at any moment
leaves either P untouched, or (between the renames) P missing and the previous checkpoint whole at
``P.optimus2d-previous``: ``load``/``read`` of P then read that one, and the next ``save`` renames
it back first. A half-written ``P.optimus2d-saving`` has no manifest and is refused.

Manifest (``manifest.json``, written to a temporary name, fsynced, renamed)::

    {"format": 3, "checksum": "crc32", "files": {".metadata": {"bytes": 1843, "crc32": "5c6f0e1a"},
                                                 "__0_0.distcp": {"bytes": 5321, "crc32": "9a0b1c2d"}}}

Format 3 stores the keys torch's ``get_state_dict`` gives (``checkpoint/torch_state.py``); format 2
stored ``model/<key>`` and ``optim/<key>/<name>`` (read still); format 1 was format 2 without a
manifest (read only with ``verify=False``: nothing says it is complete).
zlib's crc32 runs at about 4.5 GB/s reading from the page cache on one core here (sha1 1.9, md5
0.8): it catches truncated and damaged files, not tampering. Verification is collective: every
rank checks that each listed file exists with its size, and checksums its share of them; one
``all_gather_object`` of the verdicts, then every rank raises the first error, or none does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Callable

import torch.distributed as dist

FORMAT = 3  # the directory's: the manifest's "format", also the keys' (see above)
MANIFEST = "manifest.json"
SAVING = ".optimus2d-saving"
PREVIOUS = ".optimus2d-previous"
_OURS = re.compile(r"__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|manifest\.json(\.tmp)?")
_CHUNK = 4 << 20
_Failure = tuple[str, str]  # (exception class name, message), sent between ranks


class _Ranks:
    """The ranks a save or load runs on: a torch.distributed group, or this process alone."""

    def __init__(self, group, no_dist: bool) -> None:
        self.group = group
        self.alone = no_dist
        self.rank = 0 if no_dist else dist.get_rank(group)
        self.size = 1 if no_dist else dist.get_world_size(group)

    def broadcast(self, obj):
        """rank 0's ``obj`` on every rank."""
        if self.alone:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def gather(self, obj) -> list | None:
        """every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.alone:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def all_gather(self, obj) -> list:
        if self.alone:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _attempt(fn: Callable[[], object], what: str) -> tuple[object, _Failure | None]:
    """(fn(), None), or (None, the failure) to send to the other ranks."""
    try:
        return fn(), None
    except Exception as err:
        if isinstance(err, ValueError | RuntimeError) and str(err).startswith("optimus2d.checkpoint"):
            return None, (type(err).__name__, str(err))
        return None, ("RuntimeError", f"optimus2d.checkpoint: {what}: {type(err).__name__}: {err}")


def _raise(failure: _Failure | None) -> None:
    if failure is not None:
        kind, message = failure
        raise (ValueError if kind == "ValueError" else RuntimeError)(message)


def checksum(file: str | os.PathLike) -> dict[str, int | str]:
    """``{"bytes": size, "crc32": 8 hex digits}`` of one file, read in 4 MiB chunks."""
    crc, size = 0, 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def save_atomically(path: str | os.PathLike, write: Callable[[str], int | None], group, no_dist: bool) -> None:
    """Run ``write(directory)`` on every rank into a temporary directory, then commit it as ``path``.

    Collective over ``group`` (or this process alone when ``no_dist``); see the module docstring.
    ``write`` returns the rank its files are named after (DCP's ``__<rank>_*.distcp``: its rank in
    the group that wrote them), or None where it wrote nothing (data-parallel replicas: one writes,
    the others only take part in the commit). A rank whose ``write`` raises still takes part, so
    no rank waits for it: every rank then raises (that rank its own error).
    """
    tmp = begin(path, group, no_dist)
    try:  # DCP returns on every writer once all have written and its rank 0 has written .metadata
        wrote, own = write(tmp), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        own, wrote = err, None
    commit(path, group, no_dist, wrote, own)


def begin(path: str | os.PathLike, group, no_dist: bool) -> str:
    """Step 1 (collective): the temporary directory every rank writes into."""
    ranks, final = _Ranks(group, no_dist), os.path.normpath(os.fspath(path))
    verdict = _attempt(lambda: _prepare(final), f"preparing {final!r}")[1] if ranks.rank == 0 else None
    _raise(ranks.broadcast(verdict))
    return final + SAVING


def commit(path: str | os.PathLike, group, no_dist: bool, wrote: int | None, own: BaseException | None) -> None:
    """Steps 2 and 3 (collective) once this rank wrote its files named after rank ``wrote`` (None:
    it wrote none), or failed with ``own``: the manifest, then the renames; raises on every rank if
    any rank failed (a failed rank its own error)."""
    ranks, final = _Ranks(group, no_dist), os.path.normpath(os.fspath(path))
    tmp = final + SAVING
    mine: tuple = ({}, None)
    if own is not None:
        mine = (None, ("RuntimeError", f"optimus2d.checkpoint: writing into {tmp!r}: {type(own).__name__}: {own}"))
    elif wrote is not None:
        prefix = f"__{wrote}_"
        mine = _attempt(
            lambda: {n: checksum(os.path.join(tmp, n)) for n in os.listdir(tmp) if n.startswith(prefix)},
            f"checksumming the files written into {tmp!r}",
        )
    gathered = ranks.gather(mine)
    verdict = None
    if ranks.rank == 0:
        failures = [f for _, f in gathered if f is not None]
        verdict = failures[0] if failures else _attempt(lambda: _finish(final, gathered), f"committing {final!r}")[1]
    verdict = ranks.broadcast(verdict)
    if own is not None:
        raise own
    _raise(verdict)


def _finish(final: str, gathered: list) -> None:
    tmp, files = final + SAVING, {}
    for part, _ in gathered:
        files.update(part)
    for name in os.listdir(tmp):  # .metadata and whatever no rank claimed
        if name not in files:
            files[name] = checksum(os.path.join(tmp, name))
    body = json.dumps({"format": FORMAT, "checksum": "crc32", "files": dict(sorted(files.items()))}, indent=1)
    with open(os.path.join(tmp, MANIFEST + ".tmp"), "w") as f:
        f.write(body + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(os.path.join(tmp, MANIFEST + ".tmp"), os.path.join(tmp, MANIFEST))
    _fsync_dir(tmp)
    previous = final + PREVIOUS
    if os.path.lexists(final):
        os.rename(final, previous)
    os.rename(tmp, final)  # the commit
    _fsync_dir(os.path.dirname(final) or ".")
    if os.path.lexists(previous):
        shutil.rmtree(previous)


def _prepare(final: str) -> None:
    """Clean up after an interrupted save, check that P may be replaced, create P.optimus2d-saving."""
    previous, tmp = final + PREVIOUS, final + SAVING
    if os.path.basename(final) in ("", ".", ".."):
        raise ValueError(f"optimus2d.checkpoint: cannot save to {final!r}: name a directory of its own")
    if os.path.lexists(previous):
        if os.path.lexists(final):  # cut after the commit: P is the newer checkpoint
            _check_ours(previous)
            shutil.rmtree(previous)
        else:  # cut between the two renames: P.optimus2d-previous is the last committed checkpoint
            os.rename(previous, final)
    if os.path.lexists(final):
        _check_ours(final)
    if os.path.lexists(tmp):
        _check_ours(tmp)
        shutil.rmtree(tmp)
    os.makedirs(tmp)


def _check_ours(directory: str) -> None:
    """Refuse to replace or remove anything but a directory of files optimus2d.checkpoint writes."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        raise ValueError(f"optimus2d.checkpoint: {directory!r} exists and is not a directory: not replacing it")
    foreign = sorted(
        n for n in os.listdir(directory) if not _OURS.fullmatch(n) or not os.path.isfile(os.path.join(directory, n))
    )
    if foreign:
        raise ValueError(
            f"optimus2d.checkpoint: {directory!r} holds {foreign[:3]}, which optimus2d.checkpoint did not write: "
            "not replacing it (move it away first)"
        )


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def locate(path: str | os.PathLike) -> str:
    """The directory that holds the checkpoint committed at ``path`` (see the module docstring)."""
    final = os.path.normpath(os.fspath(path))
    for directory in (final, final + PREVIOUS):
        if os.path.isdir(directory):
            return directory
    hint = f" (a save into {final + SAVING!r} did not finish)" if os.path.isdir(final + SAVING) else ""
    raise ValueError(f"optimus2d.checkpoint: no readable checkpoint at {os.fspath(path)!r}: it does not exist{hint}")


def _check(path: str | os.PathLike, index: int, count: int, verify: bool = True) -> tuple[str, str | None]:
    """Check the checkpoint at ``path`` against its manifest: every file's size, and the checksums of
    files ``index::count`` (in name order). Returns its directory and its manifest's crc32 (None if
    not ``verify``: the directory alone)."""
    directory = locate(path)
    if not verify:
        return directory, None
    where = f"{os.fspath(path)!r}" + (f" (at {directory!r})" if directory != os.path.normpath(path) else "")
    try:
        with open(os.path.join(directory, MANIFEST), "rb") as f:
            raw = f.read()
        manifest = json.loads(raw)
        files = manifest["files"]
    except FileNotFoundError:
        raise ValueError(
            f"optimus2d.checkpoint: no readable checkpoint at {where}: it has no {MANIFEST}, so a save did not "
            "finish (or the directory was not written by optimus2d.checkpoint.save). A checkpoint written before "
            "checkpoints had manifests (optimus2d 0.1.0) can be read unverified with verify=False"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"optimus2d.checkpoint: no readable checkpoint at {where}: bad {MANIFEST} ({err})") from err
    if manifest.get("format", 0) > FORMAT:
        raise ValueError(
            f"optimus2d.checkpoint: {where} has format {manifest['format']}, newer than this optimus2d's {FORMAT}"
        )
    names = sorted(files)
    for name in names:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise RuntimeError(f"optimus2d.checkpoint: could not read {where}: {file!r} is missing")
        size = os.path.getsize(file)
        if size != files[name]["bytes"]:
            raise RuntimeError(
                f"optimus2d.checkpoint: could not read {where}: {file!r} has {size} bytes, "
                f"the manifest says {files[name]['bytes']}"
            )
    for name in names[index::count]:
        crc = checksum(os.path.join(directory, name))["crc32"]
        if crc != files[name]["crc32"]:
            raise RuntimeError(
                f"optimus2d.checkpoint: could not read {where}: {os.path.join(directory, name)!r} is damaged "
                f"(crc32 {crc}, the manifest says {files[name]['crc32']})"
            )
    return directory, f"{zlib.crc32(raw):08x}"


def verified(path: str | os.PathLike, group, no_dist: bool, verify: bool = True) -> str:
    """The directory of the checkpoint at ``path``, checked against its manifest (unless not
    ``verify``); collective over ``group`` (each rank checksums a share). Raises the same error on
    every rank if anything is wrong."""
    ranks = _Ranks(group, no_dist)
    check = lambda: _check(path, ranks.rank, ranks.size, verify)  # noqa: E731
    found, failure = _attempt(check, f"checking {os.fspath(path)!r}")
    verdicts = ranks.all_gather((found, failure))
    for _, f in verdicts:
        _raise(f)
    if len({d for (d, _), _ in verdicts}) > 1:
        raise RuntimeError(
            f"optimus2d.checkpoint: the ranks found different checkpoints at {os.fspath(path)!r}: "
            f"{sorted({d for (d, _), _ in verdicts})} (a save running at the same time?)"
        )
    manifests = {m for (_, m), _ in verdicts}
    if len(manifests) > 1:  # per-node copies of a checkpoint (each rank checksums a share of its own copy)
        who = {m: [r for r, ((_, mm), _) in enumerate(verdicts) if mm == m] for m in sorted(manifests)}
        raise RuntimeError(
            f"optimus2d.checkpoint: the ranks found different checkpoints at {os.fspath(path)!r}: its "
            f"{MANIFEST} differs ("
            + "; ".join(f"crc32 {m} on ranks {ranks_}" for m, ranks_ in who.items())
            + "): copies of the checkpoint on each node that are not the same"
        )
    return found[0]
