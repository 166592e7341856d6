"""What the algorithms should send and keep, per rank: the formulas the benchmarks check.

Elements (not bytes) each rank sends or receives, as ``count_comm`` counts them: the payload of
every broadcast, reduce and all-reduce it takes part in, the gathered output of an all-gather,
the input of a reduce-scatter, and the block it sends in an exchange with rank (k, j, i).
"""

from __future__ import annotations


def linear_2d_summa_elements(rows: int, fin: int, fout: int, q: int, depth: int = 1, *, dx=True, dw=True) -> int:
    """The SUMMA products of one ``Linear2D`` forward + backward (no bias, no depth reduction).

    Each product moves, every step, one activation block (of the cheaper form's broadcast side)
    and one weight block: 3·rows·min(in, out)/(d·q) + 3·in·out/q. For in > out (C = A·Bᵀ) a
    backward that makes both gradients broadcasts each dC block once for the two (one activation
    term less). ``dx``/``dw`` False drop the unneeded products.
    """
    if q == 1:
        return 0
    act = rows * min(fin, fout) // (depth * q * q)  # one block
    block = fin * fout // (q * q)
    products = 1 + int(dx) + int(dw)
    shared = int(dx and dw and fin > fout)
    return q * (act * (products - shared) + block * products)


def linear_2d_stationary_elements(
    rows: int, fin: int, fout: int, q: int, depth: int = 1, *, dx=True, dw=True, on_diagonal: bool = False
) -> int:
    """The weight-stationary products (``comm/stationary.py``) of one ``Linear2D`` forward + backward.

    R = rows/d per depth slice. Forward: an all-gather of R·in/q, a reduce-scatter of R·out/q and
    an exchange of R·min(in, out)/q² (none on the diagonal i = j). Backward: the gradient's
    all-gather (R·out/q, after its exchange for in > out), then R·in/q for dx's reduce-scatter (and
    its exchange back for in ≤ out) and R·in/q for dw's regathered input.
    """
    if q == 1:
        return 0
    big, small = rows // depth, rows // depth // q  # R, and this rank's rows
    swap = 0 if on_diagonal else small * min(fin, fout) // q
    total = big * fin // q + big * fout // q + swap
    if dx or dw:
        total += big * fout // q + (swap if fin > fout else 0)
    if dx:
        total += big * fin // q + (swap if fin <= fout else 0)
    if dw:
        total += big * fin // q
    return total


def linear_2d_algorithm(rows: int, fin: int, fout: int, q: int, depth: int = 1, *, dx=True, dw=True) -> str:
    """Returns "stationary" when it moves fewer elements than SUMMA, else "summa".

    Stationary wins when the rows are fewer than about 1–1.5 × the smaller feature size. ``dx``,
    ``dw``: whether backward computes the input's and the weight's gradient (neither: inference).

    Depends only on global sizes and on what needs a gradient, so every rank of a mesh makes the
    same choice (the stationary count is an off-diagonal rank's, whose exchanges are not free).
    """
    stationary = linear_2d_stationary_elements(rows, fin, fout, q, depth, dx=dx, dw=dw)
    summa = linear_2d_summa_elements(rows, fin, fout, q, depth, dx=dx, dw=dw)
    return "stationary" if stationary < summa else "summa"


def linear_2d_elements(
    rows: int,
    fin: int,
    fout: int,
    q: int,
    depth: int = 1,
    *,
    bias: bool = True,
    dx: bool = True,
    dw: bool = True,
    algorithm: str = "auto",
    on_diagonal: bool = False,
) -> int:
    """One ``Linear2D`` forward + backward; ``rows`` = global batch·sequence.

    The products of ``algorithm`` ("auto" = ``linear_2d_algorithm``'s choice), + the weight and
    bias gradients over depth when depth > 1 (in·out/q² + out/q), + the bias gradient over col
    (out/q). ``on_diagonal``: this rank is (k, i, i), whose exchanges send nothing.
    """
    if algorithm == "auto":
        algorithm = linear_2d_algorithm(rows, fin, fout, q, depth, dx=dx, dw=dw)
    if algorithm == "summa":
        total = linear_2d_summa_elements(rows, fin, fout, q, depth, dx=dx, dw=dw)
    else:
        total = linear_2d_stationary_elements(rows, fin, fout, q, depth, dx=dx, dw=dw, on_diagonal=on_diagonal)
    if q > 1 and bias and dw:
        total += fout // q  # bias gradient over col
    if depth > 1 and dw:
        total += fin * fout // (q * q) + (fout // q if bias else 0)  # weight and bias gradients over depth
    return total


def mlp_2d_elements(
    rows: int,
    hidden: int,
    ffn: int,
    q: int,
    depth: int = 1,
    *,
    bias: bool = True,
    input_grad: bool = True,
    algorithm: str = "auto",
    on_diagonal: bool = False,
) -> int:
    """``Linear2D(h, ffn)`` → activation → ``Linear2D(ffn, h)``, forward + backward."""
    kw = {"bias": bias, "algorithm": algorithm, "on_diagonal": on_diagonal}
    first = linear_2d_elements(rows, hidden, ffn, q, depth, dx=input_grad, **kw)
    return first + linear_2d_elements(rows, ffn, hidden, q, depth, **kw)


def mlp_1d_elements(rows: int, hidden: int, p: int, *, sequence_parallel: bool = False, input_grad: bool = True) -> int:
    """Megatron 1D MLP (column then row parallel), forward + backward, per rank.

    Without sequence parallelism: an all-reduce of rows·h forward, and one backward when the
    input needs a gradient. With it: forward an all-gather of the input and a reduce-scatter of
    the output; backward an all-gather of dY and, for the input's gradient, a reduce-scatter
    (each counted as the full rows·h payload). DTensor's plans send exactly these (checked with
    ``CommDebugMode`` in tests/test_peers_mpi.py).
    """
    if p == 1:
        return 0
    return ((3 if sequence_parallel else 1) + int(input_grad)) * rows * hidden
