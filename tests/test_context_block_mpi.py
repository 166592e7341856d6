"""A pre-norm transformer block on the 2D mesh with context parallelism equals torch's serial block.

The serial block is torch.nn (``nn.LayerNorm``, ``nn.Linear``, ``F.scaled_dot_product_attention``);
the parallel one is the same module with each norm and linear layer replaced by its optimus2d
``from_serial`` twin and its attention by ``context.attention``, on the sequence layout (batch over
col, hidden over row, the sequence over depth: c = depth). Outputs, input gradients and every
parameter after one AdamW step equal serial in float64 (≤ 1e-6 relative, issue 27), for the causal,
image–text and packed-document masks. Meshes: 1×1×4 (c = 4, one rank each), 2×2×2 (c = 2 on a
2×2 mesh, 8 ranks), 1×1×9 (c = 9), and q×q×1 (c = 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, context_mask
from torch import nn

import optimus2d
from optimus2d import context
from optimus2d.layers import LayerNorm2D, Linear2D

pytestmark = pytest.mark.mpi


class Block(nn.Module):
    """x + o(attend(q, k, v)) then x + fc2(gelu(fc1(ln2(x)))); ``attend`` takes [b, heads, s, d_h]."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.d_h = hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        y = self.ln1(x)
        b, s, h = y.shape[0], y.shape[1], self.q(y).shape[-1]  # h: the heads this rank holds × d_h
        split = lambda t: t.view(b, s, h // self.d_h, self.d_h).transpose(1, 2)  # noqa: E731
        a = attend(split(self.q(y)), split(self.k(y)), split(self.v(y)))
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _on_mesh(block: Block, mesh) -> Block:
    twin = copy.deepcopy(block)
    for name, child in block.named_children():
        cls = LayerNorm2D if isinstance(child, nn.LayerNorm) else Linear2D
        setattr(twin, name, cls.from_serial(copy.deepcopy(child), mesh))
    return twin


@pytest.mark.parametrize("kind", ["causal", "image", "documents"])
def test_block_with_context_parallelism_equals_serial(mesh, kind):
    c, hidden, heads = mesh.depth, 8 * mesh.q, 2 * mesh.q
    b, s = 2 * mesh.q, 2 * c * 8
    mask = context_mask(kind, s)
    a = context.assign(mask, c, "makespan", block=4)
    torch.manual_seed(0)
    serial = Block(hidden, heads).double()
    parallel = _on_mesh(serial, mesh)
    x = torch.randn(b, s, hidden, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(b, s, hidden, dtype=torch.float64)

    want = serial(x, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    (want * weight).sum().backward()
    dx = x.grad.clone()
    x.grad = None
    got_block = parallel(context.scatter(x, mesh, a), lambda q, k, v: context.attention(q, k, v, mesh, a, mask))
    got = context.gather(got_block, mesh, a)
    (got * weight).sum().backward()
    assert_close(got, want, 1e-6, "output")
    assert_close(x.grad, dx, 1e-6, "input gradient")

    for model in (serial, parallel):
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    after = optimus2d.serial_state_dict(parallel)
    for key, value in serial.state_dict().items():
        assert_close(after[key], value, 1e-6, key)
