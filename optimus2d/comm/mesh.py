"""The device mesh: p = depth·q² ranks as ``depth`` stacked q×q SUMMA grids."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from optimus2d.comm import agreement, compat, replicas, shared_groups, watch

AXES = ("row", "col", "depth")
TRANSPORTS = ("auto", "torch", "mpi")
_built = 0  # meshes this process has built: the n-th mesh of every rank must be the same mesh


class Mesh:
    """``depth`` stacked q×q meshes of ranks; ``depth=1`` is 2D (Optimus), ``depth>1`` 2.5D (Tesseract).

    Every rank has coordinates ``(k, i, j)`` = (depth, row, column). The n-th rank of ``ranks``
    (all ranks by default) sits at ``k = n // q²``, ``i = (n % q²) // q``, ``j = n % q``.
    For q=2, depth=2 and ranks 0..7::

        k=0:   j=0  j=1        k=1:   j=0  j=1
         i=0    0    1          i=0    4    5
         i=1    2    3          i=1    6    7

    Groups, along which collectives run ("axis" names a group; "dim" names a tensor dimension):

    * ``"row"``:   ranks sharing (k, i), e.g. {0, 1}; this rank's index in it is j.
    * ``"col"``:   ranks sharing (k, j), e.g. {0, 2}; index i.
    * ``"depth"``: ranks sharing (i, j), e.g. {0, 4}; index k.
    * ``"mesh"``:  all ranks of the mesh; index n.

    An activation ``[b, ..., h]`` is held as block ``[b/(depth·q), ..., h/q]``: batch block
    ``k·q + i`` and hidden block ``j`` (see ``optimus2d.scatter``).

    Building a mesh is collective: every rank of the default process group must construct it, with
    the same arguments, in the same order as its other meshes. A ``q=1, depth=1`` mesh needs no
    process group at all and runs as plain torch. Groups of one rank are never created and
    communication over them is skipped.

    Replicas (data parallelism): the ranks may instead each build the mesh of their own replica,
    ``ranks`` then differing between replicas: on 8 ranks, ``Mesh(2, ranks=range(4))`` on ranks
    0..3 and ``Mesh(2, ranks=range(4, 8))`` on 4..7 (or ``Mesh.from_device_mesh`` of a DeviceMesh
    with a data-parallel dim). The meshes must have the same shape and split the world: every rank
    in the mesh it asks for, and all the ranks of a mesh asking for it with the same ranks in the
    same order (else every rank raises ``ValueError``). ``replicas``: every replica's ranks, ordered
    by their smallest rank (one tuple for a single mesh); ``replica``: the index of this rank's.

    ``transport``: what carries the mesh's collectives. "torch": torch.distributed (gloo, NCCL);
    "mpi": MPI communicators through mpi4py (``comm/mpi.py``; CPU under gloo, launched by
    ``mpiexec``), whose sync points cost 1.6–14× less than gloo's; "auto" (default, or
    ``$OPTIMUS2D_TRANSPORT``): "mpi" where it can run, else "torch".

    ``check``: how much the ranks verify that they agree before exchanging blocks
    (``comm/agreement.py``): "off", "entry" (default, or ``$OPTIMUS2D_CHECK``) or "every".
    Building the mesh always checks, over the default group and within the collective timeout,
    that every rank asked for the same mesh (or its replica of the same shape) as its n-th;
    otherwise every rank raises ``ValueError``. ``uid`` is that n, the same on every rank.

    ``device_mesh``: the mesh as a torch ``DeviceMesh`` with dims ("depth", "row", "col").
    """

    def __init__(
        self,
        q: int,
        depth: int = 1,
        ranks: Sequence[int] | None = None,
        *,
        transport: str | None = None,
        check: str | None = None,
    ) -> None:
        self._build(q, depth, ranks, transport, check)

    @classmethod
    def from_device_mesh(
        cls, device_mesh: DeviceMesh, *, transport: str | None = None, check: str | None = None
    ) -> Mesh:
        """The mesh of a torch ``DeviceMesh`` with dims named "depth", "row" and "col"; any others
        are data-parallel replicas, each rank getting the mesh of its own replica.

        ``device_mesh.mesh[..., k, i, j]`` (dims "depth", "row", "col") is the rank at coordinates
        (k, i, j): ``Mesh.from_device_mesh(init_device_mesh("cpu", (d, q, q), mesh_dim_names=("depth",
        "row", "col")))`` is ``Mesh(q, d)``. A dim names a coordinate, so the DeviceMesh's group along
        "row" holds a column of the mesh: ``mesh.group("col")``, and its "col" a row. On 8 ranks::

            dm = init_device_mesh("cpu", (2, 1, 2, 2), mesh_dim_names=("dp", "depth", "row", "col"))
            mesh = Mesh.from_device_mesh(dm["depth", "row", "col"])  # 2×2 over 0..3, or over 4..7
            model = DistributedDataParallel(parallelize(model, mesh), process_group=dm.get_group("dp"))

        Collective over the world, like ``Mesh``: every rank calls it, at the same point. Uses the
        DeviceMesh's process groups of its three dims (where each holds the mesh's group in its
        order, on every rank) and builds the others; ``mesh.device_mesh`` is the DeviceMesh sliced to
        ("depth", "row", "col"). ``transport`` and ``check``: as for ``Mesh``.
        """
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized:
            raise RuntimeError("Mesh.from_device_mesh needs torch.distributed: call optimus2d.init() first")
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        q, depth, ranks, sub, error = replicas.read_device_mesh(device_mesh, device)
        mesh = cls.__new__(cls)
        mesh._build(q, depth, ranks, transport, check, sub, error)
        return mesh

    def _build(self, q, depth, ranks, transport, check, device_mesh=None, refused=None) -> None:
        global _built
        if ranks is not None and not isinstance(ranks, Sequence):  # a generator: read once, here
            ranks = list(ranks) if isinstance(ranks, Iterable) else ranks
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        transport = transport or os.environ.get("OPTIMUS2D_TRANSPORT") or "auto"
        check = check or os.environ.get("OPTIMUS2D_CHECK") or "entry"
        how = "Mesh.from_device_mesh" if device_mesh is not None or refused is not None else "Mesh"
        options = f"transport={transport!r}, check={check!r}"
        asked = f"{how}(q={q!r}, depth={depth!r}, ranks={_short(ranks)}, {options}) #{_built}"
        error, members = refused, None
        try:
            members = _validate(q, depth, ranks, transport, check, world, initialized) if error is None else None
        except (ValueError, TypeError) as err:
            error = err
        self.timeout = watch.collective_timeout()
        if world > 1:  # the same mesh shape everywhere, as the n-th mesh; one mesh or replicas: else all refuse
            shape = f"{how}(q={q!r}, depth={depth!r}, {options}) #{_built}"
            self.replicas = replicas.agree("Mesh", shape, asked, members, error, self.timeout)
        elif error is not None:
            raise error
        else:
            self.replicas = (members,)
        self.uid, _built = _built, _built + 1
        self.q, self.depth, self.size, self.ranks = q, depth, depth * q * q, members
        self.rank, self.check = rank, check
        self.replica = next((n for n, r in enumerate(self.replicas) if rank in r), None)
        self.backend = dist.get_backend() if initialized else "gloo"
        self._device_mesh = device_mesh
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._members: dict[str, tuple[int, ...]] = {}
        self._order: dict[str, tuple[int, ...]] = {}  # see group_order
        self.coord: tuple[int, int, int] | None = None
        if rank in self.ranks:
            n = self.ranks.index(rank)
            self.coord = (n // (q * q), (n % (q * q)) // q, n % q)
        self.mpi = None  # an MpiTransport when MPI carries the collectives
        self.pending = None  # the agreement of the module call under way (comm/calls.py)
        self.calls = 0  # outermost module calls so far: the agreement point of tagged blocks (comm/calls.py)
        # (label, weakref to its module, name) of each parameter whole on every rank whose gradient a hook
        # sums over this mesh (convert/blockwise.py): each module call agrees which are frozen (comm/calls.py)
        self.summed: list = []
        self._build_groups(transport, world)
        watch.register(self)

    @property
    def transport(self) -> str:
        """ "mpi" or "torch": what carries this mesh's collectives."""
        return "mpi" if self.mpi is not None else "torch"

    # ---- coordinates --------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return self._coord()[0]

    @property
    def i(self) -> int:
        return self._coord()[1]

    @property
    def j(self) -> int:
        return self._coord()[2]

    def _coord(self) -> tuple[int, int, int]:
        if self.coord is None:
            raise ValueError(f"rank {self.rank} is not in {self}")
        return self.coord

    def rank_at(self, k: int, i: int, j: int) -> int:
        """The global rank at coordinates (k, i, j)."""
        return self.ranks[k * self.q * self.q + i * self.q + j]

    # ---- groups -------------------------------------------------------------------------------
    def axis_size(self, axis: str) -> int:
        return {"row": self.q, "col": self.q, "depth": self.depth, "mesh": self.size}[_axis(axis)]

    def index(self, axis: str) -> int:
        """This rank's index in the group ``axis``: j for "row", i for "col", k for "depth"."""
        k, i, j = self._coord()
        return {"row": j, "col": i, "depth": k, "mesh": (k * self.q + i) * self.q + j}[_axis(axis)]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """This rank's process group along ``axis``; None when that group has one rank."""
        self._coord()
        return self._groups[_axis(axis)]

    def global_rank(self, axis: str, index: int) -> int:
        """Global rank of member ``index`` of this rank's ``axis`` group (a broadcast root)."""
        if self.group(axis) is None:
            return self.rank
        return self._members[_axis(axis)][index]

    def group_order(self, axis: str) -> tuple[int, ...] | None:
        """The member index of each group rank of this rank's ``axis`` group (the order in which
        torch's all-gathers deliver and reduce-scatters split), or None where it is the mesh order:
        always on torch >= 2.13, whose groups keep the mesh's order; on torch 2.11, which sorts a
        group's ranks, wherever the mesh's ranks ascend along ``axis`` (``Mesh(q, d)``)."""
        self._coord()
        return self._order.get(_axis(axis))

    def _build_groups(self, transport: str, world: int) -> None:
        q, d = self.q, self.depth
        layouts: dict[str, list[list[int]]] = {"row": [], "col": [], "depth": [], "mesh": []}
        for ranks in self.replicas:  # every replica's groups, on every rank: creating one is collective
            at = lambda k, i, j, ranks=ranks: ranks[(k * q + i) * q + j]  # noqa: E731
            layouts["row"] += [[at(k, i, j) for j in range(q)] for k in range(d) for i in range(q)]
            layouts["col"] += [[at(k, i, j) for i in range(q)] for k in range(d) for j in range(q)]
            layouts["depth"] += [[at(k, i, j) for k in range(d)] for i in range(q) for j in range(q)]
            layouts["mesh"].append(list(ranks))
        for axis, members_list in layouts.items():
            for members in members_list:
                if self.rank in members:
                    self._members[axis] = tuple(members)
        usable = False  # whether MPI can carry this mesh: every rank, or none, splits COMM_WORLD
        if transport != "torch" and self.size > 1:
            from optimus2d.comm import mpi  # not a cycle (mpi imports watch): importing it loads torch._dynamo

            usable = self.backend == "gloo" and mpi.available(world, self.rank)
        # one all-reduce over the world: MPI usable everywhere? which groups of meshes that are gone
        # are free everywhere, to be taken instead of created (shared_groups)
        taking = shared_groups.Taking(self, [int(usable)], self.device)
        usable = bool(taking.also[0])
        given = {}  # the DeviceMesh's groups, where they are the mesh's (the same verdict on every rank)
        if self._device_mesh is not None and world > 1:
            given = replicas.reusable_groups(self, self._device_mesh, self._members)
        for axis, members_list in layouts.items():
            self._groups[axis] = given.get(axis)
            for members in members_list:
                if len(members) == 1 or axis in given:
                    continue
                # collective where it is created: every rank asks for every group, in the same
                # order; group ranks follow mesh order where torch can (compat.new_group), and
                # roots, gathers and scatters follow the mesh regardless (global_rank, group_order).
                # A group of a mesh that is gone, where free on every rank (shared_groups). Never
                # the default group: an operation abandoned on a failed mesh must not poison the world's.
                group = taking.group(members)
                if self.rank in members:
                    self._groups[axis] = group
        for axis, group in self._groups.items():
            if group is not None and compat.group_ranks(group) != self._members[axis]:
                self._order[axis] = tuple(self._members[axis].index(r) for r in compat.group_ranks(group))
        self.check_group = None  # NCCL meshes: a gloo group of the mesh for agreement's host words
        if self.backend == "nccl" and self.size > 1:  # (comm/agreement.py: no device sync to check shapes)
            for members in layouts["mesh"]:
                group = taking.group(members, backend="gloo")
                self.check_group = group if self.rank in members else self.check_group
        if transport != "torch" and self.size > 1:
            if transport == "mpi" and not usable:
                raise ValueError(
                    f"Mesh(transport='mpi') needs the gloo backend under mpiexec (MPI's COMM_WORLD = the "
                    f"torch world); backend here is {self.backend!r}"
                )
            if usable:
                self.mpi = mpi.MpiTransport(layouts, self, self.timeout, taking)

    def members(self, axis: str) -> tuple[int, ...]:
        """Global ranks of this rank's ``axis`` group, in mesh order (member m has index m; on torch 2.11
        its process group may order them otherwise, ``group_order``)."""
        self._coord()
        return self._members[_axis(axis)]

    @property
    def device(self) -> torch.device:
        """The device this mesh's tensors live on: the current CUDA device under NCCL, else CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def device_mesh(self) -> DeviceMesh:
        """This mesh as a torch ``DeviceMesh`` with dims ("depth", "row", "col"): ``.mesh[k, i, j]`` is
        the rank at (k, i, j) of this rank's replica (``Mesh.from_device_mesh`` reads the same way).

        For a mesh built by ``Mesh.from_device_mesh``: that DeviceMesh, sliced to these dims. Else
        built on first use, with process groups of its own (of every replica, under a root DeviceMesh
        with a leading "replica" dim when there are several): that is collective over the world, so
        every rank must ask for it at the same point of the program (checked first, as ``Mesh`` is).
        """
        if self._device_mesh is None:
            self._device_mesh = replicas.build_device_mesh(self)
        return self._device_mesh

    # ---- copies -------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> Mesh:
        """The mesh itself: a handle on process groups and communicators, like a ProcessGroup, so a
        deep copy of a model (an EMA twin) runs on the same mesh as the original."""
        return self

    def __copy__(self) -> Mesh:
        return self

    def __reduce__(self):
        raise TypeError(
            f"{self} cannot be pickled: it is a handle on this process's communicators. Save the model's "
            f"weights instead (optimus2d.serial_state_dict, optimus2d.checkpoint)"
        )

    def __repr__(self) -> str:
        where = f", coord(k,i,j)={self.coord}" if self.coord is not None else ""
        r = self.ranks
        ranks = f"{r[0]}..{r[-1]}" if r == tuple(range(r[0], r[-1] + 1)) else list(r)
        via = ", transport=mpi" if self.mpi is not None else ""
        many = f", replica {self.replica} of {len(self.replicas)}" if len(self.replicas) > 1 else ""
        return f"Mesh(q={self.q}, depth={self.depth}, ranks={ranks}{where}{many}{via})"


def _validate(q, depth, ranks, transport: str, check: str, world: int, initialized: bool) -> tuple[int, ...]:
    """The mesh's ranks, or a ValueError saying what does not fit (before any collective)."""
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in (q, depth)):
        raise ValueError(f"Mesh needs positive integers q and depth, got q={q!r}, depth={depth!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"Mesh: transport {transport!r} is not one of {TRANSPORTS}")
    if check not in agreement.LEVELS:
        raise ValueError(f"Mesh: check {check!r} is not one of {agreement.LEVELS}")
    size = depth * q * q
    if size > 1 and not initialized:
        raise RuntimeError(f"Mesh(q={q}, depth={depth}) needs torch.distributed: call optimus2d.init() first")
    if ranks is None:
        if world != size:
            raise ValueError(
                f"Mesh(q={q}, depth={depth}) needs depth·q² = {size} ranks but the world has "
                f"{world}; {_fitting_shapes(world)}"
            )
        ranks = range(world)
    try:  # integers of any kind (numpy's, a tensor's); a float 1.7 was taken as rank 1
        ranks = [operator.index(r) for r in ranks]
    except TypeError:
        raise ValueError(f"Mesh ranks must be integers, got {ranks!r}") from None
    if len(ranks) != size:
        raise ValueError(
            f"Mesh(q={q}, depth={depth}) needs depth·q² = {size} ranks but was given "
            f"{len(ranks)}: {ranks}; {_fitting_shapes(len(ranks))}"
        )
    if len(set(ranks)) != size or min(ranks) < 0 or max(ranks) >= world:
        raise ValueError(f"Mesh ranks {ranks} must be {size} distinct ranks in [0, {world})")
    return tuple(ranks)


def _short(ranks) -> str:
    if ranks is None:
        return "all"
    try:
        return str([int(r) for r in ranks])
    except (TypeError, ValueError):
        return repr(ranks)


def _axis(axis: str) -> str:
    if axis not in ("row", "col", "depth", "mesh"):
        raise ValueError(f"unknown mesh axis {axis!r}; expected 'row', 'col', 'depth' or 'mesh'")
    return axis


def _fitting_shapes(p: int) -> str:
    shapes = [f"Mesh(q={q}, depth={p // (q * q)})" for q in range(1, math.isqrt(p) + 1) if p % (q * q) == 0]
    return f"{p} ranks fit " + ", ".join(shapes)


_OF_DEVICE_MESH: dict = {}  # DeviceMesh → its Mesh: equal DeviceMeshes (a slice taken twice) share one


def as_mesh(mesh: Mesh | DeviceMesh, what: str = "mesh") -> Mesh:
    """``mesh`` itself, or the ``Mesh`` of a torch ``DeviceMesh`` with dims "depth", "row" and "col"
    (any others data-parallel replicas: ``Mesh.from_device_mesh``), built the first time it is
    given and the same object after (collective then, as ``Mesh`` is: every rank passes it at the
    same point). ``TypeError`` naming ``what`` for anything else."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, DeviceMesh):
        if mesh not in _OF_DEVICE_MESH:
            _OF_DEVICE_MESH[mesh] = Mesh.from_device_mesh(mesh)
        return _OF_DEVICE_MESH[mesh]
    raise TypeError(
        f"{what} must be an optimus2d.Mesh or a torch DeviceMesh with dims named ('depth', 'row', 'col') "
        f"(init_device_mesh(device, (d, q, q), mesh_dim_names=('depth', 'row', 'col'))), got {type(mesh).__name__}"
    )
