"""A block told to torch as what it is: a DTensor of the serial tensor on the mesh's ``DeviceMesh``.

A parameter's ``Sharding`` becomes placements on the DeviceMesh of dims ("depth", "row", "col"):
the axis "depth" varies dim 0, "col" (the ranks sharing a column, index i) dim 1 and "row" (index
j) dim 2, so a ``Linear2D`` weight ``[out, in]`` split as ``(("col",), ("row",))`` is
``(Replicate(), Shard(0), Shard(1))`` and its block ``[out/q, in/q]`` is the DTensor's local tensor.

The DTensor holds the block exactly as the layer stores it, so its global shape is the block's
shape times the splits ("stored" layout). Where that is the serial tensor laid out as DTensor
lays out a ``Shard`` (``canonical``), the DTensor *is* the serial tensor. Where it is not — a dim
that does not divide (padded at its end, where DTensor chunks unevenly), fused parts (q, k, v each
split on its own), two axes on one dim in another order than the DeviceMesh's — every reduction,
elementwise update and re-sharding over replicas (a norm, an optimizer step, an EMA, FSDP over
copies) is still exact, but indexes are not the serial ones: ``serial_dtensor`` gives the serial
tensor's DTensor for those (``convert/dtensor_params.py`` puts it in ``state_dict``).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, block_slices, unshard

MESH_DIMS = {"depth": 0, "col": 1, "row": 2}  # mesh axis → the DeviceMesh dim (k, i, j) it varies
DIM_NAMES = ("depth", "row", "col")  # the DeviceMesh's names of those dims (any others: data-parallel)
STORED: contextvars.ContextVar[bool] = contextvars.ContextVar("optimus2d_stored_state_dict", default=False)


IN_GRAPH: contextvars.ContextVar[bool] = contextvars.ContextVar("optimus2d_parameters_in_graph", default=False)


@contextlib.contextmanager
def parameters_in_graph():
    """Within it, a converted model's forward puts its DTensor parameters themselves in the autograd
    graph (``to_local()`` per use), as torch needs for ``torch.autograd.grad(loss, params)`` and
    ``loss.backward(inputs=params)``. Outside it, each parameter's local
    tensor is the leaf and its gradient is handed to ``p.grad`` (``convert/dtensor_params.py``):
    faster, but the parameter is not in the graph, and those calls see it unused."""
    token = IN_GRAPH.set(True)
    try:
        yield
    finally:
        IN_GRAPH.reset(token)


@contextlib.contextmanager
def stored_state_dict():
    """Within it, a converted model's ``state_dict()`` gives each tensor as stored (the DTensor
    parameter itself, nothing gathered): for the library's own readers that look blocks up by key."""
    token = STORED.set(True)
    try:
        yield
    finally:
        STORED.reset(token)


def placements(sharding: Sharding | None, names: tuple[str, ...] = DIM_NAMES) -> tuple:
    """The placements of a tensor laid out as ``sharding`` (None: replicated) on a DeviceMesh of
    dims ``names``: ``Shard`` on "depth", "row" or "col" where the sharding splits over that axis,
    ``Replicate`` on any other dim (a data-parallel dim: every replica holds the same block)."""
    out = [Replicate()] * len(names)
    for d, axes in enumerate(sharding.dims if sharding is not None else ()):
        for axis in axes:
            out[names.index(DIM_NAMES[MESH_DIMS[axis]])] = Shard(d)
    return tuple(out)


def is_canonical(sharding: Sharding | None, mesh: Mesh) -> bool:
    """Whether the stored blocks of ``sharding`` are the serial tensor's DTensor shards: no fused
    parts, every dim divides, and a dim split by two axes splits it in the DeviceMesh's order."""
    if sharding is None:
        return True
    if sharding.parts:
        return False
    for d, axes in enumerate(sharding.dims):
        if sharding.full_shape[d] % sharding.splits(mesh, d):
            return False
        order = [MESH_DIMS[a] for a in axes if mesh.axis_size(a) > 1]
        if order != sorted(order):
            return False
    return True


def as_dtensor(block: torch.Tensor, sharding: Sharding | None, mesh: Mesh, device_mesh=None) -> DTensor:
    """``block`` (this rank's, as stored) as a DTensor on ``device_mesh`` (``mesh.device_mesh``, or
    a DeviceMesh with data-parallel dims beside ``mesh``'s three: replicated over them); no
    communication."""
    device_mesh = device_mesh if device_mesh is not None else mesh.device_mesh
    splits = [sharding.splits(mesh, d) if sharding is not None else 1 for d in range(block.dim())]
    shape = torch.Size(n * s for n, s in zip(block.shape, splits, strict=True))
    stride = torch.empty(shape, device="meta").stride()
    where = placements(sharding, tuple(device_mesh.mesh_dim_names))
    return DTensor.from_local(block, device_mesh, where, run_check=False, shape=shape, stride=stride)


def like(t: DTensor, block: torch.Tensor) -> DTensor:
    """``block`` as a DTensor of ``t``'s mesh, placements and global shape (no communication)."""
    return DTensor.from_local(block, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``t`` as stored (the tensor itself when it is not a DTensor), sharing
    its storage; outside autograd (to write into, or read)."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor that torch itself split (``parallelize_module``'s ``Shard``) as the serial tensor on
    every rank (gathered over its DeviceMesh); a replicated one, or a plain tensor: its local tensor."""
    if isinstance(t, DTensor) and not all(isinstance(p, Replicate) for p in t.placements):
        with torch.no_grad():
            return t.full_tensor()
    return local(t)


def own_part(t: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``full`` laid out as the DTensor ``t`` (nothing sent)."""
    return DTensor.to_local(_distribute(full, t))


def _distribute(full: torch.Tensor, t: DTensor) -> DTensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach().to(t.device), t.device_mesh, t.placements, src_data_rank=None)


def serial_dtensor(t: torch.Tensor, sharding: Sharding, mesh: Mesh, device_mesh=None) -> DTensor:
    """The serial tensor of the stored block ``t`` as a DTensor laid out as DTensor lays out its
    placements (``torch.chunk`` per DeviceMesh dim, in order). A block padded at the end of a dim
    split by one axis is already that chunk, padding aside: a view of it, nothing sent. Else (fused
    parts, two axes on a dim) the blocks are all-gathered over ``mesh``: collective. On ``t``'s
    DeviceMesh, or ``device_mesh`` (default ``mesh.device_mesh``) for a plain block."""
    if device_mesh is None:
        device_mesh = t.device_mesh if isinstance(t, DTensor) else mesh.device_mesh
    where = placements(sharding, tuple(device_mesh.mesh_dim_names))
    stride = torch.empty(sharding.full_shape, device="meta").stride()
    if not sharding.parts and all(sum(mesh.axis_size(a) > 1 for a in axes) <= 1 for axes in sharding.dims):
        ((_, valid),) = block_slices(sharding, mesh)
        chunk = local(t).detach()[valid]
        return DTensor.from_local(
            chunk, device_mesh, where, run_check=False, shape=torch.Size(sharding.full_shape), stride=stride
        )
    full = unshard(local(t).detach().contiguous(), mesh, sharding)
    chunk = full
    coordinate = device_mesh.get_coordinate()  # no process groups needed (a DeviceMesh built without them)
    for dim, placement in enumerate(where):
        if isinstance(placement, Shard):
            n, index = device_mesh.size(dim), coordinate[dim]
            pieces = torch.chunk(chunk, n, placement.dim)
            chunk = pieces[index] if index < len(pieces) else chunk.narrow(placement.dim, 0, 0)
    stride = torch.empty(full.shape, device="meta").stride()
    return DTensor.from_local(chunk.clone(), device_mesh, where, run_check=False, shape=full.shape, stride=stride)


def on_local_grad(hook):
    """A gradient hook on a block (summing it over replicas, say) made a hook on its DTensor: it
    runs on the gradient's local tensor and gives back a DTensor of the same placements."""

    def run(grad: torch.Tensor):
        if not isinstance(grad, DTensor):
            return hook(grad)
        out = hook(grad.to_local())
        if out is None:
            return None
        return DTensor.from_local(
            out, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )

    run._optimus2d_local_hook = hook
    return run
