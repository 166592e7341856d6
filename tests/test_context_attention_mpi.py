"""Context-parallel attention on the sequence layout equals torch's attention on the whole sequence.

c = the mesh's depth: Mesh(1, 4) is c = 4 with one rank each, Mesh(2, 2) (8 ranks) c = 2 on a 2×2
mesh, Mesh(1, 9) c = 9, Mesh(q, 1) c = 1. The reference is ``F.scaled_dot_product_attention`` on the
full q, k, v in float64; outputs and the gradients of q, k, v (through ``context.scatter``'s
backward) must match to 1e-10, for the causal, image–text and packed-document masks and for each
split. The bytes sent are the formula's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, context_mask, raises_fast

import optimus2d
from optimus2d import context

pytestmark = pytest.mark.mpi


def _serial(q, k, v, mask, heads):
    b, s, hd = q.shape
    split = lambda t: t.view(b, s, heads, hd // heads).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(b, s, hd)


def _parallel(q, k, v, mesh, a, mask, heads, attention="all_gather"):
    blocks = [context.scatter(t, mesh, a) for t in (q, k, v)]
    b, s_local, hd = blocks[0].shape
    split = lambda t: t.view(b, s_local, heads // mesh.q, hd // (heads // mesh.q)).transpose(1, 2)  # noqa: E731
    out = context.attention(*(split(t) for t in blocks), mesh, a, mask, method=attention)
    return context.gather(out.transpose(1, 2).reshape(b, s_local, hd), mesh, a)


@pytest.mark.parametrize("attention", ["all_gather", "ring"])
@pytest.mark.parametrize("kind", ["causal", "image", "documents"])
@pytest.mark.parametrize("method", ["uniform", "head_tail", "makespan"])
def test_attention_equals_sdpa_on_the_whole_sequence(mesh, kind, method, attention):
    c, heads, d_h = mesh.depth, 2 * mesh.q, 4
    b, s = 2 * mesh.q, 2 * c * 8
    mask = context_mask(kind, s)
    a = context.assign(mask, c, method, block=4 if method == "makespan" else None)
    _compare(mesh, a, mask, heads, (b, s, heads * d_h), attention, weighted=True)


def _compare(mesh, a, mask, heads, shape, attention, weighted):
    """Outputs and the gradients of q, k, v (through ``context.scatter``'s backward) against torch's
    attention on the whole sequence, float64, to 1e-10; ``weighted``: the loss weighs every output."""
    torch.manual_seed(0)
    full = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    weight = torch.randn(*shape, dtype=torch.float64) if weighted else torch.ones(*shape, dtype=torch.float64)
    want = _serial(*full, mask, heads)
    (want * weight).sum().backward()
    grads = [t.grad.clone() for t in full]
    for t in full:
        t.grad = None
    got = _parallel(*full, mesh, a, mask, heads, attention)
    (got * weight).sum().backward()
    assert_close(got, want, 1e-10, "output")
    for name, t, g in zip("qkv", full, grads, strict=True):
        assert_close(t.grad, g, 1e-10, f"d{name}")


def test_the_bytes_are_the_formula(mesh):
    c, heads, d_h, b, s = mesh.depth, 2 * mesh.q, 4, 2 * mesh.q, 2 * mesh.depth * 8
    mask = context.causal_mask(s)
    a = context.assign(mask, c, "head_tail")
    blocks = [torch.randn(b // mesh.q, heads // mesh.q, s // c, d_h, requires_grad=True) for _ in range(3)]
    with optimus2d.count_comm() as counted:
        out = context.attention(*blocks, mesh, a, mask)
        out.sum().backward()
    # count_comm records a gather's output and a reduce-scatter's input: the whole sequence's K and V
    # for this rank's batch and heads; of which each rank receives (c - 1)/c
    kv = 2 * (b // mesh.q) * (heads // mesh.q) * s * d_h
    by_kind = counted.by("kind", "axis")
    assert by_kind.get(("all_gather", "depth"), 0) == (kv if c > 1 else 0)
    assert by_kind.get(("reduce_scatter", "depth"), 0) == (kv if c > 1 else 0)
    assert counted.count() == (4 if c > 1 else 0)
    sent = optimus2d.cost.context_attention(b // mesh.q, heads // mesh.q, s // c, d_h, c)["all_gather"]["sent"]
    assert sent * c == counted.numel * (c - 1)  # each rank sends (c - 1)/c of what is gathered and scattered


@pytest.mark.parametrize("attention", ["all_gather", "ring"])
def test_a_query_that_sees_no_key_gets_what_torch_gives(mesh, attention):
    """Rows of the mask with no True (a padding query): torch's CPU attention gives 0 and no gradient."""
    c, heads, d_h = mesh.depth, 2 * mesh.q, 4
    b, s = 2 * mesh.q, 2 * c * 4
    mask = context.causal_mask(s)
    mask[[0, s // 2, s - 1]] = False
    a = context.assign(context.causal_mask(s), c, "head_tail")
    _compare(mesh, a, mask, heads, (b, s, heads * d_h), attention, weighted=False)


def test_the_rings_bytes_are_the_formula(mesh):
    c, heads, d_h, b, s = mesh.depth, 2 * mesh.q, 4, 2 * mesh.q, 2 * mesh.depth * 8
    mask = context.causal_mask(s)
    a = context.assign(mask, c, "head_tail")
    blocks = [torch.randn(b // mesh.q, heads // mesh.q, s // c, d_h, requires_grad=True) for _ in range(3)]
    with optimus2d.count_comm() as forward:
        out = context.attention(*blocks, mesh, a, mask, method="ring")
    with optimus2d.count_comm() as backward:
        out.sum().backward()
    kv = 2 * blocks[0].numel()  # one K/V block: what each step sends
    # forward: the c - 1 K/V blocks that go on; backward: those again, and c dK/dV blocks (the last one home)
    assert forward.by("kind", "axis").get(("ring", "depth"), 0) == (c - 1) * kv
    assert backward.by("kind", "axis").get(("ring", "depth"), 0) == ((2 * c - 1) * kv if c > 1 else 0)
    assert forward.count() + backward.count() == (3 * c - 2 if c > 1 else 0)
    ring = forward.numel + backward.numel
    assert ring == optimus2d.cost.context_attention(b // mesh.q, heads // mesh.q, s // c, d_h, c)["ring"]["sent"]


def test_positions_are_this_ranks_tokens(mesh):
    s = 2 * mesh.depth * 4
    a = context.assign(context.causal_mask(s), mesh.depth, "head_tail")
    ids = torch.arange(s).expand(2 * mesh.q, s)[..., None].expand(-1, -1, mesh.q).double()
    block = context.scatter(ids, mesh, a)
    assert torch.equal(block[0, :, 0].long(), context.positions(a, mesh))


def test_a_float_batch_tensors_gradient_sums_the_rows_parts(mesh):
    """``context.scatter_batch`` of a float ``[b, s]`` tensor (a per-token weight), replicated over the
    row and multiplied into activation blocks: each rank of the row holds a part of its gradient,
    summed as ``optimus2d.scatter_batch`` sums it (each rank kept its own part: 1.02 / 0.53 off on 2×2)."""
    s = 2 * mesh.depth * 4
    a = context.assign(context.causal_mask(s), mesh.depth, "head_tail")
    torch.manual_seed(0)
    b, h = 2 * mesh.q, 4 * mesh.q
    x, w, probe = torch.randn(b, s, h).double(), torch.randn(b, s).double(), torch.randn(b, s, h).double()
    want = w.clone().requires_grad_()
    ((x * want[..., None]) * probe).sum().backward()
    got = w.clone().requires_grad_()
    y = context.scatter(x, mesh, a) * context.scatter_batch(got, mesh, a)[..., None]
    (context.gather(y, mesh, a) * probe).sum().backward()
    assert_close(got.grad, want.grad, 1e-12, "the weight's gradient")


def test_refusals_name_the_sizes(mesh):
    s = 2 * mesh.depth * 4
    other = context.assign(context.causal_mask(s), 2 * mesh.depth, "uniform")
    with pytest.raises(ValueError, match=rf"over c = {2 * mesh.depth} ranks, but the mesh's depth .* is {mesh.depth}"):
        context.scatter(torch.zeros(mesh.q, s, mesh.q), mesh, other)
    a = context.assign(context.causal_mask(s), mesh.depth, "head_tail")
    with pytest.raises(ValueError, match=rf"covers {s} tokens, the sequence has {2 * s}"):
        context.scatter(torch.zeros(mesh.q, 2 * s, mesh.q), mesh, a)
    q = torch.zeros(1, 1, s // mesh.depth + 1, 4)
    with pytest.raises(ValueError, match=r"q of shape .* must be \[b/q, heads/q, s/c"):
        context.attention(q, q, q, mesh, a, context.causal_mask(s))


def test_a_sequence_block_is_refused_by_the_batch_layouts_gather(mesh):
    if mesh.size == 1:
        pytest.skip("one rank: every tensor is its own block")
    s = 2 * mesh.depth * 4
    a = context.assign(context.causal_mask(s), mesh.depth, "head_tail")
    block = context.scatter(torch.randn(mesh.q, s, 2 * mesh.q), mesh, a)
    with pytest.raises(ValueError, match=r"is a sequence block .*gather it with optimus2d.context.gather"):
        optimus2d.gather(block, mesh)


def test_a_mask_that_differs_on_one_rank_is_refused_on_every_rank(world, mesh):
    if mesh.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    s = 2 * mesh.depth * 4
    mask = context.causal_mask(s)
    a = context.assign(mask, mesh.depth, "head_tail")
    if world.rank == world.size - 1:
        mask = mask.clone()
        mask[3, 1] = False  # one pair masked out on one rank: its queries would see other keys
    q = torch.randn(1, 1, s // mesh.depth, 4)
    message = raises_fast(
        ValueError,
        r"context.attention on Mesh.*hold different values",
        lambda: context.attention(q, q, q, mesh, a, mask),
    )
    assert "mask bool" in message


def test_the_mask_is_agreed_once_per_assignment(mesh):
    s = 2 * mesh.depth * 4
    mask = context.causal_mask(s)
    a = context.assign(mask, mesh.depth, "head_tail")
    q = torch.randn(1, 1, s // mesh.depth, 4)
    with optimus2d.count_comm() as counted:
        for _ in range(3):  # three layers
            context.attention(q, q, q, mesh, a, mask)
    assert len(counted.checks) == (1 if mesh.size > 1 else 0)


def test_a_query_stored_transposed_gives_the_same_attention_by_either_method(mesh):
    """A query whose last dim is not stride-1 (stored ``[.., d_h, n]``): torch's CPU flash kernel,
    called as an operator by the ring, read it as if contiguous (2.5e306 off). The ring takes it
    contiguous; both methods give SDPA's output and gradients."""
    s, heads, d_h = 2 * mesh.depth * 4, 2 * mesh.q, 4
    mask = context.causal_mask(s)
    a = context.assign(mask, mesh.depth, "head_tail")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, heads // mesh.q, s // mesh.depth, d_h, dtype=torch.float64) for _ in range(3))
    want = None
    for method in ("all_gather", "ring"):
        stored = q.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()  # same values, stride(-1) != 1
        assert stored.stride(-1) != 1
        out = context.attention(stored, k, v, mesh, a, mask, method=method)
        out.sum().backward()
        plain = q.clone().requires_grad_()
        ref = context.attention(plain, k, v, mesh, a, mask, method=method)
        ref.sum().backward()
        assert_close(out, ref, 1e-12, f"{method} output")
        assert_close(stored.grad, plain.grad, 1e-12, f"{method} dq")
        want = ref if want is None else want
        assert_close(out, want, 1e-10, "ring against all_gather")


def test_a_method_that_differs_on_one_rank_is_refused_on_every_rank(world, mesh):
    """The method is part of what is agreed: ring on one rank and all_gather on the others sent
    unlike messages and waited to the timeout."""
    if mesh.depth == 1:
        pytest.skip("one context rank: the methods send nothing")
    s = 2 * mesh.depth * 4
    mask = context.causal_mask(s)
    a = context.assign(mask, mesh.depth, "uniform")
    q = torch.randn(1, 1, s // mesh.depth, 4)
    method = "ring" if world.rank == world.size - 1 else "all_gather"
    message = raises_fast(
        ValueError,
        r"context.attention on Mesh.*the ranks disagree.*method 'ring'",
        lambda: context.attention(q, q, q, mesh, a, mask, method=method),
    )
    assert "method" in message


@pytest.mark.parametrize("odd", ["length", "batch", "scatter"])
def test_one_ranks_other_sizes_are_refused_on_every_rank(world, mesh, odd):
    """One rank's q/k/v a token shorter (its own refusal), of another batch (over MPI the ring's step
    filled part of its buffer: 0.38 off, no error), or its full sequence shorter for ``scatter``: the
    others waited to the timeout, or one returned a wrong output. Refused on every rank at once."""
    if mesh.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    s = 2 * mesh.depth * 4
    mask = context.causal_mask(s)
    a = context.assign(mask, mesh.depth, "head_tail")
    last = world.rank == world.size - 1
    if odd == "scatter":
        x = torch.zeros(mesh.q, s - (2 * mesh.depth if last else 0), 4 * mesh.q)
        raises_fast(ValueError, r"scatter_sequence on Mesh.*rank \d+ refused it", lambda: context.scatter(x, mesh, a))
        return
    q = torch.randn(2 if last and odd == "batch" else 1, 1, s // mesh.depth - (last and odd == "length"), 4)
    message = {"length": r"rank \d+ refused it: ValueError: attention: q of shape", "batch": "the ranks disagree"}[odd]
    for method in ("all_gather", "ring"):
        raises_fast(ValueError, rf"context.attention on Mesh.*{message}",
                    lambda m=method: context.attention(q, q, q, mesh, a, mask, method=m))  # fmt: skip
