"""Ring attention: K/V blocks passed round the depth ring instead of gathered (``attention(..., method="ring")``).

Each of the c context-parallel ranks (the depth axis) holds its queries, keys and values
``[b/q, heads/q, s/c, d_h]`` for the tokens ``assignment.positions[k]``. In step t = 0..c−1 it
holds the K/V block of rank k − t (mod c), sends it on to rank k + 1 while it computes (``Shift``:
the next block arrives during this one's product), and folds the block into its output with the
online softmax (a running row maximum m, sum l and unnormalised output): after c steps every query
has met every key under the mask's entries for that block, which is the serial attention up to the
order of a sum. It keeps the log-sum-exp of every row for the backward.

Backward (the flash-attention recurrences): the K/V blocks go round again, and with each block
travels the sum of its dK/dV over the ranks it has met; a rank adds its part (its queries' P^T dO
and dS^T Q) before passing it on, and after c steps every block's gradient is home.

Per rank and layer: forward, (c − 1) K/V blocks sent (2·(c − 1)/c·(b/q)·s·(h/q) elements, as the
all-gather receives); backward, (c − 1) K/V blocks and c dK/dV blocks (4·(c − 1)/c + 2/c times
that block size, against the all-gather's reduce-scatter of 2·(c − 1)/c). Memory: two K/V blocks
and one [s/c, s/c] score block at a time, against the all-gather's whole-sequence K/V and
[s/c, s] scores; ``optimus2d.cost.context_attention`` has both, and picks.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from optimus2d.comm import Mesh
from optimus2d.comm.sequence import Shift


class _Ring(Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh, blocks, scale):
        c, me = mesh.depth, mesh.index("depth")
        m = q.new_full(q.shape[:-1], float("-inf"))
        total = q.new_zeros(q.shape[:-1])
        acc = torch.zeros_like(q)
        kv = torch.stack([k, v])
        for t in range(c):
            ahead = Shift(kv, mesh, "depth") if t < c - 1 else None
            scores = _scores(q, kv[0], blocks[(me - t) % c], scale)
            new = torch.maximum(m, scores.amax(-1))
            safe = new.masked_fill(new == float("-inf"), 0.0)  # a row that has met no key yet
            p = torch.exp(scores - safe[..., None])
            alpha = torch.exp(m - safe)
            total = total * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ kv[1]
            m = new
            if ahead is not None:
                kv = ahead.wait()
        out = acc / total[..., None]  # a row that attends to nothing: 0/0, NaN, as torch's attention gives
        lse = m.masked_fill(m == float("-inf"), 0.0) + torch.log(total)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.blocks, ctx.scale = mesh, blocks, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, blocks, scale = ctx.mesh, ctx.blocks, ctx.scale
        c, me = mesh.depth, mesh.index("depth")
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        for t in range(c):
            ahead = Shift(kv, mesh, "depth") if t < c - 1 else None
            dkv = torch.zeros_like(kv) if t == 0 else grads.wait()  # noqa: F821 (the block's gradient so far)
            p = torch.exp(_scores(q, kv[0], blocks[(me - t) % c], scale) - lse[..., None])
            dkv[1] += p.transpose(-1, -2) @ dout
            ds = p * (dout @ kv[1].transpose(-1, -2) - delta)
            dq += (ds @ kv[0]) * scale
            dkv[0] += (ds.transpose(-1, -2) @ q) * scale
            grads = Shift(dkv, mesh, "depth", stream=1)  # on with its block; the last step sends it home
            if ahead is not None:
                kv = ahead.wait()
        dkv = grads.wait()
        return dq, dkv[0], dkv[1], None, None, None


def _scores(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~rows, float("-inf"))


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, blocks: list[torch.Tensor], scale: float | None
) -> torch.Tensor:
    """``[b/q, heads/q, s/c, d_h]`` each → ``[b/q, heads/q, s/c, d_h]``; ``blocks[r]``: the mask's
    entries (``[s/c, s/c]`` bool) of this rank's queries against rank r's keys. Checked by the caller
    (``context.attention``).

    forward: c − 1 shifts of K/V round the depth ring; backward: c − 1 of K/V and c of dK/dV."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if mesh.depth == 1:
        blocks = [blocks[0]]
    return _Ring.apply(q, k, v, mesh, blocks, scale)
