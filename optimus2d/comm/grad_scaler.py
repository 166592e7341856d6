"""``torch.amp.GradScaler`` on DTensor gradients: every rank finds the same inf/NaN.

``scaler.unscale_`` runs ``aten._amp_foreach_non_finite_check_and_unscale_`` on the gradients,
which DTensor dispatches to its own handler: the local check, then ``found_inf`` reduced (max)
over the mesh dims where the *first* gradient of the list is sharded. A converted model's
gradients are not all sharded alike: a norm's weight is whole over the rows and columns of the
mesh (``(Replicate, Replicate, Shard(0))``), a Linear's is split over them. Where the first one is
such a norm, an overflow in one block of a Linear's gradient was seen by some ranks only: they
skipped the step and halved their scale, the others stepped (3e-4 off serial after 3 steps, the
replicas of one block apart). This handler reduces ``found_inf`` over every dim of every mesh the
gradients live on (a max over copies of the same flag changes nothing), so the ranks skip alike.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

__all__ = ["install"]


def _found_inf_everywhere(op_call, args, kwargs) -> None:
    grads, found_inf, inv_scale = args[0], args[1], args[2]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    op_call(local, found_inf, inv_scale, **kwargs)
    meshes = []
    for g in grads:  # in the list's order: the same on every rank
        if isinstance(g, DTensor) and all(g.device_mesh is not m for m in meshes):
            meshes.append(g.device_mesh)
    for mesh in meshes:
        partial = DTensor.from_local(found_inf, mesh, [Partial("max")] * mesh.ndim, run_check=False)
        found_inf.copy_(partial.full_tensor())


def install() -> None:
    """Put the handler in DTensor's dispatcher (once; torch's own is replaced)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if handlers is None:  # a torch without the table: its own handler (or none) stays
        return
    handlers[torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default] = _found_inf_everywhere
