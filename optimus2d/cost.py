"""What the algorithms should send and keep, per rank: the formulas the benchmarks check.

Elements (not bytes) each rank sends or receives, as ``count_comm`` counts them (the payload of
every broadcast, reduce and all-reduce it takes part in).
"""

from __future__ import annotations


def linear_2d_elements(
    rows: int, fin: int, fout: int, q: int, depth: int = 1, *, bias: bool = True, dx: bool = True, dw: bool = True
) -> int:
    """One ``Linear2D`` forward + backward; ``rows`` = global batch·sequence.

    3·rows·min(in, out)/(d·q) + 3·in·out/q, + in·out/q² over depth when depth > 1, + the bias
    gradient (out/q over col, out/q over depth). Each SUMMA step moves one activation block and
    one weight block; ``dx``/``dw`` False drop the backward products that are not needed.
    """
    act = rows * min(fin, fout) // (depth * q)  # the activation panel of the cheaper SUMMA form
    block = fin * fout // (q * q)
    total = 0
    if q > 1:
        per_product = q * (act // q + block)
        total += per_product * (1 + int(dx) + int(dw))
        total += fout // q if bias and dw else 0  # bias gradient over col
    if depth > 1 and dw:
        total += block + (fout // q if bias else 0)  # weight and bias gradients over depth
    return total


def mlp_2d_elements(
    rows: int, hidden: int, ffn: int, q: int, depth: int = 1, *, bias: bool = True, input_grad: bool = True
) -> int:
    """``Linear2D(h, ffn)`` → activation → ``Linear2D(ffn, h)``, forward + backward."""
    first = linear_2d_elements(rows, hidden, ffn, q, depth, bias=bias, dx=input_grad)
    return first + linear_2d_elements(rows, ffn, hidden, q, depth, bias=bias)


def mlp_1d_elements(rows: int, hidden: int, p: int, *, sequence_parallel: bool = False) -> int:
    """Megatron 1D MLP (column then row parallel), forward + backward, per rank.

    Without sequence parallelism: an all-reduce of rows·h forward and one backward. With it: an
    all-gather and a reduce-scatter of rows·h each way (counted as the full rows·h payload).
    """
    if p == 1:
        return 0
    return (4 if sequence_parallel else 2) * rows * hidden
