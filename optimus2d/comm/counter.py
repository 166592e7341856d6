"""Count every collective optimus2d sends: kind, mesh axis, bytes.

Like PyTorch's ``CommDebugMode``, but it sees the mesh axis of each call, which is what the cost
formulas speak of. Groups of one rank send nothing and are not recorded. The small exchanges
that check the ranks agree (``comm/agreement.py``) are recorded apart, in ``checks``: ``numel``,
``bytes`` and ``count()`` are the algorithm's traffic alone.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CommRecord:
    """One collective as this rank saw it.

    ``numel``/``bytes`` is the payload of this rank: the tensor broadcast, reduced or all-reduced
    (sender or receiver alike), the gathered output of an all-gather, the input of a
    reduce-scatter.
    """

    kind: str
    axis: str
    numel: int
    bytes: int
    dtype: torch.dtype


@dataclass(eq=False)
class CommCounter:
    """Records collectives issued while active; use ``with count_comm() as c:``."""

    records: list[CommRecord] = field(default_factory=list)
    checks: list[CommRecord] = field(default_factory=list)  # agreement checks (comm/agreement.py), apart

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.records)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def count(self) -> int:
        return len(self.records)

    def by(self, *keys: str) -> Counter:
        """Element counts summed by record fields, e.g. ``c.by("kind", "axis")``."""
        totals: Counter = Counter()
        for r in self.records:
            totals[tuple(getattr(r, k) for k in keys)] += r.numel
        return totals

    def summary(self) -> str:
        rows = [f"{k:<14} {a:<6} {n:>12,} elements" for (k, a), n in sorted(self.by("kind", "axis").items())]
        return "\n".join([*rows, f"total {self.count()} collectives, {self.bytes:,} bytes"])


# Process-wide, not thread-local: on GPU, autograd runs backward on its own device threads.
_counters: list[CommCounter] = []
_lock = threading.Lock()


class count_comm:  # noqa: N801 (a context manager, named like torch's no_grad)
    """Context manager recording every optimus2d collective of this process (nests)."""

    def __enter__(self) -> CommCounter:
        self.counter = CommCounter()
        with _lock:
            _counters.append(self.counter)
        return self.counter

    def __exit__(self, *exc: object) -> None:
        with _lock:
            del _counters[next(n for n, c in enumerate(_counters) if c is self.counter)]


def record(kind: str, axis: str, tensor: torch.Tensor, times: int = 1) -> None:
    """Called by every communication helper before it sends; ``times``: the payload is that many ``tensor``s."""
    if _counters:
        numel = tensor.numel() * times
        rec = CommRecord(kind, axis, numel, numel * tensor.element_size(), tensor.dtype)
        with _lock:
            for counter in _counters:
                counter.records.append(rec)


def record_check(where: str, table: torch.Tensor) -> None:
    """Called by ``comm/agreement.py`` after each agreement exchange (``table``: every member's words)."""
    if _counters:
        rec = CommRecord("check", where, table.numel(), table.numel() * table.element_size(), table.dtype)
        with _lock:
            for counter in _counters:
                counter.checks.append(rec)
