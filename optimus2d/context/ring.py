"""Ring attention: K/V blocks passed round the depth ring instead of gathered (``attention(..., method="ring")``).

Each of the c context-parallel ranks (the depth axis) holds its queries, keys and values
``[b/q, heads/q, s/c, d_h]`` for the tokens ``assignment.positions[k]``. In step t = 0..c−1 it
holds the K/V block of rank k − t (mod c), sends it on to rank k + 1 while it computes (``Shift``:
the next block arrives during this one's product), and folds the block into its output by the
log-sum-exp of each row (the block's output and log-sum-exp from torch's CPU flash-attention kernel,
so no [s/c, s/c] scores are held; on other devices the block's scores in full): after c steps every
query has met every key under the mask's entries for that block, which is the serial attention up
to the order of a sum. It keeps the log-sum-exp of every row for the backward. A block a rank's
queries see nothing of (a causal mask's later keys) is passed on without a product.

Backward (the flash-attention recurrences, from the whole output and log-sum-exp: torch's CPU
kernel's backward per block): the K/V blocks go round again, and with each block travels the sum of
its dK/dV over the ranks it has met; a rank adds its part before passing it on, and after c steps
every block's gradient is home.

Per rank and layer: forward, (c − 1) K/V blocks sent (2·(c − 1)/c·(b/q)·s·(h/q) elements, as the
all-gather receives); backward, (c − 1) K/V blocks and c dK/dV blocks (4·(c − 1)/c + 2/c times
that block size, against the all-gather's reduce-scatter of 2·(c − 1)/c). Memory: two K/V blocks
and one block's [s/c, s/c] mask at a time, against the all-gather's whole-sequence K/V and its
[s/c, s] mask; ``optimus2d.cost.context_attention`` has both, and picks.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from optimus2d.comm import Mesh
from optimus2d.comm.first_order import first_order
from optimus2d.comm.sequence import Shift


class _Ring(Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh, blocks, scale):
        c, me = mesh.depth, mesh.index("depth")
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"))
        kv = torch.stack([k, v])
        for t in range(c):
            ahead = Shift(kv, mesh, "depth") if t < c - 1 else None
            rows = blocks[(me - t) % c]
            if rows.any():  # a block this rank's queries see nothing of adds nothing
                part, part_lse = _block_forward(q, kv[0], kv[1], rows, scale)
                new = torch.logaddexp(lse, part_lse)
                safe = new.masked_fill(new == float("-inf"), 0.0)  # rows that have met no key yet
                out = out * torch.exp(lse - safe)[..., None] + part * torch.exp(part_lse - safe)[..., None]
                lse = new
            if ahead is not None:
                kv = ahead.wait()
        # a row with no key at all: output 0 (as torch's CPU kernel gives), and no gradient (P = exp(S - inf))
        ctx.save_for_backward(q, k, v, out, lse.masked_fill(lse == float("-inf"), float("inf")))
        ctx.mesh, ctx.blocks, ctx.scale = mesh, blocks, scale
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, blocks, scale = ctx.mesh, ctx.blocks, ctx.scale
        c, me = mesh.depth, mesh.index("depth")
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        for t in range(c):
            ahead = Shift(kv, mesh, "depth") if t < c - 1 else None
            dkv = torch.zeros_like(kv) if t == 0 else grads.wait()  # noqa: F821 (the block's gradient so far)
            rows = blocks[(me - t) % c]
            if rows.any():
                dq_part, dk_part, dv_part = _block_backward(dout, q, kv[0], kv[1], out, lse, rows, scale)
                dq += dq_part
                dkv[0] += dk_part
                dkv[1] += dv_part
            grads = Shift(dkv, mesh, "depth", stream=1)  # on with its block; the last step sends it home
            if ahead is not None:
                kv = ahead.wait()
        dkv = grads.wait()
        return dq, dkv[0], dkv[1], None, None, None


def _flash(q: torch.Tensor) -> bool:
    """torch's CPU flash-attention kernel takes a block, a float mask, and gives the log-sum-exp."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def _bias(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(rows.shape, dtype=dtype, device=rows.device).masked_fill_(~rows, float("-inf"))


def _block_forward(q, k, v, rows, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries against one K/V block: (output normalised within the block, its log-sum-exp),
    -inf for a row that sees nothing of the block. On CPU torch's flash kernel (nothing [s/c, s/c] per
    head is kept); elsewhere the scores in full."""
    if _flash(q):
        part, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=_bias(rows, q.dtype), scale=scale
        )
        return part, part_lse.masked_fill(~rows.any(-1), float("-inf"))  # the kernel says 0 for an empty row
    scores = _scores(q, k, rows, scale)
    part_lse = torch.logsumexp(scores, -1)
    safe = part_lse.masked_fill(part_lse == float("-inf"), 0.0)
    return torch.exp(scores - safe[..., None]) @ v, part_lse


def _block_backward(dout, q, k, v, out, lse, rows, scale):
    """dQ, dK, dV of one block, from the whole attention's output and log-sum-exp (flash recurrences)."""
    if _flash(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=_bias(rows, q.dtype), scale=scale
        )
    p = torch.exp(_scores(q, k, rows, scale) - lse[..., None])
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout


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
    # torch's CPU flash kernel, called as an operator, reads its inputs as if contiguous (SDPA makes
    # them so first): a query stored [.., d_h, n] transposed gave 2.5e306 off
    q, k, v = (t.contiguous() for t in (q, k, v))
    if mesh.depth == 1:
        blocks = [blocks[0]]
    return _Ring.apply(q, k, v, mesh, blocks, scale)
