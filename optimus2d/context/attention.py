"""Attention across sequence shards: each depth slice holds its tokens' queries, gathers the keys.

The sequence layout (``optimus2d.comm.sequence``) splits the sequence over the mesh's depth axis:
c = depth context-parallel ranks, each holding the tokens ``assignment.positions[k]`` (k its depth
index) of its batch block (col) and hidden block (row); after the reshape into heads, its heads.

``attention(q, k, v, mesh, assignment, mask)`` with ``q, k, v`` of shape ``[b/q, heads/q, s/c,
d_h]``: forward, all-gather of K and V over depth (``[b/q, heads/q, s, d_h]``, in rank order =
``assignment.permutation()``), then ``scaled_dot_product_attention`` of this rank's queries against
every key under the rows of ``mask`` this rank's queries own (columns permuted alike); backward,
torch's attention backward and a reduce-scatter of dK and dV over depth. Exact: each query sees the
same keys under the same mask entries as serially, in another order (a softmax over a set).

Per rank and layer, forward, it receives 2·(c − 1)/c·(b/q)·s·(h/q) elements (K and V) and sends
as much back in the backward; it holds K and V of the whole sequence for its heads during the
product, and the scores of its queries against them. ``method="ring"`` passes K/V blocks round the
depth ring instead (``context/ring.py``): more bytes in backward, a block at a time in memory;
``optimus2d.cost.context_attention`` counts both.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from optimus2d.comm import Mesh, all_gather
from optimus2d.comm.agreement import agree, check_replicated, describe, fingerprint
from optimus2d.comm.sequence import gather_sequence, scatter_sequence, scatter_sequence_batch
from optimus2d.context.balance import Assignment
from optimus2d.context.ring import ring_attention

ATTENTION_METHODS = ("all_gather", "ring")


def scatter(x: torch.Tensor, mesh: Mesh, assignment: Assignment, *, check: bool | None = None) -> torch.Tensor:
    """Full ``[b, s, ..., h]`` (the same on every rank) → ``[b/q, s/c, ..., h/q]``: this rank's batch
    and hidden blocks of the tokens ``assignment.positions[k]``, k = its depth index (c = depth).

    forward: a permutation of the sequence and a local slice; backward: all-gather and the inverse
    permutation. Token ids, labels and position ids (``positions``) follow the same assignment.
    """
    s = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() > 1 else None
    _check_assignment("scatter", assignment, mesh, s, x, "scatter_sequence", check)
    return scatter_sequence(x[:, assignment.permutation()], mesh, check=check)


def scatter_batch(t: torch.Tensor, mesh: Mesh, assignment: Assignment, *, check: bool | None = None) -> torch.Tensor:
    """Full ``[b, s, ...]`` (token ids, targets) → ``[b/q, s/c, ...]``: this rank's batch block of the
    tokens ``assignment.positions[k]``, whole over row. It only permutes and slices: shift the targets
    yourself, in sequence order, before calling it (``targets[:, t] = ids[:, t + 1]``, the last
    position ``ignore_index``), as the permutation separates neighbours."""
    s = t.shape[1] if isinstance(t, torch.Tensor) and t.dim() > 1 else None
    _check_assignment("scatter_batch", assignment, mesh, s, t, "scatter_sequence_batch", check)
    return scatter_sequence_batch(t[:, assignment.permutation()], mesh, check=check)


def gather(x_local: torch.Tensor, mesh: Mesh, assignment: Assignment) -> torch.Tensor:
    """Block ``[b/q, s/c, ..., h/q]`` → the full ``[b, s, ..., h]`` on every rank, in sequence order."""
    _check_assignment("gather", assignment, mesh, None)
    permuted = gather_sequence(x_local, mesh)
    return permuted[:, torch.argsort(assignment.permutation())]


def positions(assignment: Assignment, mesh: Mesh) -> torch.Tensor:
    """The token positions this rank holds (``[s/c]``, ascending): its position ids for RoPE or a
    learned table."""
    _check_assignment("positions", assignment, mesh, None)
    return assignment.positions[mesh.index("depth")]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: Mesh,
    assignment: Assignment,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    check: bool | None = None,
    method: str = "all_gather",
    cache: dict | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries ``[b/q, heads/q, s/c, d_h]`` against the whole sequence's
    keys and values (gathered over depth), under ``mask`` (``[s, s]`` bool, True: attends; in
    sequence order, as ``assignment`` was made from). Returns ``[b/q, heads/q, s/c, d_h]``.

    forward: all-gather K and V over depth; backward: reduce-scatter dK and dV over depth.
    ``method="ring"``: forward, K/V blocks passed round the depth ring (c − 1 steps); backward,
    K/V and dK/dV round it again (``context/ring.py``).
    ``check``: agree on every rank that ``mask`` and ``assignment`` are the same (checksums of both,
    one 5-word all-gather the first time this mask meets this permutation on this mesh; default:
    unless the mesh's check is "off"): ranks that attend under other masks would be silently wrong.
    """
    error = None
    try:  # this rank's refusal, said in the agreement below: every rank raises it (the others waited)
        _check_attention(q, k, v, mesh, assignment, mask, method)
    except (ValueError, TypeError) as err:
        error = err
    _agree_once(mesh, assignment, mask, check, method, (q, k, v), error)
    mine = assignment.positions[mesh.index("depth")]
    if method == "ring":
        rows = mask.to(q.device)[mine]
        blocks = [rows[:, p.to(q.device)] for p in assignment.positions]
        return ring_attention(q, k, v, mesh, blocks, scale)
    keys = all_gather(k.contiguous(), mesh, "depth", 2)
    values = all_gather(v.contiguous(), mesh, "depth", 2)
    if mesh.depth == 1 and _causal_in_order(mask, assignment):
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
    key = (id(mask), id(assignment), mesh.index("depth"), q.dtype, q.device)
    bias = cache.get(key) if cache is not None else None
    if bias is None:
        rows = mask.to(q.device)[mine][:, assignment.permutation().to(q.device)]
        bias = torch.zeros(rows.shape, dtype=q.dtype, device=q.device).masked_fill_(~rows, float("-inf"))
        if cache is not None:
            cache[key] = bias
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)


def _causal_in_order(mask: torch.Tensor, assignment: Assignment) -> bool:
    """``mask`` is the causal mask and the assignment keeps the sequence order (known once per mask)."""
    version, known = mask.__dict__.get("_optimus2d_causal", (None, None))
    if version != mask._version:  # first seen, or changed in place since
        known = bool(torch.equal(mask, torch.ones_like(mask).tril()))
        mask.__dict__["_optimus2d_causal"] = (mask._version, known)
    s = mask.shape[0]
    return known and torch.equal(assignment.permutation(), torch.arange(s))


def _check_attention(q, k, v, mesh: Mesh, assignment: Assignment, mask: torch.Tensor, method: str) -> None:
    s = mask.shape[0] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    _check_assignment("attention", assignment, mesh, s)
    if mask.dtype != torch.bool or mask.shape != (s, s):
        raise ValueError(f"attention: the mask must be a square boolean [s, s], got {mask.dtype}{list(mask.shape)}")
    mine = assignment.positions[mesh.index("depth")]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[2] != mine.numel():
            raise ValueError(
                f"attention: {name} of shape {tuple(t.shape)} must be [b/q, heads/q, s/c = {mine.numel()}, d_h] "
                f"on {mesh} (c = depth = {mesh.depth}, s = {s})"
            )
    if method not in ATTENTION_METHODS:
        raise ValueError(f"attention: method {method!r} is not one of {ATTENTION_METHODS}")


def _agree_once(
    mesh: Mesh, assignment: Assignment, mask: torch.Tensor, check: bool | None, method: str, qkv: tuple, error
) -> None:
    """The mask, the assignment, the method and the shapes of q, k, v are the same on every rank of
    ``mesh``, and no rank refused them (``error``): agreed once per mask, assignment, method, shapes
    and mesh (a model's layers share them), on checksums of the mask's bits (packed eight to a byte)
    and of the permutation (ranks of two methods sent unlike messages; over MPI a ring step of another
    batch filled part of its buffer: a wrong output, no error)."""
    if check is False or (check is None and mesh.check == "off") or mesh.size == 1 or torch.compiler.is_compiling():
        if error is not None:
            raise error
        return
    shapes = ", ".join(f"{name} {describe(t)}" for name, t in zip("qkv", qkv, strict=True))
    if error is not None:
        agree(mesh, "context.attention", description=shapes, error=error)
    seen = mask.__dict__.setdefault("_optimus2d_agreed_with", set())  # {(mesh uid, the permutation's bytes)}
    perm = assignment.permutation().numpy().tobytes()
    key = (mesh.uid, mask._version, perm, method, tuple(tuple(t.shape) for t in qkv), qkv[0].dtype)  # changed: again
    if key in seen:
        return
    flat = mask.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 64)]).view(-1, 8).to(torch.uint8)
    packed = (flat << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8).view(torch.int64)
    words = [*fingerprint(packed), *fingerprint(assignment.permutation())]
    content = (words[0] ^ words[2], words[1] ^ (words[3] * 3 % 2**63) ^ ATTENTION_METHODS.index(method))
    agree(
        mesh,
        "context.attention",
        description=f"mask bool{list(mask.shape)}, {assignment.method} split, method {method!r}, {shapes}",
        content=content,
    )
    seen.add(key)


def _check_assignment(
    what: str, assignment: Assignment, mesh: Mesh, s: int | None, x=None, split: str = "", check=None
) -> None:
    """Refuse an assignment that does not fit; with ``x`` (a full input about to be split by
    ``split``), in the agreement that split holds, so that every rank raises (the others waited in it)."""
    try:
        _refuse_assignment(what, assignment, mesh, s)
    except (ValueError, TypeError) as err:
        if x is None:
            raise
        check_replicated(mesh, split, x, functools.partial(_raise, err), check)
        raise


def _raise(error: BaseException) -> None:
    raise error


def _refuse_assignment(what: str, assignment: Assignment, mesh: Mesh, s: int | None) -> None:
    if not isinstance(assignment, Assignment):
        raise TypeError(f"{what}: assignment must be an optimus2d.context.Assignment, got {type(assignment).__name__}")
    if len(assignment.positions) != mesh.depth:
        raise ValueError(
            f"{what}: the assignment splits the sequence over c = {len(assignment.positions)} ranks, but the "
            f"mesh's depth (its context-parallel size) is {mesh.depth} ({mesh})"
        )
    total = sum(p.numel() for p in assignment.positions)
    if s is not None and total != s:
        raise ValueError(f"{what}: the assignment covers {total} tokens, the sequence has {s} ({mesh})")
