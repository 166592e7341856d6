"""``torch.amp.GradScaler`` on a converted model: an inf in one rank's block of one gradient is
found by every rank, which all skip the step and lower the scale alike (``comm/grad_scaler.py``).
Torch's DTensor handler reduced ``found_inf`` over the dims where the first gradient is sharded:
with a LayerNorm first (whole over the rows and columns), ranks 0-1 skipped, 2-3 stepped."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.distributed.tensor import DTensor

import optimus2d

pytestmark = pytest.mark.mpi
E = 12  # divides q = 2 and 3


def test_an_inf_in_one_ranks_block_makes_every_rank_skip(mesh):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.LayerNorm(E), nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = optimus2d.scatter(torch.randn(2 * mesh.depth * mesh.q, 3, E), mesh)
    scaler.scale(model(x).square().mean()).backward()
    if MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1:  # one block of the last Linear's gradient overflows
        grad = model[3].weight.grad
        (grad.to_local() if isinstance(grad, DTensor) else grad)[0, 0] = float("inf")
    before = {k: v.clone() for k, v in optimus2d.serial_state_dict(model).items()}
    scaler.step(opt)
    found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
    scaler.update()
    assert MPI.COMM_WORLD.allgather((found, scaler.get_scale())) == [(1.0, 512.0)] * MPI.COMM_WORLD.size
    after = optimus2d.serial_state_dict(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # no rank stepped
