"""Meshes side by side, and torch's ``DeviceMesh``: what ``Mesh`` needs to build replicas.

**Replicas.** Data parallelism over 2D meshes runs ``R`` meshes of one shape on disjoint ranks at
once, e.g. on 8 ranks two 2×2 meshes, {0, 1, 2, 3} and {4, 5, 6, 7}. Every rank of the world builds
its own replica's mesh, at the same point of the program: ``Mesh(q, depth, ranks=<its replica's
ranks>)`` or ``Mesh.from_device_mesh(dm["depth", "row", "col"])``. ``agree`` checks that over the
default group, in one all-gather of 8 words per rank: the shape and options every rank asked for
(``agreement.signature``, judged by ``agreement.verdict``: else every rank raises "the ranks
disagree"), and a hash of the ranks it asked for
with its own position in them. Either every rank asked for the same ranks (one mesh, maybe over a
subset of the world: the ranks outside it hold no block), or the rank sets partition the world:
every rank is in the mesh it asks for, and the ranks of a mesh all ask for it with the same ranks
in the same order (so the meshes are disjoint, cover the world and have the same shape). Anything
else is refused with the same ``ValueError`` on every rank. From the table every rank learns every
replica's ranks, so it can create every replica's process groups in the same order (creating a
group is collective over the world) and split MPI's COMM_WORLD alike.

**DeviceMesh.** A DeviceMesh dim names a coordinate: ``dm["depth", "row", "col"].mesh[k, i, j]`` is
the rank at (k, i, j), the order ``Mesh`` gives its ``ranks`` (rank n sits at k = n // q²,
i = (n % q²) // q, j = n % q), so ``init_device_mesh(dev, (d, q, q), mesh_dim_names=DIMS)`` and
``Mesh(q, d)`` are the same mesh. The process group along a dim varies that coordinate: the group
of dim "row" holds the ranks of one *column* (same k, j), optimus2d's "col" group, and dim "col"
holds a row, optimus2d's "row" group (``AXIS_OF_DIM``).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from optimus2d.comm import agreement

DIMS = ("depth", "row", "col")  # the DeviceMesh dims of the coordinates (k, i, j)
AXIS_OF_DIM = {"depth": "depth", "row": "col", "col": "row"}  # the optimus2d group along each dim
_WORDS = 8  # per rank: agreement's 5 words, the 2 hashes of the ranks asked for, the position in them


def _world_table(ident: str, description: str, error, extra: tuple[int, int, int], timeout: float):
    words = agreement.signature(ident, description, (), error) + list(extra)
    return agreement.gather_world(torch.tensor(words, dtype=torch.int64), timeout)


def _texts(text: str, timeout: float) -> list[str]:
    return agreement.exchange_texts(lambda t: agreement.gather_world(t, timeout), text)


def agree(
    ident: str, description: str, asked: str, ranks: tuple[int, ...] | None, error, timeout: float
) -> tuple[tuple[int, ...], ...]:
    """Every rank's replica (see the module docstring), over the default group; collective.

    ``description``: the mesh asked for, without its ranks (the same on every rank); ``asked``: the
    same with the ranks, for messages; ``ranks``: the ranks this rank asked for (None if it refused
    them with ``error``). Returns the replicas' ranks, ordered by their smallest rank: one tuple when
    every rank asked for the same ranks. Raises the same error on every rank otherwise.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    text = ",".join(map(str, ranks or ()))
    position = ranks.index(me) if ranks is not None and me in ranks else -1
    extra = (zlib.crc32(text.encode()), zlib.adler32(text.encode()), position)
    table = _world_table(ident, description, error, extra, timeout)
    gather = lambda t: agreement.gather_world(t, timeout)  # noqa: E731
    agreement.verdict(table[:, :5], gather, tuple(range(world)), "Mesh", asked, error, None)
    asking: dict[tuple[int, int], list[int]] = {}
    for r, (crc, adler, _) in enumerate(table[:, 5:].tolist()):
        asking.setdefault((crc, adler), []).append(r)
    if len(asking) == 1:
        return (tuple(ranks),)
    positions, size = table[:, 7].tolist(), len(ranks)
    outside = [r for r in range(world) if positions[r] < 0]
    short = next((members for members in asking.values() if len(members) != size), None)
    if outside or short is not None:
        if outside:
            problem = f"rank{'s' if len(outside) > 1 else ''} {_list(outside)} not in the mesh it asks for"
        else:
            who = f"rank{'s' if len(short) > 1 else ''} {_list(short)}"
            problem = f"only {who} ask for the {size}-rank mesh that rank {short[0]} asks for"
        texts = _texts(asked, timeout)
        by_text: dict[str, list[int]] = {}
        for r, t in enumerate(texts):
            by_text.setdefault(t, []).append(r)
        parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_list(rs)}: {t}" for t, rs in by_text.items())
        raise ValueError(
            f"Mesh: the ranks ask for meshes over different ranks that do not split the world into replicas "
            f"({problem}; every rank must be in the mesh it asks for, and all the ranks of a mesh must ask for "
            f"it with the same ranks in the same order): this rank ({me}) has {texts[me]}; {parts}"
        )
    replicas = []
    for members in asking.values():
        slots = [0] * size
        for r in members:
            slots[positions[r]] = r
        replicas.append(tuple(slots))
    return tuple(sorted(replicas, key=min))


def agree_world(what: str, description: str, error, timeout: float) -> None:
    """Every rank of the world calls ``what`` with the same ``description``, and one rank's ``error``
    is every rank's: one all-gather of 8 words over the default group, then the same ``ValueError``
    (or the refusing rank's error) on every rank. Collective over the world."""
    table = _world_table(what, description, error, (0, 0, 0), timeout)
    gather = lambda t: agreement.gather_world(t, timeout)  # noqa: E731
    world = tuple(range(dist.get_world_size()))
    agreement.verdict(table[:, :5], gather, world, what, description, error, None)


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def read_device_mesh(device_mesh, device_type: str):
    """``(q, depth, ranks, sub, None)``: the mesh that ``device_mesh`` gives this rank, ``sub`` its
    ("depth", "row", "col") slice; or ``(None, None, None, None, error)`` saying why not (raised by
    ``Mesh`` on every rank, through the agreement). No communication."""
    try:
        return (*_read(device_mesh, device_type), None)
    except (ValueError, TypeError) as err:
        return None, None, None, None, err


def _read(device_mesh, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"Mesh.from_device_mesh needs a torch DeviceMesh, got {type(device_mesh).__name__}")
    names = tuple(device_mesh.mesh_dim_names or ())
    shown = f"DeviceMesh(shape={tuple(device_mesh.shape)}, mesh_dim_names={names})"
    missing = [d for d in DIMS if d not in names]
    if missing:
        raise ValueError(
            f"Mesh.from_device_mesh: {shown} has no dim named {', '.join(map(repr, missing))}; name the mesh's dims "
            f"{DIMS} (a 2D mesh has a depth of 1: init_device_mesh(device, (1, q, q), mesh_dim_names={DIMS})), "
            f"any others are data-parallel replicas"
        )
    if device_mesh.device_type != device_type:
        raise ValueError(
            f"Mesh.from_device_mesh: {shown} is on {device_mesh.device_type!r}, but the mesh's tensors live on "
            f"{device_type!r} (backend {dist.get_backend()!r})"
        )
    try:
        sub = device_mesh if names == DIMS else device_mesh[DIMS]
    except KeyError:
        raise ValueError(
            f"Mesh.from_device_mesh: cannot slice {shown} to {DIMS}: the three dims must come in this order"
        ) from None
    depth, rows, cols = sub.shape
    if rows != cols:
        raise ValueError(
            f"Mesh.from_device_mesh: {shown} has {rows} rows and {cols} columns; the mesh needs q×q ranks per depth"
        )
    try:
        ranks = tuple(int(r) for r in sub.mesh.flatten().tolist())
    except RuntimeError:
        raise ValueError(
            f"Mesh.from_device_mesh: rank {dist.get_rank()} is in none of the meshes of {shown}; every rank of the "
            f"world must be in one when the DeviceMesh has replicas"
        ) from None
    return rows, depth, ranks, sub


def reusable_groups(mesh, sub, members: dict[str, tuple[int, ...]]) -> dict:
    """The process groups of ``sub`` (a DeviceMesh of the mesh's DIMS) that can serve as the
    mesh's own: a group per dim whose ranks are the mesh's group, in the mesh's order (torch sorts a
    group's ranks), never the default group. All or none, the same answer on every rank (one
    all-reduce over the world)."""
    found, usable = {}, mesh.coord is not None
    for dim in DIMS if usable else ():
        axis = AXIS_OF_DIM[dim]
        if mesh.axis_size(axis) == 1:
            continue
        try:
            group = sub.get_group(dim)
        except Exception:  # a DeviceMesh built without process groups (_init_backend=False)
            usable = False
            break
        if group is dist.group.WORLD or dist.get_process_group_ranks(group) != list(members[axis]):
            usable = False
            break
        found[axis] = group
    flag = torch.tensor([int(usable)], device=mesh.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return found if flag.item() else {}


def build_device_mesh(mesh):
    """A DeviceMesh of ``mesh`` with dims ("depth", "row", "col"), over every replica; collective
    over the world (every rank asks, at the same point: checked first, like ``Mesh``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{mesh}.device_mesh needs torch.distributed: call optimus2d.init() first")
    if dist.get_world_size() > 1:
        what = f"Mesh.device_mesh of mesh #{mesh.uid}"
        table = _world_table(what, what, None, (0, 0, 0), mesh.timeout)
        gather = lambda t: agreement.gather_world(t, mesh.timeout)  # noqa: E731
        world = tuple(range(dist.get_world_size()))
        agreement.verdict(table[:, :5], gather, world, "Mesh.device_mesh", f"{what} (every rank asks)", None, None)
    table = torch.tensor(mesh.replicas, dtype=torch.int64).view(-1, mesh.depth, mesh.q, mesh.q)
    if table.shape[0] == 1:
        device_mesh = DeviceMesh(mesh.device.type, table[0], mesh_dim_names=DIMS)
        flatten_for_norms(device_mesh)
        return device_mesh
    return DeviceMesh(mesh.device.type, table, mesh_dim_names=("replica", *DIMS))[DIMS]


def flatten_for_norms(device_mesh) -> None:
    """Flatten the dims a parameter's norm is reduced over, so that DTensor's redistribute reduces
    it in one all-reduce, not one per dim in turn (in an order that could differ between ranks):
    ("row", "col"), and with data-parallel dims (FSDP shards over them) those and ("row", "col").
    Collective over the world (a flattened dim has its process group): every rank, in one order."""
    names = tuple(device_mesh.mesh_dim_names)
    data = tuple(n for n in names if n not in DIMS)
    for dims in {("row", "col"), tuple(n for n in names if n in data or n in ("row", "col"))}:
        if len(dims) > 1 and math.prod(device_mesh.size(names.index(n)) for n in dims) > 1:
            sub = device_mesh[dims]
            if hasattr(sub, "_flatten"):
                sub._flatten()
