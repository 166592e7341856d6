"""Progress of long collective operations (``load_pretrained``, ``save_pretrained``,
``checkpoint.save``): a tqdm bar and a one-line summary, on one rank only.

The rank is the model's mesh's first (mesh index 0 of replica 0), or rank 0 of the world for a
model on no mesh: known without communicating. ``progress``: True shows the bar, False hides it,
None (the default) shows it when stderr is a terminal. The summary goes to stderr (``print``)
where the bar is shown, else to the ``optimus2d`` logger at INFO (silent unless logging is set up).
tqdm is imported lazily; without it there is no bar, only the summary.
"""

from __future__ import annotations

import logging
import sys
import time

import torch.distributed as dist

logger = logging.getLogger("optimus2d")


def leads(mesh) -> bool:
    """Whether this rank reports for an operation on ``mesh`` (None: a model on no mesh)."""
    if mesh is not None and getattr(mesh, "coord", None) is not None:
        return mesh.index("mesh") == 0 and getattr(mesh, "replica", 0) in (0, None)
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def mib(nbytes: int) -> str:
    """``nbytes`` for people: "812.0 KiB", "1.2 MiB", "3.4 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def on(mesh) -> str:
    """ " on a 2×2 mesh" (q×q, or q×q×depth), "" for a model on no mesh."""
    if mesh is None:
        return ""
    shape = f"{mesh.q}×{mesh.q}" + (f"×{mesh.depth}" if mesh.depth > 1 else "")
    return f" on a {shape} mesh"


class Progress:
    """``with Progress("load_pretrained", total, mesh, progress) as bar: bar.update(); bar.summary(text)``."""

    def __init__(self, what: str, total: int, mesh, progress: bool | None, unit: str = "tensor") -> None:
        self.what, self.lead = what, leads(mesh)
        self.shown = self.lead and (bool(progress) if progress is not None else _is_tty())
        self.start = time.perf_counter()
        self._bar = None
        if self.shown:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # no bar; the summary still comes
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def note(self, text: str) -> None:
        """A word after the bar (what it waits on now)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def summary(self, text: str) -> None:
        """One line on the reporting rank: stderr where the bar is shown, else the logger (INFO)."""
        self.close()
        if not self.lead:
            return
        if self.shown:
            print(text, file=sys.stderr, flush=True)
        else:
            logger.info(text)


def _is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
