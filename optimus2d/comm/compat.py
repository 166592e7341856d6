"""What differs between the torch releases optimus2d supports, decided once, here.

* ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` exist from torch 2.13 on (which
  deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, with a warning); torch 2.11 has
  only the latter, with the same arguments. ``all_gather_single`` and ``reduce_scatter_single`` here
  call whichever the installed torch has.
* ``dist.new_group(..., sort_ranks=False)`` (group rank g = ``ranks[g]``) exists from torch 2.13 on;
  torch 2.11 always sorts a group's ranks. ``new_group`` here keeps the given order where torch can;
  ``group_ranks(group)`` is the order the group really has, for the callers whose roots and gathers
  must follow their own order (``Mesh`` reads it once per axis).
* ``torch.distributed.pipelining`` before 2.13 (``OLD_PIPELINES``) needs two fixes in optimus2d's
  stages (``pipeline/data_parallel.py``: ``LaneStage``).
* From torch 2.15 on (``SCHEDULE_INITIALIZES``) a schedule opens its pipeline itself, before any
  stage prepares: one all-reduce over the stages' parent group (``stage._parent_group``, the
  stage's group), then a first message on each pair of group ranks holding neighbouring stages; 2.13 and 2.14 asked each
  stage for a vote (``_warmup_forward_vote``), 2.11 for its first messages
  (``_get_init_p2p_neighbors_ops``). Stages on rank sets (``pipeline/rank_sets.py``) follow each.
* Features that need a newer torch than the oldest supported one (``MIN_TORCH``) name it in
  ``NEEDS``; ``missing(feature)`` is the reason it cannot run here (None where it can; tests skip
  with it), and ``require(feature)`` raises it as a ``RuntimeError`` (before any collective, on
  every rank alike: the verdict depends only on the installed torch and the arguments).
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules


def version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a torch version string such as "2.11.0+cu130" or "2.14.0.dev20260101"."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found[1]), int(found[2]), int(found[3] or 0)


TORCH = version(torch.__version__)
MIN_TORCH = (2, 11)  # the oldest torch optimus2d supports (setup.py)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
KEEPS_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters  # else new_group sorts the ranks
# torch.distributed.pipelining before 2.13: see pipeline/data_parallel.py, LaneStage
OLD_PIPELINES = TORCH[:2] < (2, 13)
# torch.distributed.pipelining from 2.15: the schedule, not the stage, opens the pipeline (see above)
SCHEDULE_INITIALIZES = hasattr(_schedules._PipelineSchedule, "_initialize_pipeline_distributed_state")

# Features that need a newer torch than MIN_TORCH: whether the installed one has what they need, the
# oldest release that has it, and why.
NEEDS = {
    "pipeline groups out of rank order": (
        KEEPS_ORDER,
        (2, 13),
        "a pipeline's lanes and data-parallel groups must list their ranks in stage (copy) order, and torch "
        "2.11's new_group sorts a group's ranks (no sort_ranks=); the ranks of these stage meshes do not "
        "ascend along them. Build the stage meshes on ascending ranks (stage_meshes does)",
    ),
    # Not refused (a compiled model runs, and computes what eager does): torch 2.11's dynamo breaks
    # the graph inside optimus2d's modules (comparing ReduceOps, describing symbolic shapes), so a
    # compiled transformer block runs as several graphs with eager code between them.
    "one-graph torch.compile": (
        TORCH[:2] >= (2, 13),
        (2, 13),
        "torch 2.11's dynamo breaks the graph at optimus2d's agreement checks and reductions (a compiled model "
        "runs, as several graphs)",
    ),
}


def all_gather_single(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (``n·t.shape[0]`` rows) becomes every group member's ``t``, in group rank order."""
    return _all_gather(out, t, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """``out`` becomes the sum over the group of chunk ``group rank`` of everyone's ``t``."""
    return _reduce_scatter(out, t, group=group, async_op=async_op)


def new_group(ranks, **kwargs):
    """``dist.new_group(ranks, **kwargs)`` keeping the order of ``ranks`` (group rank g = ``ranks[g]``)
    where the installed torch can (``KEEPS_ORDER``); else torch sorts them: read the order the group
    has with ``group_ranks``. Collective over the world, like ``dist.new_group``."""
    if KEEPS_ORDER:
        kwargs.setdefault("sort_ranks", False)
    return dist.new_group(list(ranks), **kwargs)


def group_ranks(group) -> tuple[int, ...]:
    """The global ranks of ``group``'s members, in group rank order."""
    return tuple(dist.get_process_group_ranks(group))


def torch_version() -> str:
    return torch.__version__.split("+")[0]


def missing(feature: str) -> str | None:
    """Why ``feature`` (a key of ``NEEDS``) cannot run on the installed torch; None where it can."""
    available, needed, why = NEEDS[feature]
    if available:
        return None
    return f"optimus2d: {feature}: needs torch >= {'.'.join(map(str, needed))} (this is {torch_version()}): {why}"


def require(feature: str) -> None:
    """Raise ``RuntimeError`` where ``feature`` cannot run on the installed torch (the same on every rank)."""
    reason = missing(feature)
    if reason is not None:
        raise RuntimeError(reason)
