"""A model that takes its inputs whole and gives its outputs whole: ``parallelize(..., io="whole")``.

By default a parallelized model takes blocks of its mesh (``scatter``, ``scatter_batch``) and gives
blocks (``gather`` them). With ``io="whole"`` it takes every tensor argument whole, the same on every
rank (as torch's ``parallelize_module`` takes a ``Replicate`` input: each rank loads the whole batch),
and gives every tensor of its output whole on every rank (as DTensor's 1D layout gives it):

* entry: each tensor argument of one dim or more → this rank's block of the model's mesh
  (``from_whole``: nothing sent; backward, where it needs a gradient, the blocks' gradients
  all-gathered): a floating tensor of 2 or 3 dims is an activation ``[b, ..., h]`` (cut as
  ``scatter`` cuts it), any other (ids, masks, labels, images ``[b, c, H, W]``) a batch tensor
  (cut as ``scatter_batch`` cuts it). A planned module that takes such a block unchanged does not move it: a 1D
  region (``megatron.Megatron``) takes the whole tensor itself, a module on another mesh shape
  cuts its own block of it; nothing sent either way.
* exit: each output tensor, a block of a mesh → the whole tensor (``to_whole``: one all-gather
  forward, nothing backward). A 1D region's whole output, cut into blocks at its boundary
  (``from_whole``) and returned unchanged, is given whole as it was: nothing sent either way. A
  tensor without a layout is a block of the model's mesh (the model's own forward ran on its
  blocks), as at every boundary.

So a model that is one 1D region sends exactly what torch's ``parallelize_module`` sends for it,
and a model on a mesh pays one all-gather of each output to give it whole. While a call runs, a
1D region's whole output is kept beside the blocks cut from it; all are let go when the call
returns. Whole inputs that differ between ranks are not detected (as DTensor assumes of a
``Replicate`` input): every rank must load the same batch.
"""

from __future__ import annotations

import torch
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.comm.whole import forget_whole, from_whole, keep_whole, to_whole, whole_of
from optimus2d.convert.layouts import Boundary, _kind, _map, _tensors
from optimus2d.layers.base import ShardedModule

IO = ("blocks", "whole")


def io_refusal(io: object) -> Exception | None:
    """Why ``parallelize(io=)`` refuses ``io`` (None: it takes it)."""
    if not isinstance(io, str) or io not in IO:
        return ValueError(
            f"parallelize: io= is 'blocks' (the default: blocks of the mesh in and out) or 'whole', got {io!r}"
        )
    return None


class WholeIO(Boundary):
    """The hooks of a model converted with ``io="whole"``: whole tensors in, whole tensors out.

    ``active`` while a call runs (a 1D region's boundary then keeps its whole output beside the
    blocks it cuts, ``keep``); ``kept``: those blocks and the inputs' blocks, forgotten on return."""

    def __init__(self, mesh: Mesh, meshes: list[Mesh]) -> None:
        super().__init__("the model", mesh, mesh, meshes)
        self.active = False
        self.kept: list[torch.Tensor] = []

    def install(self, module: nn.Module) -> None:
        if isinstance(module, ShardedModule):  # its __call__ calls before and after around its own check
            module.__dict__["_optimus2d_boundary"] = self
        else:
            module.register_forward_pre_hook(self.before, with_kwargs=True)
            module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._forget()
        named = [(f"argument {n}", a) for n, a in enumerate(args)] + list(kwargs.items())
        for name, t in (hit for key, value in named for hit in _tensors(value, key)):  # refuse before cutting
            if t.dim() and getattr(t, "_optimus2d_layout", None) is not None:
                raise ValueError(
                    f"parallelize(io='whole'): the model takes its inputs whole on every rank, but {name} of shape "
                    f"{tuple(t.shape)} is a block of a mesh (from scatter, scatter_batch or a module): give the whole "
                    f"tensor, or convert the model with io='blocks'"
                )
        self.active = True
        return _map((args, kwargs), self._in)

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        try:
            return super().after(module, args, output) if output is not None else output
        finally:
            self.active = False
            self._forget()

    def keep(self, block: torch.Tensor, whole: torch.Tensor) -> None:
        """Note on ``block`` the whole tensor it was cut from, until this call returns."""
        keep_whole(block, whole)
        self.kept.append(block)

    def _forget(self) -> None:
        for block in self.kept:
            forget_whole(block)
        self.kept.clear()

    def _in(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        kind = "activation" if t.is_floating_point() and t.dim() in (2, 3) else "batch"
        block = from_whole(t, self.inner, kind)
        self.keep(block, t)
        return block

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        whole = whole_of(t)
        if whole is not None:
            return whole
        given = getattr(t, "_optimus2d_layout", None)
        src = self.meshes.get(given, self.inner) if given is not None else self.inner
        return to_whole(t, src, _kind(t))
