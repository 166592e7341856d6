"""Double backward (``create_graph=True``) through a converted model: refused on every rank before
anything is sent, the mesh usable after; exact on a mesh of one rank.

A gradient penalty, ``grad(loss, x, create_graph=True)`` then ``(loss + g²).backward()``, ran with no
error on 2×2 and gave second-order gradients 362 off (497 in scale): the backwards communicate, and a
graph of them held each rank's local arithmetic only (``comm/first_order.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_grads_like_serial, check_against_serial, raises_fast
from torch import nn

import optimus2d

pytestmark = pytest.mark.mpi
W = 12  # divides by q = 1, 2, 3; 6 heads too

MODELS = {
    "linear": lambda: nn.Linear(W, W),
    "mlp with a norm": lambda: nn.Sequential(nn.Linear(W, 2 * W), nn.GELU(), nn.LayerNorm(2 * W), nn.Linear(2 * W, W)),
    "encoder layer": lambda: nn.TransformerEncoderLayer(W, 6, 2 * W, dropout=0.0, batch_first=True),
}


def _penalized(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The loss plus the squared norm of its gradient with respect to ``x`` (a WGAN-GP penalty)."""
    loss = model(x).pow(2).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss + g.square().sum()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_gradient_penalty_is_exact_or_refused_on_every_rank(mesh, name):
    """Refused where a backward that communicates is reached (q > 1 always), before it sends: the mesh
    goes on. Exact otherwise (q = 1: the weights whole, their gradients summed over depth by hooks
    once complete). The attention on q = 1 is refused too, by optimus2d (its SUMMA over depth) or on
    one rank by torch (its SDPA kernel has no second derivative)."""
    torch.manual_seed(0)
    serial = MODELS[name]().double()
    parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    torch.manual_seed(1)
    x = torch.randn(2 * mesh.depth * mesh.q, 3, W, dtype=torch.float64)
    block = optimus2d.scatter(x, mesh).detach().requires_grad_()
    refused = mesh.q > 1
    if refused or name == "encoder layer":
        match = "double backward" if refused else r"double backward|derivative for .* is not implemented"
        raises_fast(RuntimeError, match, lambda: _penalized(parallel, block).backward())
        check_against_serial(serial, parallel, x, mesh, tol=1e-9)  # nothing was sent: the mesh goes on
        return
    _penalized(parallel, block).backward()
    _penalized(serial, x.clone().requires_grad_()).backward()
    assert_grads_like_serial(serial, parallel, mesh, tol=1e-9)
