"""Which sequence blocks each context-parallel rank holds: balanced by attention work, not by count.

Context parallelism splits a sequence of ``s`` tokens over ``c`` ranks. Each rank computes the
attention of its own queries against every key (gathered, or passed round a ring), so its work is
the number of unmasked (query, key) pairs in its query rows, and a split by count is unbalanced
wherever the mask is: under a causal mask the last of c contiguous shards has about 2c − 1 times
the first one's pairs; an image span inside causal text attends both ways; packed documents mask
each other out. This module assigns fixed-size blocks of the sequence to ranks, every rank the
same number of blocks (the same activation memory), to even out the pairs:

* ``"uniform"``: rank r holds the r-th contiguous s/c tokens (the count split, for reference);
* ``"head_tail"``: 2c chunks, rank r holds chunk r and chunk 2c − 1 − r (the zigzag of ring and
  striped attention); under a plain causal mask every rank holds exactly the same number of pairs;
* ``"makespan"``: blocks of ``block`` tokens, the heaviest first, each to the least loaded rank
  that still has room (longest-processing-time greedy with equal counts, Cornstarch's
  MAKESPAN_MIN), for any mask.

An ``Assignment`` is a permutation of the sequence: ``positions[r]`` are the token positions rank
r holds, ascending. Everything a token carries (its embedding, its position id for RoPE or a
learned table, its label) follows the permutation; a loss over the whole sequence counts every
token once, wherever it sits. Masks here are boolean ``[s, s]`` (query, key), True where the query
attends to the key, as ``torch.nn.functional.scaled_dot_product_attention`` reads a boolean mask.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

METHODS = ("uniform", "head_tail", "makespan")


@dataclass(frozen=True)
class Assignment:
    """``positions[r]``: the token positions context-parallel rank r holds (ascending, the same
    count on every rank); ``pairs[r]``: the unmasked (query, key) pairs of its queries."""

    method: str
    positions: tuple[torch.Tensor, ...]
    pairs: tuple[int, ...]

    def __post_init__(self) -> None:
        """One made by hand holds every position once, the same count on every rank (a token twice
        and another never was silently wrong; unequal counts refused on some ranks alone)."""
        counts = [int(p.numel()) for p in self.positions]
        if len(set(counts)) > 1:
            raise ValueError(f"Assignment: every rank holds the same number of positions, got {counts}")
        if len(self.pairs) != len(self.positions):
            raise ValueError(f"Assignment: {len(self.pairs)} pair counts for {len(self.positions)} ranks")
        every = torch.cat([p.reshape(-1) for p in self.positions]).sort().values if self.positions else None
        if every is not None and not torch.equal(every.cpu(), torch.arange(every.numel())):
            raise ValueError(
                f"Assignment: its positions must hold each of 0..{every.numel() - 1} exactly once (a permutation "
                f"of the sequence), got {sorted(every.tolist())[:12]}{' ...' if every.numel() > 12 else ''}"
            )

    @property
    def imbalance(self) -> float:
        """max / mean of the pairs per rank (1.0: perfectly balanced)."""
        mean = sum(self.pairs) / len(self.pairs)
        return max(self.pairs) / mean if mean else 1.0

    def permutation(self) -> torch.Tensor:
        """The positions of every rank, rank after rank: ``x[:, permutation()]`` lays a sequence out
        in rank order, and ``argsort`` of it takes it back."""
        return torch.cat(self.positions)


def causal_mask(s: int) -> torch.Tensor:
    """``[s, s]``: query t attends to keys 0..t."""
    return torch.ones(s, s, dtype=torch.bool).tril()


def image_text_mask(s: int, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Causal text with image spans ``[start, end)`` whose tokens attend to each other both ways
    (an image's patches see the whole image), as in LLaVA-style models with bidirectional images."""
    mask = causal_mask(s)
    for start, end in spans:
        if not 0 <= start < end <= s:
            raise ValueError(f"image_text_mask: span [{start}, {end}) is not inside a sequence of {s} tokens")
        mask[start:end, start:end] = True
    return mask


def document_mask(lengths: Sequence[int], causal: bool = True) -> torch.Tensor:
    """Packed documents of these ``lengths``: a token attends only within its own document (causally
    unless ``causal=False``)."""
    if any(n <= 0 for n in lengths):
        raise ValueError(f"document_mask: every document needs at least one token, got lengths {list(lengths)}")
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    mask = doc[:, None] == doc[None, :]
    return mask & causal_mask(len(doc)) if causal else mask


def assign(mask: torch.Tensor, c: int, method: str = "makespan", *, block: int | None = None) -> Assignment:
    """Assign the sequence of ``mask`` (``[s, s]`` bool) to ``c`` context-parallel ranks by ``method``.

    ``block``: the tokens of a block ("makespan"; default the largest divisor of s/c that gives at
    least 8 blocks a rank, so the greedy has room to balance). Refused (``ValueError`` naming the
    sizes): a mask that is not square boolean, ``c`` < 1, a sequence that c (2c for "head_tail",
    c·block for "makespan") does not divide: pad the sequence to a multiple first.
    """
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or mask.dim() != 2
        or mask.shape[0] != mask.shape[1]
    ):
        got = f"{mask.dtype}{list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"assign: the mask must be a square boolean [s, s] (query, key), got {got}")
    if method not in METHODS:
        raise ValueError(f"assign: method {method!r} is not one of {METHODS}")
    if not isinstance(c, int) or c < 1:
        raise ValueError(f"assign: the context-parallel size c must be a positive int, got {c!r}")
    s = mask.shape[0]
    row_pairs = mask.sum(1, dtype=torch.int64)
    if method == "uniform":
        blocks = _blocks(s, c, c, method)
        owner = list(range(c))
    elif method == "head_tail":
        blocks = _blocks(s, 2 * c, c, method)
        owner = [min(b, 2 * c - 1 - b) for b in range(2 * c)]
    else:
        size = block if block is not None else _default_block(s, c)
        if not isinstance(size, int) or size < 1 or s % (c * size):
            raise ValueError(
                f"assign: a sequence of {s} tokens does not split into blocks of {size} tokens, an equal "
                f"number per rank for c = {c}: pad it to a multiple of {c * size if isinstance(size, int) else c}"
            )
        blocks = [(b * size, (b + 1) * size) for b in range(s // size)]
        work = [int(row_pairs[start:end].sum()) for start, end in blocks]
        owner = makespan(work, c)
    held: list[list[int]] = [[] for _ in range(c)]
    for (start, end), rank in zip(blocks, owner, strict=True):
        held[rank].extend(range(start, end))
    positions = tuple(torch.tensor(sorted(p), dtype=torch.long) for p in held)
    pairs = tuple(int(row_pairs[p].sum()) for p in positions)
    return Assignment(method, positions, pairs)


def makespan(work: Sequence[int], c: int) -> list[int]:
    """The rank of each block: heaviest first, each to the least loaded rank with room (every rank
    gets len(work)/c blocks; ties to the lower rank). Longest-processing-time greedy: within 4/3 of
    the best makespan, and far closer when blocks are many and small."""
    n = len(work)
    if n % c:
        raise ValueError(f"makespan: {n} blocks do not split equally over {c} ranks")
    room, owner = [n // c] * c, [0] * n
    heap = [(0, r) for r in range(c)]
    for b in sorted(range(n), key=lambda b: (-work[b], b)):
        skipped = []
        load, rank = heapq.heappop(heap)
        while room[rank] == 0:
            skipped.append((load, rank))
            load, rank = heapq.heappop(heap)
        owner[b], room[rank] = rank, room[rank] - 1
        heapq.heappush(heap, (load + work[b], rank))
        for item in skipped:
            heapq.heappush(heap, item)
    return owner


def _blocks(s: int, n: int, c: int, method: str) -> list[tuple[int, int]]:
    if s % n:
        raise ValueError(
            f"assign: {method} splits a sequence into {n} equal chunks for c = {c}, and {s} tokens do not "
            f"divide: pad the sequence to a multiple of {n}"
        )
    size = s // n
    return [(b * size, (b + 1) * size) for b in range(n)]


def _default_block(s: int, c: int) -> int:
    per_rank = s // c if s % c == 0 else 0
    if per_rank == 0:
        raise ValueError(
            f"assign: a sequence of {s} tokens does not split over c = {c} ranks: pad it to a multiple of {c}"
        )
    best = 1
    for size in range(1, per_rank + 1):
        if per_rank % size == 0 and per_rank // size >= 8:
            best = size
    return best
