"""Agreement before trust: ranks check that they are about to exchange the same thing.

A collective between ranks that disagree (one rank's batch is longer, its dtype other, its full
input different) either hangs or silently returns a wrong block. ``agree`` prevents both with one
small all-gather of a fixed-size signature over a group — it cannot itself mismatch — and every
member compares the same table, so every member raises the same error at the same point, before
the exchange it protects:

* ``[crc32(operation), crc32(description), error flag, content₁, content₂]`` per rank (int64):
  the description names the tensors' dtypes and shapes; the content words are a checksum of a
  tensor that must be replicated (``fingerprint``); the flag says this rank refused its input.
* All rows equal: nothing more is sent. Otherwise a second all-gather of each rank's text (its
  description or its error, 1 KiB) lets every rank raise an error that names the operation, the
  axis, this rank's and the peers' shapes (or the refusing rank and its error), and the ranks.

Levels (``Mesh(check=...)`` or ``$OPTIMUS2D_CHECK``): "off"; "entry" (default) checks user data
where it enters (``scatter``, ``scatter_batch``, ``gather``, ``parallelize``'s serial weights) and
the inputs of every outermost optimus2d module call; "every" also checks before each collective
(a debugging level, like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). The exchanges are counted apart, in
``CommCounter.checks``: they are not the algorithm's traffic.

Under ``torch.compile`` the same checks are steps of the compiled graph: while tracing, the
descriptions (dtypes and shapes, fixed in a graph) are made here and handed to the operator
``optimus2d::agree`` (``comm/traced.py``; defined in ``comm/compiled.py``, which calls back into
this module), whose exchange and verdict run with the graph, every call, before the module's own
collectives.

``signature``, ``verdict``, ``exchange_texts`` and ``gather_world`` also serve the agreements over
the default group of ``comm/replicas.py`` (``Mesh``, ``stage_meshes``), which has no mesh yet, and
a pipeline's (``pipeline/agreement.py``: each step over the world, ``gather_group`` over the copies).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from optimus2d.comm import compat, shared_groups, traced, watch
from optimus2d.comm.counter import record_check

LEVELS = ("off", "entry", "every")
_RUN = 127  # elements a run of fingerprint(): prime, so runs straddle rows of any power-of-two width
_TEXT_BYTES = 1024


def describe(t: object) -> str:
    """``"float32[4, 8, 16]"`` for a tensor; the type's name otherwise."""
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return type(t).__name__


def describe_call(args: Iterable, kwargs: dict) -> str:
    """The dtypes and shapes of the tensors a call receives (other arguments by type)."""
    parts = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items() if v is not None]
    return ", ".join(parts)


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two int64 checksums of ``t``: equal on two ranks iff (almost surely) the tensors are.

    Exact (no rounding: ranks on different CPUs agree) and position-aware (a permuted batch or
    sequence differs). Floats: the xor of their bits (``torch.hash_tensor``) per row of the last
    dim, and per run of ``_RUN`` consecutive elements (runs that straddle the rows, so values moved
    within a row differ too), each list mixed with odd position weights, plus the elements' bits as
    integers summed by position (xor cancels a value met twice: rows of ones and of sevens would
    agree); about two reading passes. Blind only to two values swapped inside one row and one run.
    Integers (token ids): exact int64 sums, weighted by position, of the elements and of the rows.
    """
    if t.numel() == 0:
        return 0, 0
    t = t.detach().contiguous()
    flat = t.reshape(-1)
    if not (t.is_floating_point() or t.is_complex()):
        return _mix(flat.long()), _mix(t.reshape(t.shape[0] if t.dim() else 1, -1).sum(1, dtype=torch.int64))
    rows = torch.hash_tensor(t.reshape(-1, t.shape[-1] if t.dim() else 1), dim=1)
    whole = flat.numel() - flat.numel() % _RUN
    runs = [torch.hash_tensor(flat[:whole].view(-1, _RUN), dim=1)] if whole else []
    if whole < flat.numel():
        runs.append(torch.hash_tensor(flat[whole:]).reshape(1))
    # xor cancels a value met an even number of times (a row of ones hashes as a row of sevens):
    # the bits as integers, summed by position, tell such rows apart
    bits = flat.view(_INTS.get(flat.element_size(), torch.int64)).long()
    return _wrap(_mix(rows.view(torch.int64)) + _mix(bits)), _mix(torch.cat(runs).view(torch.int64))


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size → same-size ints


def _wrap(n: int) -> int:
    """``n`` as an int64 (two's complement), as the signature's tensor holds it."""
    return (n + 2**63) % 2**64 - 2**63


def _mix(hashes: torch.Tensor) -> int:
    if hashes.numel() == 0:
        return 0
    weights = torch.arange(1, 2 * hashes.numel(), 2, dtype=torch.int64, device=hashes.device)  # odd: invertible
    return int((hashes * weights).sum().item())


def agree(
    mesh,
    what: str,
    axis: str = "mesh",
    *,
    description: str = "",
    content: tuple[int, ...] = (),
    error: BaseException | None = None,
) -> None:
    """Check that every member of this rank's ``axis`` group calls ``what`` on the same thing.

    Raises on every member (``ValueError``, or the refusing rank's ``ValueError``/``TypeError``)
    when the descriptions or contents differ, or when any member passes its own ``error``.
    """
    if mesh.size == 1 or mesh.axis_size(axis) == 1:
        if error is not None:
            raise error
        return
    if torch.compiler.is_compiling() and not content:
        traced.agree(mesh, what, axis, description, None, error)
        return
    where = f"{what} over {axis} of {mesh}" if axis != "mesh" else f"{what} on {mesh}"
    ident = f"{what} over {axis} of mesh #{mesh.uid}"  # where, without this rank's coordinates
    gather = lambda t: _gather(mesh, axis, t)  # noqa: E731
    # A refusal caught (a training loop skipping a bad batch) leaves the mesh usable: reported, it
    # killed the mesh for its next wait of over a second (PeerFailedError)
    decide(gather, mesh.members(axis), where, f"{what} of {description}", content, error, ident)


def agree_group(mesh, group, what: str, description: str, error: BaseException | None) -> None:
    """``agree`` over ``group``, a torch process group across meshes (a pipeline's lane: one rank of
    each stage mesh; None, one rank, or a mesh whose check is "off", checks nothing): every member
    passes the same ``description`` and no ``error``, or every member raises. Waited on like
    ``mesh``'s collectives; a refusal is not reported to ``mesh`` (its members raised it already,
    or agree here)."""
    if group is None or dist.get_world_size(group) == 1 or mesh.check == "off":
        if error is not None:
            raise error
        return
    ranks = tuple(dist.get_process_group_ranks(group))
    where = f"{what} over the ranks {list(ranks)}"
    gather = lambda t: gather_group(t, group, mesh, where)  # noqa: E731
    decide(gather, ranks, where, f"{what} of {description}", (), error, f"{what} over a group")


@torch.compiler.disable  # its answer steers the caller's Python: a graph break, taken here and not in zlib
def agree_distinct(mesh, what: str, description: str, error: BaseException | None, t: torch.Tensor | None) -> bool:
    """``agree`` on ``what`` over the mesh, in the same one all-gather also asking whether every rank
    passes a ``t`` that is the same and not constant (then True: the caller refuses a full tensor
    where blocks are due). A rank with ``t`` None (a tagged block) makes the answer False."""
    ident = f"{what} over mesh of mesh #{mesh.uid}"
    words = signature(ident, f"{what} of {description}", (), error)[:3]
    if t is not None and t.numel() and bool((t.reshape(-1) != t.reshape(-1)[0]).any()):
        words += [1, *fingerprint(t)]
    else:
        words += [0, 0, 0]
    table = _gather(mesh, "mesh", torch.tensor(words, dtype=torch.int64))
    agreed = torch.cat([table[:, :3], torch.zeros_like(table[:, :2])], 1)  # the checksums are not to agree
    gather = lambda x: _gather(mesh, "mesh", x)  # noqa: E731
    verdict(agreed, gather, mesh.members("mesh"), f"{what} on {mesh}", f"{what} of {description}", error, None)
    return bool((table[:, 3] == 1).all()) and bool((table[:, 4:] == table[0, 4:]).all())


def decide(
    gather: Callable[[torch.Tensor], torch.Tensor],
    ranks: tuple[int, ...],
    where: str,
    description: str,
    content: tuple[int, ...],
    error: BaseException | None,
    ident: str | None = None,
) -> None:
    """``agree``'s logic over any all-gather (a mesh axis, a group across meshes); ``ident`` (default
    ``where``) names the operation alike on every rank. Every member reads the same table and raises
    the same error, none is left in a collective: the mesh stays usable (nothing is reported)."""
    table = gather(torch.tensor(signature(ident or where, description, content, error), dtype=torch.int64))
    verdict(table, gather, ranks, where, description, error, None)


def signature(ident: str, description: str, content: tuple[int, ...], error: BaseException | None) -> list[int]:
    """This rank's row of the table: ``[crc32(ident), crc32(description), error flag, content₁, content₂]``."""
    return [_crc(ident), _crc(description), int(error is not None), *content, *[0] * (2 - len(content))]


def verdict(table, gather, ranks, where: str, description: str, error, mesh) -> None:
    """Return if every row of ``table`` (the members' ``signature``s) is the same and this rank has no
    ``error``; else raise, on every rank alike (after one more all-gather, of each rank's text)."""
    record_check(where, table)
    if bool((table == table[0]).all()):
        if error is not None:
            raise error
        return
    text = f"{type(error).__name__}: {error}" if error is not None else description
    texts = exchange_texts(gather, text)
    me = dist.get_rank() if dist.is_initialized() else 0
    failing = [n for n in range(len(ranks)) if table[n, 2]]
    if failing:
        lines = "; ".join(f"rank {ranks[n]} refused it: {texts[n]}" for n in failing)
        first = texts[failing[0]].partition(":")[0]
        cls = {"ValueError": ValueError, "TypeError": TypeError}.get(first, RuntimeError)
        err = cls(f"{where}: {lines}")
        watch.report(err, [mesh] if mesh is not None else [])
        raise err from error
    groups: dict[tuple, list[int]] = {}
    for n in range(len(ranks)):
        groups.setdefault((texts[n], *table[n, 3:].tolist()), []).append(ranks[n])
    same_text = len({key[0] for key in groups}) == 1
    parts = []
    for (text_n, *checksum), members in groups.items():
        who = f"rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))}"
        parts.append(f"{who}: {text_n}" + (f" (checksum {checksum[0] & (2**64 - 1):016x})" if same_text else ""))
    mine = texts[ranks.index(me)] if me in ranks else "?"
    kind = "hold different values (checksums differ)" if same_text else "disagree"
    raise ValueError(f"{where}: the ranks {kind}: this rank ({me}) has {mine}; " + "; ".join(parts))


def check_replicated(mesh, what: str, t: torch.Tensor, validate: Callable[[], None], check: bool | None) -> None:
    """``t`` must be valid (``validate()`` raises if not) and the same on every rank of ``mesh`` (a
    full input about to be split): its dtype, shape and checksum are agreed (level "entry" and up,
    or ``check=True``), and one rank's refusal is every rank's."""
    if check is False or (check is None and mesh.check == "off") or mesh.size == 1:
        validate()
        return
    error = None
    try:
        validate()
    except (ValueError, TypeError) as err:
        error = err
    if torch.compiler.is_compiling():  # the checksum is taken when the graph runs
        traced.agree(mesh, what, "mesh", describe(t), t if error is None else None, error)
        return
    content = fingerprint(t) if error is None else ()
    agree(mesh, what, description=describe(t), content=content, error=error)


def check_same_tensors(mesh, what: str, named: list[tuple[str, torch.Tensor]], check: bool | None = None) -> None:
    """Every rank of ``mesh`` holds the same ``named`` tensors (names, shapes, values): one
    all-gather of their combined checksum, and only when they differ a second one of each
    tensor's, to name those that differ. Meta tensors are skipped (nothing to compare)."""
    if check is False or (check is None and mesh.check == "off") or mesh.size == 1:
        return
    named = [(name, t) for name, t in named if t.device.type != "meta"]
    prints = torch.tensor([fingerprint(t) for _, t in named], dtype=torch.int64).reshape(-1, 2)
    layout = _crc(";".join(f"{name}:{describe(t)}" for name, t in named))
    description = f"{len(named)} tensors (names, dtypes and shapes {layout:08x})"
    advice = "Build the model from the same seed on every rank (torch.manual_seed) or load the same weights"
    _check_same(mesh, what, [name for name, _ in named], prints, description, "tensors", advice)


def check_same_texts(mesh, what: str, named: list[tuple[str, str]], advice: str, check: bool | None = None) -> None:
    """Every rank of ``mesh`` holds the same ``named`` texts (a module's class and settings): as
    ``check_same_tensors``, naming those that differ."""
    if check is False or (check is None and mesh.check == "off") or mesh.size == 1:
        return
    prints = torch.tensor([(_crc(text), len(text)) for _, text in named], dtype=torch.int64).reshape(-1, 2)
    description = f"{len(named)} modules (names {_crc(';'.join(name for name, _ in named)):08x})"
    _check_same(mesh, what, [name for name, _ in named], prints, description, "modules' settings", advice)


def _check_same(mesh, what: str, names: list[str], prints: torch.Tensor, description: str, kind: str, advice: str):
    try:
        agree(mesh, what, description=description, content=(_mix(prints[:, 0]), _mix(prints[:, 1])))
    except ValueError as err:
        if "checksums differ" not in str(err):
            raise
        table = _gather(mesh, "mesh", prints.reshape(-1)).view(mesh.size, -1, 2)
        differ = [name for n, name in enumerate(names) if not bool((table[:, n] == table[0, n]).all())]
        listed = ", ".join(differ[:20]) + (f" and {len(differ) - 20} more" if len(differ) > 20 else "")
        raise ValueError(
            f"{what} on {mesh}: {len(differ)} of {len(names)} {kind} differ between ranks: {listed}. {advice}"
        ) from None


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def exchange_texts(gather: Callable[[torch.Tensor], torch.Tensor], text: str) -> list[str]:
    """Every member's ``text`` (cut to 1 KiB), in member order: one all-gather through ``gather``."""
    raw = text.encode()[: _TEXT_BYTES - 1]
    buf = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
    table = gather(buf)
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in table]


def _gather(mesh, axis: str, t: torch.Tensor) -> torch.Tensor:
    """Every member's ``t`` (1-D, the same size everywhere), member-major; a watched wait."""
    return Posted(mesh, axis, t).wait()


class Posted:
    """An all-gather of ``t`` (1-D, the same size everywhere) over ``mesh``'s ``axis``, posted now:
    ``ready()`` tests it, ``wait()`` (a watched wait) returns every member's ``t``, member-major. On
    an NCCL mesh the host words of axis "mesh" go over its gloo ``check_group`` (no device sync)."""

    def __init__(self, mesh, axis: str, t: torch.Tensor) -> None:
        self.mesh, self.axis, n = mesh, axis, mesh.axis_size(axis)
        if mesh.mpi is not None:
            self._out = t.new_empty((n, t.numel()))
            self._request = mesh.mpi.all_gather(t, self._out, axis)
            self.ready = self._request.test
            return
        device, group = mesh.device, mesh.group(axis)
        if axis == "mesh" and mesh.check_group is not None:
            device, group = torch.device("cpu"), mesh.check_group
        t = t.to(device)
        self._out, self._cpu = t.new_empty((n, t.numel())), device.type == "cpu"
        self._work = compat.all_gather_single(self._out.view(-1), t, group=group, async_op=True)
        self.ready = self._work.is_completed

    def __del__(self) -> None:
        work = self.__dict__.get("_work")
        try:
            dropped = work is not None and not work.is_completed()  # in flight (MPI's: its Request's own)
        except Exception:  # torch shutting down
            dropped = True
        if dropped:
            shared_groups.spoil(self.__dict__.get("mesh"))

    def wait(self) -> torch.Tensor:
        mesh, axis, out = self.mesh, self.axis, self._out
        if mesh.mpi is not None:
            self._request.wait()
            return out
        if self._cpu:
            watch.Watched(self._work, mesh, f"agreement of {axis}", mesh.timeout).wait()
        else:
            self._work.wait()
        order = mesh.group_order(axis)  # row g is group rank g's: member order[g] (the check group's is the mesh's)
        if order is not None:
            out = out[[order.index(m) for m in range(mesh.axis_size(axis))]]
        return out.cpu()


def gather_group(t: torch.Tensor, group, mesh, what: str) -> torch.Tensor:
    """Every member's ``t`` (1-D, the same size everywhere) over ``group``, a torch process group across
    meshes (a pipeline's data-parallel copies), in group rank order; on ``mesh``'s device, a watched wait."""
    src = t.to(mesh.device)
    out = src.new_empty((dist.get_world_size(group), t.numel()))
    work = compat.all_gather_single(out.view(-1), src, group=group, async_op=True)
    if mesh.device.type == "cpu":
        watch.Watched(work, mesh, what, mesh.timeout).wait()
    else:
        work.wait()
    return out.cpu()


def gather_world(t: torch.Tensor, timeout: float) -> torch.Tensor:
    """Every rank's ``t`` over the default group (for ``Mesh``, which has no groups yet), bounded by ``timeout``."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    src = t.to(device) if device is not None else t
    out = src.new_empty((dist.get_world_size(), t.numel()))
    work = compat.all_gather_single(out.view(-1), src, async_op=True)
    if device is None:
        watch.wait(work.is_completed, None, "Mesh agreement over the default group", timeout)
    work.wait()
    return out.cpu()
