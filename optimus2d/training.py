"""Training utilities that need the whole mesh's view: the true global gradient norm.

One ``clip_grad_norm_`` for a model on one mesh, on the meshes found from its parameters, or cut
into pipeline stages (a ``pipeline.StageMesh``, read by its fields ``mesh`` and ``lane`` only:
``pipeline/`` sits above this module).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from optimus2d.comm import all_reduce
from optimus2d.comm import primitives as P
from optimus2d.comm.agreement import agree_group
from optimus2d.comm.calls import check_function_call
from optimus2d.comm.dtensor import DTensor, local
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import block_slices
from optimus2d.layers.base import param_sharding


class StageMesh(Protocol):
    """What clipping reads of ``optimus2d.pipeline.StageMesh``: the stage's mesh and the lane."""

    mesh: Mesh
    lane: dist.ProcessGroup | None


def _mesh_of(params: list[torch.Tensor]) -> Mesh | None:
    """The mesh to reduce over: the parameters' own, which may be several meshes over the same ranks
    (``parallelize(plan=)``: each parameter then counts its replicas on its own mesh)."""
    meshes = {id(m): m for p in params if (m := getattr(p, "_optimus2d_mesh", None)) is not None}
    if len({frozenset(m.ranks) for m in meshes.values()}) > 1:
        raise ValueError(
            f"clip_grad_norm_: the parameters live on {len(meshes)} meshes over different ranks "
            f"({', '.join(map(repr, meshes.values()))}); a pipeline's stages: pass pipe=, this rank's StageMesh"
        )
    return next(iter(meshes.values()), None)


def _own_mesh(param: torch.Tensor, mesh: Mesh) -> Mesh:
    """The mesh on which ``param``'s replicas are counted: its own, which must be over the ranks of
    ``mesh``; a DTensor over more ranks (FSDP's data-parallel dim too) is refused, as torch's own
    ``clip_grad_norm_`` reads its placements."""
    own = getattr(param, "_optimus2d_mesh", None)
    if own is not None and frozenset(own.ranks) != frozenset(mesh.ranks):
        raise ValueError(
            f"clip_grad_norm_: a parameter of shape {tuple(param.shape)} lives on {own}, not over the ranks "
            f"of mesh={mesh}: pass the parameters of one set of ranks (a pipeline's stages: pipe=)"
        )
    mesh = own if own is not None else mesh
    if isinstance(param, DTensor) and param.device_mesh.size() != mesh.size:
        raise ValueError(
            f"clip_grad_norm_: a parameter of shape {tuple(param.shape)} is a DTensor over "
            f"{param.device_mesh.size()} ranks, not the {mesh.size} of {mesh} (sharded by FSDP over data-parallel "
            f"replicas too): use torch.nn.utils.clip_grad_norm_, which reads its placements"
        )
    return mesh


def _replicas(param: torch.Tensor, mesh: Mesh) -> int:
    """How many ranks of ``mesh`` (``param``'s own, ``_own_mesh``) hold the same block of ``param``."""
    sharding = param_sharding(param)
    if sharding is None and isinstance(param, DTensor):
        # torch's own placements (a linear parallelize_module split in 1D): replicated where Replicate
        return math.prod(param.device_mesh.size(d) for d, p in enumerate(param.placements) if p.is_replicate())
    if sharding is None:  # a plain torch parameter, or one replicated: the same on every rank
        return mesh.size
    n = 1
    for axis in sharding.replicated_axes(mesh):
        n *= mesh.axis_size(axis)
    return n


def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    mesh: Mesh | StageMesh | None = None,
    norm_type: float = 2.0,
    *,
    pipe: StageMesh | None = None,
    copies: Mapping[torch.Tensor, int] | None = None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model on the mesh: the norm of the serial gradient.

    ``parameters``: a model (its parameters), or parameters, or one tensor. Each block of a sharded
    parameter counts once; a parameter replicated over some axes (a bias over col and depth, a
    plain torch parameter everywhere) counts once, not once per replica. One all-reduce over the
    mesh (a max for ``norm_type=inf``), after the ranks agree on ``max_norm``, ``norm_type`` and the
    number of parameters (or every rank raises). Returns the total norm, the same on every rank.

    ``mesh``: found from the parameters when not given (``parallelize`` and every layer mark
    theirs; the meshes of a ``plan=`` are over the same ranks, and each parameter's replicas are
    counted on its own); parameters of no mesh at all are clipped as torch does. A ``DeviceMesh``
    is read as ``Mesh.from_device_mesh``. A pipelined model: pass this
    rank's ``StageMesh`` (as ``mesh`` or ``pipe=``) and the parameters of all its chunks; the norm
    is then the whole serial model's, over every stage (one more all-reduce of one float, over the
    lane). ``copies``: parameters whose gradient other stages hold too, with how many copies the
    pipeline holds (GPT-2's tied table after ``sum_tied_grads``: ``shared_copies``), counted once.
    ``error_if_nonfinite``: as torch's, a ``RuntimeError`` on every rank (the norm is every rank's);
    ``foreach``: taken for torch's signature, unused. Note the order: ``mesh`` comes third, before
    ``norm_type`` (torch's third): ``clip_grad_norm_(params, 1.0, norm_type=1.0)``.
    """
    del foreach  # one fused sum per parameter already; torch's choice of kernels does not apply
    if mesh is not None and not isinstance(mesh, (Mesh, DeviceMesh)) and not hasattr(mesh, "mesh"):
        raise TypeError(
            f"clip_grad_norm_: mesh={mesh!r} is not a Mesh, DeviceMesh or StageMesh (optimus2d's third argument "
            f"is the mesh; torch's is norm_type: pass norm_type={mesh!r})"
        )
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if isinstance(mesh, DeviceMesh):
        mesh = Mesh.from_device_mesh(mesh)
    if pipe is None and mesh is not None and not isinstance(mesh, Mesh):
        pipe, mesh = mesh, None  # a StageMesh given where the mesh goes
    if pipe is not None:
        if mesh is not None and mesh is not pipe.mesh:
            raise ValueError(f"clip_grad_norm_: mesh={mesh} is not the stage's mesh {pipe.mesh}; give one of them")
        return clip_over(params, max_norm, pipe.mesh, norm_type, pipe.lane, copies, error_if_nonfinite, pipe.dp_group)
    if mesh is None:
        mesh = _mesh_of(params)
        if mesh is None and any(isinstance(p, DTensor) for p in params):
            raise ValueError(
                "clip_grad_norm_: these parameters are DTensors of no optimus2d mesh (a module in 1D, "
                "megatron.Megatron, split by torch): pass mesh=, the mesh the model was parallelized on; "
                "sharded by FSDP (fully_shard), use torch.nn.utils.clip_grad_norm_"
            )
        if mesh is None:  # plain torch parameters only: nothing is split
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    return clip_over(params, max_norm, mesh, norm_type, None, copies, error_if_nonfinite)


def _smallest(grad: torch.Tensor, param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The smallest |g| of ``grad``, this rank's block of ``param``'s gradient, over the entries of the
    serial tensor it holds (not the padding of a dim the mesh does not divide; inf if none)."""
    sharding = param_sharding(param)
    pieces = [grad] if sharding is None else [grad[dst] for _, dst in block_slices(sharding, mesh)]
    smallest = [piece.detach().abs().amin().double() for piece in pieces if piece.numel()]
    return min(smallest, default=torch.full((), math.inf, dtype=torch.float64, device=grad.device))


def clip_over(
    params: list[torch.Tensor],
    max_norm: float,
    mesh: Mesh,
    norm_type: float = 2.0,
    lane: dist.ProcessGroup | None = None,
    copies: Mapping[torch.Tensor, int] | None = None,
    error_if_nonfinite: bool = False,
    replicas: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``clip_grad_norm_`` over ``mesh`` and, given ``lane`` (a pipeline's: one rank of each stage
    mesh), over every stage: the mesh-wide sums (or max) then one all-reduce over the lane.
    ``replicas``: the pipeline's data-parallel group (``dp_group``), whose copies hold the same
    averaged gradients and agree on the settings too (one copy's other max_norm made the copies'
    weights part, no error).
    ``copies``: parameters whose gradient that many ranks of the lane hold alike (a tied table's
    copies on the first and last stages), each counted 1/copies times so the table counts once."""
    copies = {id(p): n for p, n in (copies or {}).items()}
    error, own = None, []
    try:
        own = [_own_mesh(p, mesh) for p in params]  # every parameter's checked, with a gradient or not
    except ValueError as err:
        error = err
    if not (norm_type > 0 or norm_type == float("-inf")):
        error = ValueError(f"clip_grad_norm_: norm_type={norm_type} is not taken (a p-norm with p > 0, inf or -inf)")
    # The ranks agree first: one rank's other norm_type sent a max where the others summed (over MPI
    # a norm that differs by rank, no error); its other max_norm clipped its blocks alone.
    agreed = f"max_norm={float(max_norm)!r}, norm_type={float(norm_type)!r}"
    agreed += ", error if non-finite" if error_if_nonfinite else ""
    try:
        check_function_call(mesh, "clip_grad_norm_", (), f"{agreed}, {len(params)} parameters", error)
        error = None
    except (ValueError, TypeError) as err:  # raised on every rank of this stage mesh: on every stage's too
        if lane is None:
            raise
        error = err
    # The stages agree too (one stage's other max_norm clipped its gradients alone; its other norm_type
    # sent a max over the lane where the others summed) and hear a refusal on one stage
    try:
        agree_group(mesh, lane, "clip_grad_norm_", agreed, error)
        error = None
    except (ValueError, TypeError) as err:  # raised on every stage of this copy: on every copy's too
        if replicas is None:
            raise
        error = err
    agree_group(mesh, replicas, "clip_grad_norm_ over the copies", agreed, error)
    grads = [
        (local(p.grad), _replicas(p, m) * copies.get(id(p), 1))
        for p, m in zip(params, own, strict=True)
        if p.grad is not None
    ]
    device = grads[0][0].device if grads else torch.device("cpu")
    if abs(norm_type) == float("inf"):  # the largest (or, -inf, the smallest) |g|: a max of -|g| for it
        sign = 1.0 if norm_type > 0 else -1.0
        if sign > 0:
            ends = [g.detach().abs().amax().double() for g, _ in grads]
        else:  # the smallest over the serial entries a block holds: its zero padding is none (0 for 4.9e-4)
            ends = [-_smallest(local(p.grad), p, m) for p, m in zip(params, own, strict=True) if p.grad is not None]
        none = torch.full((), 0.0 if sign > 0 else -math.inf, dtype=torch.float64, device=device)
        total = max(ends, default=none).reshape(1).clone()
        P.all_reduce_max(total, mesh, "mesh")
        P.all_reduce_group(total, mesh, lane, "lane", op=dist.ReduceOp.MAX)
        total = sign * total[0]
    else:
        mine = torch.zeros((), dtype=torch.float64, device=device)
        for g, replicas in grads:
            mine = mine + g.detach().double().abs().pow(norm_type).sum() / replicas
        total = all_reduce(mine.reshape(1), mesh, ("mesh",))
        P.all_reduce_group(total, mesh, lane, "lane")
        total = total[0] ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):  # the same total on every rank: all raise
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), "
            f"so it cannot be clipped (as torch.nn.utils.clip_grad_norm_ with error_if_nonfinite=True)"
        )
    clip = max_norm / (total + 1e-6)  # in float64, rounded once to each gradient's dtype
    if not clip >= 1:  # a NaN norm too: every gradient becomes NaN, as torch's clamp and multiply make it
        for g, _ in grads:
            g.detach().mul_(clip.to(g.dtype))
    return total.to(grads[0][0].dtype if grads else torch.float32)  # as torch: the gradients' dtype
