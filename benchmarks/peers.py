"""The peers a benchmark compares: optimus2d, DTensor 1D (with and without sequence parallelism),
and plain torch on one rank. Each takes the same serial module (copied) and the same full input."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import optimus2d
from benchmarks.compare import Peer


def optimus(name: str, model: nn.Module, mesh: optimus2d.Mesh, x: torch.Tensor, grad: torch.Tensor) -> Peer:
    """``model`` (already on the mesh) on this rank's block of x; backward from its block of grad."""
    x_local, grad_local = optimus2d.scatter(x, mesh).detach(), optimus2d.scatter(grad, mesh)
    return Peer(
        name,
        model,
        lambda: model(x_local),
        lambda out: out.backward(grad_local),
        lambda out: optimus2d.gather(out, mesh),
    )


class _Holder(nn.Module):
    """A model whose one module runs in 1D under ``plan=`` (the boundary is the holder's call)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def optimus_1d(serial: nn.Module, mesh: optimus2d.Mesh, x: torch.Tensor, grad: torch.Tensor) -> Peer:
    """``serial`` in Megatron's 1D layout under ``plan=`` (``optimus2d.megatron.Megatron``): the
    input a block of ``mesh``, all-gathered at the boundary; the output split back to ``mesh``."""
    model = optimus2d.parallelize(
        _Holder(copy.deepcopy(serial)), mesh, plan={"inner": optimus2d.megatron.Megatron(mesh)}
    )
    x_local, grad_local = optimus2d.scatter(x, mesh), optimus2d.scatter(grad, mesh)
    return Peer(
        "optimus2d 1D (plan)",
        model,
        lambda: model(x_local),
        lambda out: out.backward(grad_local),
        lambda out: optimus2d.gather(out, mesh),
    )


def optimus_auto(
    serial: nn.Module,
    mesh: optimus2d.Mesh,
    x: torch.Tensor,
    grad: torch.Tensor,
    cap_mib: float,
    measured: bool = False,
    io: str = "blocks",
) -> Peer:
    """``serial`` under ``parallelize(plan=Auto(...), io=io)``: the layout of least predicted time on
    this machine for this many tokens, within ``cap_mib`` a rank (held as ``_Holder``'s one module,
    so that 1D is a choice); ``measured``: ``Auto(measure=step)``, the 4 best predicted timed on
    copies (this peer's forward and backward) and the fastest measured taken. ``io="whole"``: the
    input and the output's gradient whole on every rank, as DTensor 1D's peer takes them."""
    tokens = x.numel() // x.shape[-1]
    if io == "whole":
        x_local, grad_local = x, grad
    else:
        x_local, grad_local = optimus2d.scatter(x, mesh), optimus2d.scatter(grad, mesh)  # tagged: a boundary reads it
    auto = optimus2d.Auto(tokens=tokens, seq=x.shape[-2] if x.dim() > 2 else 1, memory=cap_mib * 2**20)
    if measured:
        auto = dataclasses.replace(auto, measure=lambda model: model(x_local).backward(grad_local), top=4)
    holder = _Holder(copy.deepcopy(serial))
    choice, plan = optimus2d.convert.choose_plan(holder, mesh, auto, io=io)  # what plan=auto applies, its pick
    model = optimus2d.parallelize(holder, mesh, plan=plan, io=io)
    return Peer(
        "optimus2d auto" + (", whole io" if io == "whole" else "") + (", measured" if measured else ""),
        model,
        lambda: model(x_local),
        lambda out: out.backward(grad_local),
        (lambda out: out) if io == "whole" else (lambda out: optimus2d.gather(out, mesh)),
        extra={"layouts": choice.layouts},
    )


def optimus_twins(
    serial: nn.Module, mesh: optimus2d.Mesh, x: torch.Tensor, grad: torch.Tensor, build=optimus2d.parallelize
) -> list[Peer]:
    """optimus2d as it chooses ("auto"), with SUMMA only, and over the other transport where MPI
    launched the ranks (what the choice of algorithm and of transport gain).

    ``build(serial, mesh)`` makes the 2D module (``parallelize``, or a layer's ``from_serial``)."""
    name = f"optimus2d {'2D' if mesh.depth == 1 else '2.5D'}"
    peers = [optimus(name, build(copy.deepcopy(serial), mesh), mesh, x, grad)]
    if mesh.q > 1:
        summa = build(copy.deepcopy(serial), mesh)
        for layer in summa.modules():
            if isinstance(layer, optimus2d.layers.Linear2D):
                layer.algorithm = "summa"
        peers.append(optimus(f"{name} SUMMA", summa, mesh, x, grad))
    other = other_transport(mesh)
    if other is not None:  # the same over the other transport: what the choice of transport gains
        twin = optimus2d.Mesh(mesh.q, mesh.depth, transport=other)
        label = "over gloo" if other == "torch" else "over MPI"
        peers.append(optimus(f"{name} {label}", build(copy.deepcopy(serial), twin), twin, x, grad))
    return peers


def other_transport(mesh: optimus2d.Mesh) -> str | None:
    """The transport this mesh did not take, where both can run (MPI launched the CPU ranks)."""
    from optimus2d.comm import mpi

    if mesh.size == 1 or mesh.backend != "gloo" or not mpi.available(dist.get_world_size(), dist.get_rank()):
        return None
    return "torch" if mesh.transport == "mpi" else "mpi"


def dtensor_1d(
    serial: nn.Module, plan, x: torch.Tensor, grad: torch.Tensor, *, sequence_parallel: bool, out_dim: int | None
) -> Peer:
    """``parallelize_module(serial copy, plan)`` on a 1D mesh of every rank.

    ``sequence_parallel``: the input arrives split over the sequence (dim 1), the modern Megatron
    layout; ``out_dim``: the dimension the plan leaves the output split on (None: whole).
    """
    from torch.distributed.device_mesh import init_device_mesh

    p, rank = dist.get_world_size(), dist.get_rank()
    model = parallelize_module(copy.deepcopy(serial), init_device_mesh(x.device.type, (p,)), plan)
    x_local = x.chunk(p, 1)[rank].contiguous() if sequence_parallel else x
    grad_local = grad.chunk(p, out_dim)[rank].contiguous() if out_dim is not None else grad

    def full(out: torch.Tensor) -> torch.Tensor:
        if isinstance(out, DTensor):
            return out.full_tensor()
        if out_dim is None:
            return out
        parts = [torch.empty_like(out) for _ in range(p)]
        dist.all_gather(parts, out.contiguous())
        return torch.cat(parts, out_dim)

    name = "DTensor 1D + SP" if sequence_parallel else "DTensor 1D"
    return Peer(name, model, lambda: waited(model(x_local)), lambda out: out.backward(grad_local), full)


def waited(out: torch.Tensor) -> torch.Tensor:
    """``out`` with its collective finished. DTensor returns its last collective's output un-waited
    (an ``AsyncCollectiveTensor``, waited when an op first reads it); a step's loss would read it
    before backward, so the timed step waits for it too (one elementwise op: the wait, kept in
    autograd). Without this the output's all-reduce runs unmeasured beside the backward."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return out * 1 if isinstance(out, AsyncCollectiveTensor) else out


def mlp_plans(sequence_parallel: bool) -> dict:
    """Megatron's MLP plan for ``nn.Sequential(Linear, act, Linear)``: column- then row-parallel."""
    if sequence_parallel:
        return {"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def linear_plan(sequence_parallel: bool) -> ColwiseParallel:
    """One column-parallel Linear (its input gathered over the sequence first, with SP)."""
    return ColwiseParallel(input_layouts=Shard(1)) if sequence_parallel else ColwiseParallel()


def plain_torch(serial: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Peer:
    """The serial module on rank 0 alone (the others wait): the speed-up baseline."""
    model = copy.deepcopy(serial)
    return Peer("torch, 1 rank", model, lambda: model(x), lambda out: out.backward(grad), lambda out: out, True)
