"""The agreement of a module call: every rank enters an outermost optimus2d module with inputs of
the same dtypes and shapes, or every rank raises the same error and none returns a block.

At the entry of every outermost call (level "entry" and up, more than one rank) each rank posts the
5-word all-gather of ``agreement.signature`` over the mesh; every rank posts it at every call, so
the exchanges match whatever each rank decides next:

* **Beside** (``Pending``): the module runs while the exchange travels, and it is resolved at the
  module's exit, before the output is returned, or by any wait of the mesh that finds it complete
  (``watch.wait``), so a rank stuck in a collective that a disagreement broke raises the
  agreement's error. Over MPI every call rides beside (a message of another size is an MPI error,
  or arrives short and is never returned). Over torch.distributed only a rank whose inputs are all
  **fresh** does: tensors agreed at this mesh's latest agreement point (the inputs and outputs of
  the last outermost call, or ``scatter``'s output since), unchanged in shape. They were agreed
  there, so their shapes are every fresh rank's shapes, and no block of another size can reach a
  peer (unless the ranks' programs differ: one feeds the last call's input where the others feed
  its output; over MPI that is caught at the exit, over gloo it may abort the process).
* **First** (``Pending.resolve`` at once): any other input, over torch.distributed — gloo aborts
  the process on a message longer than expected and silently fills a longer buffer short; NCCL may
  hang or corrupt. A rank that finds the ranks disagree raises before sending a block; its fresh
  peers, waiting for it in the module's collectives, find the exchange complete and raise the same
  error (their abandoned collectives leave the mesh unusable, as after any failure).

A rank's own refusal (``refusal``: a meta tensor, an empty input, a block of another mesh, a
module's ``input_refusal``) travels in the exchange and is settled at once, so every rank raises it.
Under ``torch.compile`` the check is a step of the graph (``comm/traced.py``), at every outermost
call as in eager, settled before the module runs.
"""

from __future__ import annotations

import torch

from optimus2d.comm import traced
from optimus2d.comm.agreement import Posted, _gather, agree, describe, describe_call, signature, verdict


class Pending:
    """A module call's agreement, posted at its entry and resolved at its exit (or at once)."""

    def __init__(self, mesh, what: str, description: str, error: BaseException | None) -> None:
        self.mesh, self.error = mesh, error
        self.where, self.description = f"{what} on {mesh}", f"{what} of {description}"
        words = torch.tensor(signature(f"{what} of mesh #{mesh.uid}", self.description, (), error), dtype=torch.int64)
        self._posted = Posted(mesh, "mesh", words)
        self.ready = self._posted.ready
        mesh.pending = self

    def resolve(self) -> None:
        """Wait for the exchange and raise, on every rank alike, if the ranks disagree."""
        if self.mesh.pending is self:
            self.mesh.pending = None
        table = self._posted.wait()
        gather = lambda t: _gather(self.mesh, "mesh", t)  # noqa: E731
        verdict(table, gather, self.mesh.members("mesh"), self.where, self.description, self.error, self.mesh)


def check_call(
    mesh,
    what: str,
    args: tuple,
    kwargs: dict,
    error: BaseException | None = None,
    training: bool | None = None,
    frozen: tuple[str, ...] = (),
):
    """At the entry of an outermost module call on ``mesh``: ``(pending, agreed)``, the ``Pending``
    agreement to resolve at the module's exit (None: settled already, or none) and whether the
    outputs are agreed (then ``tag`` marks them so). ``error``: this rank's refusal of its input,
    found by the caller (``refusal``); raised on every rank. Agreed with the inputs' dtypes and
    shapes: which of them require grad, the grad mode (a layer picks its algorithm, and its
    backward its collectives, by them: one rank's differing waited to the timeout) and the
    module's ``training`` (one rank's ``eval()`` ran without its dropout, silently) and its
    ``frozen`` parameters, those that do not require grad (a weight frozen on one rank skipped the
    collectives of its gradient: its peers waited to the timeout, and one returned another input
    gradient)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    fresh = _fresh(tensors, mesh)
    if not torch.compiler.is_compiling():  # (a graph's guards would read the count: one graph per call)
        mesh.calls += 1
    if mesh.check == "off" or mesh.size == 1:
        if error is not None:
            raise error
        return None, fresh or mesh.size == 1
    grads = "".join("g" if t.requires_grad else "-" for t in tensors)
    mode = f"; requires grad {grads or 'none'}, grad mode {'on' if torch.is_grad_enabled() else 'off'}"
    description = describe_call(args, kwargs) + mode + ("" if training is None else f", training {training}")
    description += f", frozen {', '.join(frozen) or 'none'}"
    if torch.compiler.is_compiling():  # a step of the graph, settled before the module's collectives
        traced.agree(mesh, what, "mesh", description, None, error)
        return None, True
    pending = Pending(mesh, what, description, error)
    if error is not None or (mesh.mpi is None and not fresh):
        pending.resolve()
        return None, True
    return pending, True


def check_function_call(mesh, what: str, tensors: tuple, settings: str, error: BaseException | None) -> None:
    """At the entry of a public function that communicates (``cross_entropy``, ``clip_grad_norm_``):
    every rank of ``mesh`` passes tensors of the same dtypes and shapes and the same ``settings``
    (a text), or every rank raises the same error; ``error``, this rank's refusal, is every rank's.
    One 5-word all-gather (level "entry" and up); under ``torch.compile`` a step of the graph."""
    if mesh.check == "off" or mesh.size == 1:
        if error is not None:
            raise error
        return
    agree(mesh, what, description=", ".join([*(describe(t) for t in tensors), settings]), error=error)


WHOLE = "_optimus2d_is_whole"  # on a tensor whole on every rank, not a block (comm/whole.py's mark_whole)


def refusal(what: str, tensors: list[torch.Tensor], mesh) -> BaseException | None:
    """Why this rank refuses a module's input, found without communicating, or None: a tensor on
    meta (no values), a block of another mesh, an empty input, a floating first input noted whole
    (a model's input declared whole, ``io={name: "whole"}``: on 2×2 its shape is refused, on 1×1×4
    each rank would take the whole batch as its block)."""
    for t in tensors:
        if t.is_meta:
            return TypeError(
                f"{what}: its input {describe(t)} is on the meta device, which holds no values ({mesh}): pass "
                f"real tensors, and materialize a model built on meta first (optimus2d.materialize)"
            )
        other = other_mesh(t, mesh)
        if other is not None:
            return ValueError(
                f"{what}: its input is a block of {other}, not of this module's {mesh}: scatter it on the module's mesh"
            )
    first = tensors[0] if tensors else None
    if first is not None and first.numel() == 0 and first.dim() > 0:
        dim = list(first.shape).index(0)
        return ValueError(f"{what}: input of shape {list(first.shape)} is empty along dim {dim} ({mesh})")
    if first is not None and first.is_floating_point() and mesh.size > 1 and getattr(first, WHOLE, False):
        return ValueError(
            f"{what}: its input of shape {list(first.shape)} is whole, the same on every rank (given to a model "
            f"converted with io='whole' and declared 'whole' there), where it takes this rank's block ({mesh}): "
            f"declare that input io={{name: 'activation'}} or io={{name: 'batch'}}"
        )
    return None


def other_mesh(t: torch.Tensor, mesh) -> str | None:
    """``"Mesh(q=…, depth=…, ranks=[…])"`` where ``t`` is tagged as a block of another layout than
    ``mesh``'s, else None (untagged, or a block of ``mesh``)."""
    given = getattr(t, "_optimus2d_layout", None)
    if given is None or given == layout(mesh):
        return None
    return f"Mesh(q={given[0]}, depth={given[1]}, ranks={list(given[2])})"


def layout(mesh) -> tuple:
    """What makes two meshes' blocks the same blocks: (q, depth, ranks)."""
    return (mesh.q, mesh.depth, mesh.ranks)


def tag(out: object, mesh, agreed: bool) -> None:
    """Mark the tensors of ``out`` as blocks of ``mesh``'s layout (a module on another refuses them)
    and, if ``agreed``, as agreed on every rank at this mesh's latest agreement point (``mesh.calls``:
    a module they enter unchanged, before the next outermost call, lets its check ride beside)."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            t._optimus2d_layout = layout(mesh)
            point = None if torch.compiler.is_compiling() else mesh.calls
            t._optimus2d_agreed = (layout(mesh), point, tuple(t.shape)) if agreed else None


def mark_agreed(tensors: list[torch.Tensor], mesh) -> None:
    """Mark the inputs of the outermost call just agreed as agreed blocks at this point (not as
    blocks of ``mesh``: an attention mask stays what it was), so the next call taking the same
    tensor (k after q, up after gate) is fresh."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            t._optimus2d_agreed = (layout(mesh), mesh.calls, tuple(t.shape))


def _fresh(tensors: list[torch.Tensor], mesh) -> bool:
    """Every tensor is an agreed block of ``mesh`` tagged at its latest agreement point, its shape
    unchanged (while dynamo traces: an agreed block of ``mesh``)."""
    compiling = torch.compiler.is_compiling()
    return len(tensors) > 0 and all(
        (tag := getattr(t, "_optimus2d_agreed", None)) is not None
        and tag[0] == layout(mesh)
        and (compiling or (tag[1] == mesh.calls and tag[2] == tuple(t.shape)))
        for t in tensors
    )
