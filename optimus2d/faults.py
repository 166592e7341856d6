"""When a rank fails: its peers learn it at once and raise, instead of waiting out a timeout.

``report_failure(error)`` tells this rank's peers (``init()`` calls it for any exception that ends
a process); their waits in any collective then raise ``PeerFailedError`` naming the rank and its
error within a fraction of a second. Every wait is bounded by ``collective_timeout()``. The
mechanism (a watcher on the launch's store) is ``comm/watch.py``.
"""

from __future__ import annotations

from optimus2d.comm import watch
from optimus2d.comm.watch import PeerFailedError

__all__ = ["PeerFailedError", "collective_timeout", "report_failure"]


def collective_timeout() -> float:
    """Seconds a collective may wait on a peer: what ``init()`` gave the process group, else
    ``$OPTIMUS2D_TIMEOUT`` or 300 s (the clock of every watched wait, ``comm/watch.py``)."""
    return watch.collective_timeout()


def report_failure(error: BaseException | str) -> None:
    """Tell this rank's peers that it failed: those waiting on it in any mesh's collective raise
    ``PeerFailedError`` naming this rank and ``error`` within a fraction of a second.

    ``init()`` calls it for any exception that ends the process; call it yourself where you catch
    one (a test harness, a training loop that logs and exits). It does not end this process.
    """
    watch.report(error)
