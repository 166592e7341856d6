"""cross_entropy over logits whose vocabulary is split over the row group."""

from __future__ import annotations

import torch

from optimus2d.comm import all_reduce
from optimus2d.comm import primitives as P
from optimus2d.comm.mesh import Mesh


def cross_entropy(
    logits_local: torch.Tensor,
    target_local: torch.Tensor,
    mesh: Mesh,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits, computed from this rank's block.

    logits_local: ``[b/(d·q), ..., V/q]``, vocabulary block j (this rank's row index), e.g. from a
    ``Linear2D`` head or ``Embedding2D.attend``. Logits of −inf (the padded vocabulary columns of
    ``attend``) take no part: exp(−inf) = 0, and label smoothing averages over the finite logits
    of each row, so padding is invisible to the loss.
    target_local: ``[b/(d·q), ...]`` class indices (``optimus2d.scatter_batch``).

    Returns, on every rank, the global loss (``"mean"``: over the targets that are not
    ``ignore_index``; ``"sum"``) or this rank's block ``[b/(d·q), ...]`` of the per-target losses
    (``"none"``). Sends: a max and a sum all-reduce over the row (3 values a target), and for
    "mean"/"sum" one all-reduce of 3 values over col and depth ("none": of 1); backward sends
    nothing.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction={reduction!r} is not 'mean', 'sum' or 'none'")
    if tuple(target_local.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(
            f"cross_entropy: target of shape {tuple(target_local.shape)} does not match logits "
            f"{tuple(logits_local.shape)} (expected target {tuple(logits_local.shape[:-1])}) on {mesh}"
        )
    if target_local.is_floating_point():
        raise TypeError(f"cross_entropy: targets must be class indices, got {target_local.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")

    logits = logits_local.float()
    per_rank = logits.shape[-1]
    vocab = per_rank * mesh.q
    start = mesh.index("row") * per_rank
    finite = torch.isfinite(logits)

    row_max = logits.detach().amax(-1, keepdim=True)
    P.all_reduce_max(row_max, mesh, "row")
    shifted = logits - row_max
    valid = target_local != ignore_index
    in_block = valid & (target_local >= start) & (target_local < start + per_rank)
    local_target = torch.where(in_block, target_local - start, 0).unsqueeze(-1)
    picked = torch.where(in_block, shifted.gather(-1, local_target).squeeze(-1), 0.0)
    sums = [
        shifted.exp().sum(-1),  # Σ exp over this block
        picked,  # the target's logit, if it is in this block
        torch.where(finite, shifted, 0.0).sum(-1),  # Σ finite logits, for label smoothing
        finite.sum(-1).to(logits.dtype),  # how many finite logits (padded columns are −inf)
    ]
    totals = all_reduce(torch.stack(sums, -1), mesh, ("row",))
    sum_exp, target_logit, sum_logits, classes = totals.unbind(-1)
    # Targets are the same across the row; a bad one is reported on every rank at once (the
    # flag rides on an all-reduce over col and depth), so no rank raises while others wait.
    bad = (valid & ((target_local < 0) | (target_local >= vocab))).any().to(logits.dtype)
    log_z = sum_exp.log()
    nll = log_z - target_logit
    loss = (1 - label_smoothing) * nll + label_smoothing * (log_z - sum_logits / classes)
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        flag = all_reduce(bad.reshape(1), mesh, ("col", "depth"))
        _raise_if(flag[0], vocab, mesh)
        return loss.to(logits_local.dtype)
    total = all_reduce(torch.stack([loss.sum(), valid.sum().to(loss.dtype), bad]), mesh, ("col", "depth"))
    _raise_if(total[2], vocab, mesh)
    result = total[0] / total[1] if reduction == "mean" else total[0]
    return result.to(logits_local.dtype)


def _raise_if(bad: torch.Tensor, vocab: int, mesh: Mesh) -> None:
    if bool(bad > 0):
        raise ValueError(f"cross_entropy: a target class is outside [0, {vocab}) ({mesh})")
