"""The benchmarks' 1D peer is timed fairly: its step waits for the collective DTensor leaves in flight."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from benchmarks import peers

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["1d", "1d-sp"])
def test_dtensor_1d_forward_returns_a_finished_output_that_backpropagates(world, sequence_parallel):
    p = dist.get_world_size()
    if p == 1:
        pytest.skip("DTensor's row-parallel output needs a collective only with more than one rank")
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(8, 4 * p), nn.GELU(), nn.Linear(4 * p, 8))
    x = torch.randn(2, 2 * p, 8)
    grad = torch.randn(2, 2 * p, 8)
    plan = peers.mlp_plans(sequence_parallel)
    out_dim = 1 if sequence_parallel else None
    peer = peers.dtensor_1d(serial, plan, x, grad, sequence_parallel=sequence_parallel, out_dim=out_dim)
    raw = peer.model(x.chunk(p, 1)[dist.get_rank()].contiguous() if sequence_parallel else x)
    assert isinstance(raw, AsyncCollectiveTensor)  # what DTensor hands back: the collective still in flight
    raw.trigger_wait()
    out = peer.forward()
    assert type(out) is torch.Tensor and out.grad_fn is not None  # waited, and still in the graph
    assert_close(peer.full_output(out), serial(x))
    peer.backward(out)
    serial(x).backward(grad)
    fc1 = peer.model[0].weight.grad
    rows = fc1.full_tensor() if hasattr(fc1, "full_tensor") else fc1
    assert_close(rows, serial[0].weight.grad)
