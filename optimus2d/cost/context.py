"""Context-parallel attention's two algorithms, counted: what each rank sends and holds.

For c ranks on the depth axis, each holding ``n = s/c`` tokens of ``B`` samples and ``H`` heads of
``d_h`` (``blk = B·H·n·d_h`` elements: one K or one V block), per layer, forward and backward:

=============  =====================================  ==========================================
method         elements a rank sends                  elements it holds beyond its own blocks
=============  =====================================  ==========================================
"all_gather"   2(c−1)·blk + 2(c−1)·blk (reduce-       2(c−1)·blk (the sequence's K and V, kept for
               scatter of dK, dV)                     backward) + n·s (its mask rows, additive)
"ring"         2(c−1)·blk + 2(c−1)·blk + 2c·blk       4·blk (a K/V block and the next) + n·n
               (K/V again, and dK/dV home)            (one block's mask)
=============  =====================================  ==========================================

Both compute through torch's CPU flash-attention kernel, which keeps no [n, s] scores (the
ring per block; ``context/ring.py``, which on other devices forms a block's B·H·n·n scores). The
all-gather sends less (4(c−1) against 6c−4 blocks) and has one sync point each way, where the
ring has c − 1 and 2c − 1; the ring holds a block at a time. ``context_attention_method`` picks the
all-gather unless it does not fit the memory given, then the ring (exact counts:
``tests/test_context_attention_mpi.py`` compares the sends with ``count_comm``).
"""

from __future__ import annotations

METHODS = ("all_gather", "ring")


def context_attention(batch: int, heads: int, n: int, d_h: int, c: int) -> dict[str, dict[str, int]]:
    """{method: {"sent": elements, "held": elements}} per rank for one layer's forward and backward,
    for ``batch`` samples and ``heads`` heads on this rank, ``n`` tokens a rank, c ranks."""
    blk, s = batch * heads * n * d_h, n * c
    if c == 1:
        return {m: {"sent": 0, "held": n * n} for m in METHODS}
    return {
        "all_gather": {"sent": 4 * (c - 1) * blk, "held": 2 * (c - 1) * blk + n * s},
        "ring": {"sent": (6 * c - 4) * blk, "held": 4 * blk + n * n},
    }


def context_attention_method(
    batch: int, heads: int, n: int, d_h: int, c: int, *, memory: float | None = None, bytes_per_element: int = 4
) -> str:
    """ "all_gather" (fewer bytes, one sync point), unless ``memory`` (bytes a rank can spare for one
    layer's attention) is given and the all-gather's held elements exceed it: then "ring"."""
    counts = context_attention(batch, heads, n, d_h, c)
    if memory is not None and counts["all_gather"]["held"] * bytes_per_element > memory:
        return "ring"
    return "all_gather"
