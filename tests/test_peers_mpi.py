"""The benchmarks' 1D peer: timed fairly (its step waits for the collective DTensor leaves in
flight), and sending what ``optimus2d.cost``'s 1D formula counts."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor.debug import CommDebugMode

from benchmarks import peers
from optimus2d.cost import mlp_1d_elements

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


@pytest.mark.parametrize("input_grad", [False, True], ids=["x-no-grad", "x-grad"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["1d", "1d-sp"])
def test_dtensor_1d_sends_what_the_1d_formula_counts(world, sequence_parallel, input_grad):
    p = dist.get_world_size()
    if p == 1:
        pytest.skip("one rank sends nothing")
    torch.manual_seed(0)
    rows, h = 2 * 2 * p, 8
    serial = nn.Sequential(nn.Linear(h, 4 * p), nn.GELU(), nn.Linear(4 * p, h))
    x = torch.randn(2, 2 * p, h, requires_grad=input_grad)
    grad = torch.randn(2, 2 * p, h)
    out_dim = 1 if sequence_parallel else None
    peer = peers.dtensor_1d(
        serial, peers.mlp_plans(sequence_parallel), x, grad, sequence_parallel=sequence_parallel, out_dim=out_dim
    )
    counter = CommDebugMode()
    with counter, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its module hooks warn when no input needs a gradient
        peer.backward(peer.forward())
    counts = {str(op).split(".")[-1]: n for op, n in counter.get_comm_counts().items()}
    # every one of these collectives carries the whole rows·h (gathered output, scattered input)
    assert sum(counts.values()) * rows * h == mlp_1d_elements(
        rows, h, p, sequence_parallel=sequence_parallel, input_grad=input_grad
    )
    assert set(counts) == ({"all_gather_into_tensor", "reduce_scatter_tensor"} if sequence_parallel else {"all_reduce"})
