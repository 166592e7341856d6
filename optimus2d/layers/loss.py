"""cross_entropy over logits whose vocabulary is split over the row group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function

from optimus2d.comm import all_reduce
from optimus2d.comm import primitives as P
from optimus2d.comm.agreement import agree_distinct, describe
from optimus2d.comm.calls import check_function_call, layout, other_mesh
from optimus2d.comm.first_order import first_order
from optimus2d.comm.functional import grad_alike
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.traced import refuse_if
from optimus2d.layers.base import compute_dtype


def cross_entropy(
    logits_local: torch.Tensor,
    target_local: torch.Tensor,
    mesh: Mesh,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    num_classes: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits, computed from this rank's block.

    logits_local: ``[b/(d·q), ..., V/q]``, vocabulary block j (this rank's row index), e.g. from a
    ``Linear2D`` head or ``Embedding2D.attend``. Logits of −inf (the padded vocabulary columns of
    ``attend``) take no part: exp(−inf) = 0, and label smoothing averages over the finite logits
    of each row, so padding is invisible to the loss. With ``num_classes``, the columns past it are
    set to −inf here whatever they hold (a soft cap after the head makes −inf finite).
    target_local: ``[b/(d·q), ...]`` class indices (``optimus2d.scatter_batch``).
    num_classes: the real vocabulary ``V`` where the last block is padded (``Embedding2D.attend``,
    ``V`` not divisible by q): a target in ``[V, q·⌈V/q⌉)`` is refused like any other target
    outside the vocabulary (default: every column of the logits is a class).

    Returns, on every rank, the global loss (``"mean"``: over the targets that are not
    ``ignore_index``; ``"sum"``) or this rank's block ``[b/(d·q), ...]`` of the per-target losses
    (``"none"``: a batch block, the same on the q ranks of a row, each of which takes its whole
    gradient, as a loss computed alike from it gives; moved by ``redistribute``, ``to_whole`` or a
    boundary, still so: ``grad_alike``; not a tensor computed from it, which a boundary moves as any
    batch block: move the losses, then weigh them). Sends: a max and a sum all-reduce over the row
    (1 and 2 values a target, 4 with label smoothing; and a flag), and for "mean"/"sum" one
    all-reduce of 3 values over col and depth ("none": of 1); backward sends nothing. Before them
    (check "entry" and up), the ranks agree on the shapes, dtypes and arguments, or every rank raises
    the same error; logits tagged as full (``gather``'s), as a batch block or as another mesh's blocks
    are refused, and where q > 1 so are untagged logits that are the same on every rank (the full
    logits sliced: their first row's block is compared, in the same exchange).
    Keeps for backward the logits (their dtype) and a log-sum-exp a target. Where the vocabulary is
    whole (q = 1) and there is no smoothing, the loss is torch's ``F.cross_entropy`` (and its kernels).
    """
    per_rank = logits_local.shape[-1]
    error, vocab = None, per_rank * mesh.q
    try:
        _check_arguments(logits_local, target_local, mesh, label_smoothing, reduction)
        vocab = _vocabulary(per_rank, mesh, num_classes)
    except (ValueError, TypeError) as err:
        error = err
    # The ranks' shapes and arguments agree first (one 5-word all-gather): a rank whose targets are
    # shorter or whose smoothing differs sent an all-reduce of another size (over MPI: NaN, no error).
    settings = (ignore_index, float(label_smoothing), reduction, num_classes)
    if error is None:
        error = _logits_refusal(logits_local, mesh)
    _check_call(mesh, logits_local, target_local, f"{settings!r}", error)
    start = mesh.index("row") * per_rank
    valid = target_local != ignore_index
    # A bad target is reported on every rank at once (its flag rides on the all-reduces over the
    # row, then col and depth), so no rank raises while others wait: not even where one rank's
    # targets differ from its row's (edited after scatter_batch: two ranks raised, two waited).
    bad = valid & ((target_local < 0) | (target_local >= vocab))
    if mesh.q == 1 and label_smoothing == 0.0:  # the vocabulary is whole: torch's own kernels
        # a bad target must not reach a CUDA kernel; int32 targets taken as on q > 1 (torch's kernel takes int64)
        safe = torch.where(bad, ignore_index, target_local).reshape(-1).long()
        flat = logits_local.reshape(-1, per_rank)
        if mesh.size == 1:  # one rank: torch's cross_entropy as it is, after the same check
            loss = F.cross_entropy(flat, safe, ignore_index=ignore_index, reduction=reduction)
            _raise_if(bad.any(), vocab, mesh)
            return _per_target(loss.view(target_local.shape), mesh) if reduction == "none" else loss
        loss = F.cross_entropy(flat, safe, ignore_index=ignore_index, reduction="none")
        loss = loss.view(target_local.shape).to(compute_dtype(logits_local))
    else:
        if start + per_rank > vocab:  # this block holds padded columns: no class, whatever the model made of them
            padded = torch.arange(start, start + per_rank, device=logits_local.device) >= vocab
            logits_local = logits_local.masked_fill(padded, float("-inf"))
        loss, bad = _split_vocab_loss(logits_local, target_local, valid, bad, start, mesh, label_smoothing)
    loss = _reduced_loss(torch.where(valid, loss, 0.0), valid, bad, reduction, vocab, mesh).to(logits_local.dtype)
    return _per_target(loss, mesh) if reduction == "none" else loss


def _logits_refusal(logits: torch.Tensor, mesh: Mesh) -> BaseException | None:
    """Why this rank's ``logits`` are not a vocabulary block of ``mesh``, by their tags: full ones
    (``gather``'s output) and blocks of another mesh or of the batch gave a wrong loss, no error."""
    if mesh.size == 1:
        return None
    other = other_mesh(logits, mesh)
    if getattr(logits, "_optimus2d_full", False) or other is not None:
        what = f"a block of {other}" if other is not None else "the full tensor (gather's output, or scatter's input)"
        return ValueError(
            f"cross_entropy: its logits {describe(logits)} are {what}, not this rank's vocabulary block on {mesh}"
        )
    if getattr(logits, "_optimus2d_kind", None) == "batch":
        return ValueError(
            f"cross_entropy: its logits {describe(logits)} are a batch block (scatter_batch), whole along the "
            f"vocabulary, not this rank's vocabulary block on {mesh}"
        )
    return None


def _check_call(mesh: Mesh, logits: torch.Tensor, target: torch.Tensor, settings: str, error) -> None:
    """``check_function_call``, where q > 1 also asking whether every rank passes the same logits
    (their first row's block, not constant): the full logits, whose tag a slice dropped
    (``gather(...)[:, :-1]``), made each rank take the whole vocabulary for its block."""
    if mesh.q == 1 or mesh.check == "off" or torch.compiler.is_compiling():  # alike on every rank
        check_function_call(mesh, "cross_entropy", (logits, target), settings, error)
        return
    # one exchange of one size on every rank, whatever its tag (a rank that alone passed logits * 1.0
    # sent a word more than its peers); a tagged or empty block sends no checksum
    untagged = getattr(logits, "_optimus2d_layout", None) != layout(mesh)
    first = logits[(0,) * (logits.dim() - 1)].detach() if untagged and error is None and logits.numel() else None
    if agree_distinct(mesh, "cross_entropy", ", ".join([describe(logits), describe(target), settings]), error, first):
        raise ValueError(
            f"cross_entropy on {mesh}: every rank passes the same logits {describe(logits)} (not constant): the "
            f"full logits, where each rank's vocabulary block is due (a model's output, not gather's); "
            f"F.cross_entropy takes the full ones"
        )


def _per_target(loss: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The per-target losses ``[b/(d·q), ...]``, the same on the row: moved as a batch block, each
    rank of the row taking the whole gradient (``grad_alike``)."""
    loss._optimus2d_kind = "batch"
    return grad_alike(loss, mesh, ("row",))


def _check_arguments(
    logits_local: torch.Tensor, target_local: torch.Tensor, mesh: Mesh, label_smoothing: float, reduction: str
) -> None:
    """Refuse a reduction, target shape or dtype, or label smoothing that ``cross_entropy`` does not take."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction={reduction!r} is not 'mean', 'sum' or 'none'")
    if tuple(target_local.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(
            f"cross_entropy: target of shape {tuple(target_local.shape)} does not match logits "
            f"{tuple(logits_local.shape)} (expected target {tuple(logits_local.shape[:-1])}) on {mesh}"
        )
    if target_local.is_floating_point() or target_local.is_complex() or target_local.dtype == torch.bool:
        raise TypeError(f"cross_entropy: targets must be class indices, got {target_local.dtype}")
    if not logits_local.is_floating_point():  # int64 logits gave an integer loss on q > 1
        raise TypeError(f"cross_entropy: logits must be floating, got {logits_local.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")


def _vocabulary(per_rank: int, mesh: Mesh, num_classes: int | None) -> int:
    """The number of classes: ``num_classes``, checked to fit blocks ``per_rank`` wide, else every column."""
    vocab = per_rank * mesh.q
    if num_classes is not None:
        low = (per_rank - 1) * mesh.q + 1  # the vocabularies whose blocks are per_rank wide
        if not low <= num_classes <= vocab:
            raise ValueError(
                f"cross_entropy: num_classes={num_classes} does not fit logits whose last dim is {per_rank} "
                f"(a vocabulary of {low}..{vocab} split over q={mesh.q}) on {mesh}"
            )
        vocab = num_classes
    return vocab


def _split_vocab_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    valid: torch.Tensor,
    bad: torch.Tensor,
    start: int,
    mesh: Mesh,
    smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's loss from this rank's vocabulary block, which starts at class ``start``, and
    how many of the row's ranks hold a bad target."""
    in_block = valid & (target >= start) & (target < start + logits.shape[-1])
    local_target = torch.where(in_block, target - start, 0)
    return _SplitVocabCrossEntropy.apply(logits, local_target, in_block, bad.any(), mesh, smoothing)


def _reduced_loss(
    loss: torch.Tensor, valid: torch.Tensor, bad: torch.Tensor, reduction: str, vocab: int, mesh: Mesh
) -> torch.Tensor:
    """The per-target losses, or their sum or mean over the mesh, once every rank knows of any bad target."""
    bad = bad.any().to(loss.dtype)
    if reduction == "none":
        flag = all_reduce(bad.reshape(1), mesh, ("col", "depth"))
        _raise_if(flag[0], vocab, mesh)
        return loss
    total = all_reduce(torch.stack([loss.sum(), valid.sum().to(loss.dtype), bad]), mesh, ("col", "depth"))
    _raise_if(total[2], vocab, mesh)
    return total[0] / total[1] if reduction == "mean" else total[0]


class _SplitVocabCrossEntropy(Function):
    """The loss of each target from this rank's vocabulary block, in fp32 (fp64 for fp64 logits).

    forward: a max all-reduce over the row, then one of [Σ exp, the target's logit] per target
    (with label smoothing also [Σ finite logits, how many]) and of the bad-target flag. Saves the
    logits as they came (their dtype: what torch's own cross_entropy keeps, its log-softmax) and a
    log-sum-exp a target.
    backward: the softmax recomputed from them, less the target's one-hot; sends nothing.
    """

    @staticmethod
    def forward(ctx, logits, local_target, in_block, bad, mesh: Mesh, smoothing: float):
        row_max = logits.detach().amax(-1, keepdim=True).to(compute_dtype(logits))
        P.all_reduce_max(row_max, mesh, "row")
        shifted = logits.to(row_max.dtype) - row_max  # a new tensor: the logits stay as saved
        picked = torch.where(in_block, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        sums = [None, picked]
        if smoothing:
            finite = torch.isfinite(logits)  # padded vocabulary columns are −inf
            sums += [torch.where(finite, shifted, 0.0).sum(-1), finite.sum(-1).to(shifted.dtype)]
        sums[0] = shifted.exp_().sum(-1)
        totals = torch.stack(sums, -1)
        flat = torch.cat([totals.reshape(-1), bad.to(totals.dtype).reshape(1)])
        P.all_reduce(flat, mesh, "row")
        totals, bad = flat[:-1].view(totals.shape), flat[-1]
        log_sum_exp = totals[..., 0].log()
        loss = log_sum_exp - totals[..., 1]
        classes = None
        if smoothing:
            classes = totals[..., 3]
            loss = (1 - smoothing) * loss + smoothing * (log_sum_exp - totals[..., 2] / classes)
        ctx.save_for_backward(logits, log_sum_exp + row_max.squeeze(-1), local_target, in_block, classes)
        ctx.smoothing = smoothing
        ctx.mark_non_differentiable(bad)
        return loss, bad

    @staticmethod
    @first_order
    def backward(ctx, grad_loss, _grad_bad):
        logits, log_z, local_target, in_block, classes = ctx.saved_tensors
        grad = logits.to(log_z.dtype, copy=True).sub_(log_z.unsqueeze(-1)).exp_()  # softmax
        eps = ctx.smoothing
        if eps:
            grad.sub_(torch.isfinite(logits).to(grad.dtype).mul_((eps / classes).unsqueeze(-1)))
        grad.scatter_add_(-1, local_target.unsqueeze(-1), in_block.to(grad.dtype).mul_(eps - 1).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(logits.dtype), None, None, None, None, None


def _raise_if(bad: torch.Tensor, vocab: int, mesh: Mesh) -> None:
    """Raise, on every rank alike (``bad``, a count or flag, is the same everywhere), when a target
    class is outside the vocabulary. Under ``torch.compile`` the check is a step of
    the graph (``optimus2d::refuse_if``, the same error when it runs), not a value read on the host."""
    if torch.compiler.is_compiling():
        refuse_if(bad, f"ValueError: {_outside(vocab, mesh)}")
    elif bool(bad > 0):
        raise ValueError(_outside(vocab, mesh))


@torch.compiler.assume_constant_result  # under torch.compile: a constant of the graph, made while tracing
def _outside(vocab: int, mesh: Mesh) -> str:
    return f"cross_entropy: a target class is outside [0, {vocab}) ({mesh})"
