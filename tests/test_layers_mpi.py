"""Norms, attention, embedding, loss and the transformer block against torch.nn, on every mesh."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check_against_serial, step_both
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from optimus2d import count_comm, cross_entropy, gather, scatter, scatter_batch, serial_state_dict
from optimus2d.layers import (
    MLP2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    MultiheadAttention2D,
    RMSNorm2D,
    TransformerBlock2D,
)

pytestmark = pytest.mark.mpi

E, HEADS, SEQ = 12, 6, 5  # divisible by q = 1, 2, 3; odd sequence


def _x(mesh, features=E, seed=1, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.randn(2 * mesh.depth * mesh.q, SEQ, features, dtype=dtype)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layernorm_matches_torch(mesh, bias):
    torch.manual_seed(0)
    serial = nn.LayerNorm(E, eps=1e-6, bias=bias)
    with torch.no_grad():  # not the trivial ones/zeros init
        serial.weight.uniform_(0.5, 1.5)
        if bias:
            serial.bias.uniform_(-0.5, 0.5)
    check_against_serial(serial, LayerNorm2D.from_serial(serial, mesh), _x(mesh) * 3 + 1, mesh)


def test_rmsnorm_matches_torch(mesh):
    torch.manual_seed(0)
    serial = nn.RMSNorm(E)
    with torch.no_grad():
        serial.weight.uniform_(0.5, 1.5)
    check_against_serial(serial, RMSNorm2D.from_serial(serial, mesh), _x(mesh), mesh)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_rmsnorm_default_eps_is_that_of_the_dtype_it_computes_in(mesh, dtype):
    """``eps=None``: torch takes the eps of the dtype it computes in (float32 for bf16 and fp16), not
    the input's (7.8e-3 for bf16, which on small inputs moved outputs by 60 %)."""
    torch.manual_seed(0)
    serial = nn.RMSNorm(E, dtype=dtype)
    x = _x(mesh, dtype=torch.float64).mul(0.05).to(dtype)
    want = serial(x)
    got = gather(RMSNorm2D.from_serial(serial, mesh)(scatter(x, mesh)), mesh)
    assert_close(got, want, 1e-12 if dtype == torch.float64 else 1e-2, "output")


def test_norm_sends_one_collective_each_way(mesh):
    norm = LayerNorm2D(E, mesh=mesh)
    x = scatter(_x(mesh), mesh).requires_grad_()
    with count_comm() as counter:
        norm(x).sum().backward()
    rows = x.shape[0] * x.shape[1]
    row_ops = [(r.kind, r.numel) for r in counter.records if r.axis == "row"]
    expected = [("all_gather", 2 * rows * mesh.q), ("all_reduce", 2 * rows)] if mesh.q > 1 else []
    assert row_ops == expected


@pytest.mark.parametrize("offset", [30.0, 300.0])
def test_layernorm_keeps_precision_with_a_large_mean(mesh, offset):
    torch.manual_seed(0)
    serial = nn.LayerNorm(E)
    check_against_serial(serial, LayerNorm2D.from_serial(serial, mesh), _x(mesh) + offset, mesh, tol=1e-4)


def test_layernorm_in_float64(mesh):
    serial = nn.LayerNorm(E).double()
    check_against_serial(
        serial, LayerNorm2D.from_serial(serial, mesh), _x(mesh, dtype=torch.float64) * 5, mesh, tol=1e-12
    )


class SelfAttention(nn.Module):
    """Calls an attention module as nn.TransformerEncoderLayer does, returning the output only."""

    def __init__(self, attn, **kwargs):
        super().__init__()
        self.attn, self.kwargs = attn, kwargs

    def forward(self, x):
        return self.attn(x, x, x, **self.kwargs)[0]


def _serial_mha(bias=True):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=True)
    with torch.no_grad():
        if bias:
            mha.in_proj_bias.uniform_(-0.5, 0.5)
            mha.out_proj.bias.uniform_(-0.5, 0.5)
    return mha


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_attention_matches_torch(mesh, bias):
    serial = _serial_mha(bias)
    parallel = MultiheadAttention2D.from_serial(serial, mesh)
    check_against_serial(
        SelfAttention(serial, need_weights=False), SelfAttention(parallel, need_weights=False), _x(mesh), mesh
    )


def test_attention_causal_and_padding_masks(mesh):
    serial = _serial_mha()
    parallel = MultiheadAttention2D.from_serial(serial, mesh)
    b = 2 * mesh.depth * mesh.q
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)  # True: may not attend
    padding = torch.zeros(b, SEQ, dtype=torch.bool)
    padding[::2, -2:] = True  # every other sequence ends in two padding tokens
    kwargs = {"attn_mask": causal, "is_causal": True, "key_padding_mask": padding, "need_weights": False}
    check_against_serial(SelfAttention(serial, **kwargs), SelfAttention(parallel, **kwargs), _x(mesh), mesh)
    # a per-head 3-D boolean mask, given whole
    torch.manual_seed(4)
    mask3 = torch.rand(b * HEADS, SEQ, SEQ) < 0.3
    mask3[..., 0] = False  # no row fully masked
    kwargs = {"attn_mask": mask3, "need_weights": False}
    serial = _serial_mha()
    parallel = MultiheadAttention2D.from_serial(serial, mesh)
    check_against_serial(SelfAttention(serial, **kwargs), SelfAttention(parallel, **kwargs), _x(mesh), mesh)


def test_attention_weights_match_torch(mesh):
    serial = _serial_mha()
    parallel = MultiheadAttention2D.from_serial(serial, mesh)
    x = _x(mesh)
    causal = nn.Transformer.generate_square_subsequent_mask(SEQ)
    out_ref, weights_ref = serial(x, x, x, attn_mask=causal, need_weights=True)
    xl = scatter(x, mesh)
    out, weights = parallel(xl, xl, xl, attn_mask=causal, need_weights=True)
    out = gather(out, mesh)
    assert weights.shape == (x.shape[0] // (mesh.depth * mesh.q), SEQ, SEQ)
    assert_close(out, out_ref, what="output")
    assert_close(weights, scatter_batch(weights_ref, mesh), what="weights")


def test_grouped_query_attention_matches_sdpa(mesh):
    """Two kv heads shared by six query heads (LLaMA-style), against torch's own GQA."""
    kv_heads = 3 if mesh.q != 2 else 2
    heads = 6
    hd = E // heads
    torch.manual_seed(0)
    parallel = MultiheadAttention2D(E, heads, num_kv_heads=kv_heads, mesh=mesh)
    state = serial_state_dict(parallel)
    x = _x(mesh)
    w_q, w_k, w_v = state["in_proj_weight"].split([E, kv_heads * hd, kv_heads * hd])

    def reference(x):
        b = x.shape[0]
        q = F.linear(x, w_q).view(b, SEQ, heads, hd).transpose(1, 2)
        k = F.linear(x, w_k).view(b, SEQ, kv_heads, hd).transpose(1, 2)
        v = F.linear(x, w_v).view(b, SEQ, kv_heads, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(out.transpose(1, 2).reshape(b, SEQ, E), state["out_proj.weight"], state["out_proj.bias"])

    x_ref, x_full = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = reference(x_ref)
    ref.square().sum().backward()
    xl = scatter(x_full, mesh)
    out = parallel(xl, xl, xl, need_weights=False, is_causal=True)[0]
    out.square().sum().backward()
    assert_close(gather(out.detach(), mesh), ref, what="GQA output")
    assert_close(x_full.grad, x_ref.grad, what="GQA input grad")


def test_attention_refuses_bad_input(mesh):
    q = mesh.q
    with count_comm() as counter:
        if q > 1:
            with pytest.raises(ValueError, match=rf"num_heads={q + 1} is not divisible by q={q}"):
                MultiheadAttention2D(E * (q + 1), q + 1, mesh=mesh)
        attn = MultiheadAttention2D(E, HEADS, mesh=mesh)
        xl = scatter(_x(mesh), mesh)
        with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 4\) does not fit \[L, S\] = \(5, 5\)"):
            attn(xl, xl, xl, attn_mask=torch.zeros(4, 4))
        with pytest.raises(ValueError, match=r"key_padding_mask of shape \(1, 5\)"):
            attn(xl, xl, xl, key_padding_mask=torch.zeros(1, SEQ, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"query of shape .* must be \[b/\(d·q\), seq, embed_dim/q"):
            attn(xl[..., :1], xl[..., :1], xl[..., :1])
    assert counter.count() == 0


def test_embedding_with_padded_vocabulary_matches_torch(mesh):
    vocab = 13  # divisible by neither 2 nor 3: padded inside
    torch.manual_seed(0)
    serial = nn.Embedding(vocab, E, padding_idx=2)
    parallel = Embedding2D.from_serial(serial, mesh)
    torch.manual_seed(3)
    ids = torch.randint(0, vocab, (2 * mesh.depth * mesh.q, SEQ))
    ids[0, 0] = 2
    y_ref = serial(ids)
    torch.manual_seed(4)
    probe = torch.randn_like(y_ref)
    (y_ref * probe).sum().backward()
    torch.optim.SGD(serial.parameters(), lr=0.1).step()
    y = parallel(scatter_batch(ids, mesh))
    (y * scatter(probe, mesh)).sum().backward()
    torch.optim.SGD(parallel.parameters(), lr=0.1).step()
    y_full, state = gather(y.detach(), mesh), serial_state_dict(parallel)
    assert_close(y_full, y_ref, what="embedding output")
    assert state["weight"].shape == (vocab, E)
    assert_close(state["weight"], serial.weight, what="weight after a step")
    assert torch.equal(state["weight"][2], serial.weight[2])  # padding row: no gradient


def test_embedding_refuses_ids_outside_the_vocabulary(mesh):
    emb = Embedding2D(10, E, mesh=mesh)
    ids = torch.zeros(2 * mesh.depth * mesh.q, SEQ, dtype=torch.long)
    ids[-1, -1] = 10  # only the last batch block holds the bad id
    with pytest.raises(ValueError, match=r"token ids outside \[0, 10\)"):
        emb(scatter_batch(ids, mesh))
    with pytest.raises(TypeError, match="integer token ids"):
        emb(torch.zeros(2, 3))
    for dtype in (torch.uint8, torch.int16, torch.bool):  # torch's embedding refuses them too
        with pytest.raises(TypeError, match=rf"integer token ids .* got {dtype} tensor"):
            emb(scatter_batch(ids, mesh).to(dtype))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smooth"])
def test_cross_entropy_matches_torch(mesh, reduction, smoothing):
    vocab = 6 * mesh.q + 0
    torch.manual_seed(0)
    b = 2 * mesh.depth * mesh.q
    logits = torch.randn(b, SEQ, vocab) * 3
    target = torch.randint(0, vocab, (b, SEQ))
    target[0, :2] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(
        ref_logits.view(-1, vocab), target.view(-1), ignore_index=-100, label_smoothing=smoothing, reduction=reduction
    )
    ref = ref.view(b, SEQ) if reduction == "none" else ref
    torch.manual_seed(5)
    weight = torch.randn_like(ref)
    (ref * weight).sum().backward()

    full = logits.clone().requires_grad_()
    loss = cross_entropy(
        scatter(full, mesh), scatter_batch(target, mesh), mesh, label_smoothing=smoothing, reduction=reduction
    )
    if reduction == "none":
        (loss * scatter_batch(weight, mesh)).sum().backward()
        loss = gather(loss.unsqueeze(-1).expand(-1, -1, mesh.q).contiguous(), mesh)[..., 0]  # hidden-split view
    else:
        (loss * weight).backward()
    assert_close(loss, ref, what="loss")
    assert_close(full.grad, ref_logits.grad, what="logits grad")


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smooth"])
def test_cross_entropy_keeps_for_backward_no_more_than_the_logits(mesh, smoothing):
    """As torch keeps its log-softmax: the logits block in its own dtype, plus a few numbers a target."""
    b, vocab = 2 * mesh.depth * mesh.q, 64 * mesh.q
    logits = scatter(torch.randn(b, SEQ, vocab, dtype=torch.bfloat16), mesh).clone().requires_grad_()
    target = scatter_batch(torch.randint(0, vocab, (b, SEQ)), mesh)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(logits, target, mesh, label_smoothing=smoothing)
    per_target = 32  # a log-sum-exp, a target index, flags (fp32, int64, bools), the smoothing count
    assert sum(kept.values()) <= logits.nbytes + per_target * target.numel(), (sum(kept.values()), logits.nbytes)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def test_tied_head_with_padded_vocabulary_and_loss(mesh):
    vocab = 13
    torch.manual_seed(0)
    serial = nn.Embedding(vocab, E)
    parallel = Embedding2D.from_serial(serial, mesh)
    x, b = _x(mesh), 2 * mesh.depth * mesh.q
    target = torch.randint(0, vocab, (b, SEQ))
    ref = F.cross_entropy((x @ serial.weight.t()).view(-1, vocab), target.view(-1), label_smoothing=0.1)
    ref.backward()
    loss = cross_entropy(parallel.attend(scatter(x, mesh)), scatter_batch(target, mesh), mesh, label_smoothing=0.1)
    loss.backward()
    grad = parallel.weight.grad
    from optimus2d.comm import unshard

    grad_full = unshard(grad, mesh, parallel.shardings["weight"])
    assert_close(loss, ref, what="loss")
    assert_close(grad_full, serial.weight.grad, what="tied weight grad")


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_padded_vocabulary_columns_take_no_part_whatever_the_model_made_of_them(mesh, smoothing):
    """A soft cap after the head (Gemma 2's tanh(x/c)·c) makes the padded columns' −inf finite: with
    ``num_classes`` they are still no class, the loss and the table's gradient the serial ones."""
    vocab, cap = 13, 3.0
    torch.manual_seed(0)
    serial = nn.Embedding(vocab, E)
    parallel = Embedding2D.from_serial(serial, mesh)
    x, b = _x(mesh), 2 * mesh.depth * mesh.q
    target = torch.randint(0, vocab, (b, SEQ))
    logits = torch.tanh((x @ serial.weight.t()) / cap) * cap
    ref = F.cross_entropy(logits.view(-1, vocab), target.view(-1), label_smoothing=smoothing)
    ref.backward()
    capped = torch.tanh(parallel.attend(scatter(x, mesh)) / cap) * cap
    loss = cross_entropy(capped, scatter_batch(target, mesh), mesh, label_smoothing=smoothing, num_classes=vocab)
    loss.backward()
    from optimus2d.comm import unshard

    assert_close(loss, ref, what="loss")
    assert_close(unshard(parallel.weight.grad, mesh, parallel.shardings["weight"]), serial.weight.grad, what="grad")


def test_cross_entropy_refuses_bad_targets(mesh):
    logits = scatter(torch.zeros(2 * mesh.depth * mesh.q, SEQ, 6 * mesh.q), mesh)
    target = torch.zeros(2 * mesh.depth * mesh.q, SEQ, dtype=torch.long)
    with count_comm() as counter:
        with pytest.raises(ValueError, match=r"target of shape \(.*\) does not match logits"):
            cross_entropy(logits, scatter_batch(target, mesh)[:, :-1], mesh)
    assert counter.count() == 0
    with pytest.raises(TypeError, match=r"targets must be class indices, got torch.bool"):  # serial raises too
        cross_entropy(logits, scatter_batch(target, mesh).bool(), mesh)
    with pytest.raises(TypeError, match=r"logits must be floating, got torch.int64"):  # an integer loss, on q > 1
        cross_entropy(logits.long(), scatter_batch(target, mesh), mesh)
    loss = cross_entropy(logits, scatter_batch(target, mesh), mesh)  # int32 targets alike on every mesh
    assert_close(cross_entropy(logits, scatter_batch(target, mesh).int(), mesh), loss, what="int32 targets")
    target[-1, -1] = 6 * mesh.q  # one bad target in the last batch block only
    for reduction in ("mean", "none"):  # raised on every rank, not only where the target is
        with pytest.raises(ValueError, match=r"target class is outside \[0, "):
            cross_entropy(logits, scatter_batch(target, mesh), mesh, reduction=reduction)


def test_cross_entropy_refuses_logits_that_are_not_vocabulary_blocks(mesh):
    """The full logits (gather's, with the full targets), a batch block and another mesh's blocks
    each gave a loss with no error (3.145 for 2.452 where q = 2: serial + log q)."""
    torch.manual_seed(0)
    b, vocab = 2 * mesh.depth * mesh.q, 4 * mesh.q
    serial = nn.Linear(8 * mesh.q, vocab)
    head = Linear2D.from_serial(serial, mesh)
    x, target = torch.randn(b, SEQ, 8 * mesh.q), torch.randint(0, vocab, (b, SEQ))
    logits = head(scatter(x, mesh))
    want = F.cross_entropy(serial(x).flatten(0, 1), target.flatten())
    assert_close(cross_entropy(logits[:, :-1], scatter_batch(target, mesh)[:, :-1], mesh), F.cross_entropy(
        serial(x)[:, :-1].flatten(0, 1), target[:, :-1].flatten()), what="a slice of the blocks")  # fmt: skip
    if mesh.size == 1:
        assert_close(cross_entropy(gather(logits, mesh), target, mesh), want, what="one rank: blocks are whole")
        return
    mine = logits * 1.0 if mesh.index("mesh") == mesh.size - 1 else logits  # one rank's untagged: the same exchange
    assert_close(cross_entropy(mine, scatter_batch(target, mesh), mesh), want, what="one rank's block untagged")
    with pytest.raises(ValueError, match=r"logits float32\[.*\] are the full tensor"):
        cross_entropy(gather(logits, mesh), target, mesh)
    with pytest.raises(ValueError, match=r"logits float32\[.*\] are a batch block"):
        cross_entropy(scatter_batch(serial(x).detach(), mesh), scatter_batch(target, mesh), mesh)
    if mesh.q > 1:  # the tag lost by a slice: the same logits on every rank
        with pytest.raises(ValueError, match=r"every rank passes the same logits"):
            cross_entropy(gather(logits, mesh)[:, :-1], target[:, :-1], mesh)


def test_cross_entropy_refuses_on_every_rank_arguments_one_rank_changes(mesh):
    """One rank's shorter targets or other smoothing sent all-reduces of other sizes: over MPI NaN
    on some ranks, another loss on others, no error. Refused on every rank before any exchange (a
    refusal one rank makes alone: tests/test_disagree_mpi.py, on a mesh of its own)."""
    torch.manual_seed(0)
    b, vocab = 2 * mesh.depth * mesh.q, 6 * mesh.q
    full, classes = torch.randn(b, SEQ, vocab), torch.randint(0, vocab, (b, SEQ))
    logits, target = scatter(full, mesh), scatter_batch(classes, mesh)
    odd = mesh.size > 1 and mesh.index("mesh") == mesh.size - 1
    changes = {
        "shorter": lambda: cross_entropy(logits[:, : SEQ - odd], target[:, : SEQ - odd], mesh),
        "smoothing": lambda: cross_entropy(logits, target, mesh, label_smoothing=0.3 * odd),
        "reduction": lambda: cross_entropy(logits, target, mesh, reduction="none" if odd else "mean"),
        "ignore_index": lambda: cross_entropy(logits, target, mesh, ignore_index=3 if odd else -100),
    }
    for name, call in changes.items():
        if mesh.size == 1:
            call()
            continue
        with count_comm() as counter, pytest.raises(ValueError, match=r"cross_entropy on Mesh.*the ranks disagree"):
            call()
        assert counter.count() == 0, name
    ref = F.cross_entropy(full.view(-1, vocab), classes.view(-1))
    assert_close(cross_entropy(logits, target, mesh), ref, what="loss after the refusals")


@pytest.mark.parametrize("norm_first", [True, False], ids=["prenorm", "postnorm"])
def test_transformer_block_matches_torch(mesh, norm_first):
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(
        E, HEADS, 4 * E, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first
    )
    parallel = TransformerBlock2D.from_serial(serial, mesh)
    assert list(serial_state_dict(parallel)) == list(serial.state_dict())
    causal = nn.Transformer.generate_square_subsequent_mask(SEQ)

    class Causal(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x, src_mask=causal, is_causal=True)

    check_against_serial(Causal(serial), Causal(parallel), _x(mesh), mesh)


def test_transformer_block_in_bf16(mesh):
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(
        E, HEADS, 4 * E, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    parallel = TransformerBlock2D.from_serial(serial, mesh).to(torch.bfloat16)
    x = _x(mesh)
    y = gather(parallel(scatter(x.to(torch.bfloat16), mesh)), mesh)
    assert y.dtype == torch.bfloat16
    assert_close(y.float(), serial(x), tol=3e-2, what="bf16 block output")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_auto = gather(TransformerBlock2D.from_serial(serial, mesh)(scatter(x, mesh)), mesh)
    assert_close(y_auto.float(), serial(x), tol=3e-2, what="autocast block output")


def test_cross_entropy_with_masked_logits(mesh):
    """A real −inf logit (a banned token) in the middle of the vocabulary, as F.cross_entropy sees it."""
    vocab = 4 * mesh.q
    torch.manual_seed(0)
    b = 2 * mesh.depth * mesh.q
    logits = torch.randn(b, SEQ, vocab)
    logits[..., 1] = float("-inf")
    target = torch.randint(2, vocab, (b, SEQ))
    target[0, 0] = vocab - 1
    full = logits.clone().requires_grad_()
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1))
    ref.backward()
    loss = cross_entropy(scatter(full, mesh), scatter_batch(target, mesh), mesh)
    loss.backward()
    assert_close(loss, ref, what="loss")
    assert_close(full.grad, ref_logits.grad, what="logits grad")


def test_embedding_whose_last_block_is_all_padding(mesh):
    vocab = 4  # on q=3: blocks [0, 1], [2, 3], [pad, pad]
    torch.manual_seed(0)
    serial = nn.Embedding(vocab, E)
    parallel = Embedding2D.from_serial(serial, mesh)
    x, b = _x(mesh), 2 * mesh.depth * mesh.q
    ids = torch.randint(0, vocab, (b, SEQ))
    y = gather(parallel(scatter_batch(ids, mesh)), mesh)
    target = torch.randint(0, vocab, (b, SEQ))
    ref = F.cross_entropy((x @ serial.weight.t()).view(-1, vocab), target.view(-1), label_smoothing=0.2)
    loss = cross_entropy(parallel.attend(scatter(x, mesh)), scatter_batch(target, mesh), mesh, label_smoothing=0.2)
    assert_close(y, serial(ids), what="lookup")
    assert_close(loss, ref, what="loss")


@pytest.mark.parametrize("kind", ["kv_same", "all_different"])
def test_cross_attention_matches_torch(mesh, kind):
    serial = _serial_mha()
    parallel = MultiheadAttention2D.from_serial(serial, mesh)
    x, memory, other = _x(mesh, seed=1), _x(mesh, seed=2), _x(mesh, seed=3)
    b = x.shape[0]
    padding = torch.zeros(b, SEQ, dtype=torch.bool)
    padding[1::2, :1] = True
    leaves = [t.clone().requires_grad_() for t in (x, memory, other)]
    value_ref = leaves[1] if kind == "kv_same" else leaves[2]
    out_ref = serial(leaves[0], leaves[1], value_ref, key_padding_mask=padding, need_weights=False)[0]
    torch.manual_seed(9)
    probe = torch.randn_like(out_ref)
    (out_ref * probe).sum().backward()
    full = [t.clone().requires_grad_() for t in (x, memory, other)]
    q_l, k_l, o_l = (scatter(t, mesh) for t in full)
    v_l = k_l if kind == "kv_same" else o_l
    out = parallel(q_l, k_l, v_l, key_padding_mask=padding, need_weights=False)[0]
    (out * scatter(probe, mesh)).sum().backward()
    assert_close(gather(out.detach(), mesh), out_ref, what="output")
    for got, want, name in zip(full, leaves, ("query", "key", "value"), strict=True):
        if want.grad is not None:
            assert_close(got.grad, want.grad, what=f"{name} grad")


def test_attention_weights_backward(mesh):
    serial = _serial_mha()
    parallel = MultiheadAttention2D.from_serial(serial, mesh)
    x = _x(mesh)
    x_ref, x_full = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, weights_ref = serial(x_ref, x_ref, x_ref, need_weights=True)
    torch.manual_seed(8)
    probe_w, probe_o = torch.randn_like(weights_ref), torch.randn_like(out_ref)
    ((weights_ref * probe_w).sum() + (out_ref * probe_o).sum()).backward()
    xl = scatter(x_full, mesh)
    out, weights = parallel(xl, xl, xl, need_weights=True)
    ((weights * scatter_batch(probe_w, mesh)).sum() + (out * scatter(probe_o, mesh)).sum()).backward()
    assert_close(x_full.grad, x_ref.grad, what="input grad through weights and output")
    # per-head weights: this rank's heads of its batch block
    _, per_head = parallel(xl, xl, xl, need_weights=True, average_attn_weights=False)
    heads = HEADS // mesh.q
    assert per_head.shape == (xl.shape[0], heads, SEQ, SEQ)


def test_mlp2d_matches_torch_sequential(mesh):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E))
    parallel = MLP2D.from_serial(serial, mesh)
    assert parallel.fc1.summa == "ab" and parallel.fc2.summa == "abt"
    y, y_ref, dx, dx_ref = step_both(serial, parallel, _x(mesh), mesh)
    state = serial_state_dict(parallel)
    assert_close(y, y_ref, what="output")
    assert_close(dx, dx_ref, what="input grad")
    assert_close(state["fc1.weight"], serial[0].weight, what="fc1 weight")
    assert_close(state["fc2.weight"], serial[2].weight, what="fc2 weight")
    assert_close(state["fc2.bias"], serial[2].bias, what="fc2 bias")


def test_norm_refuses_hidden_not_divisible_by_q(mesh):
    ints = scatter(torch.ones(2 * mesh.depth * mesh.q, SEQ, E, dtype=torch.long), mesh)
    for norm in (LayerNorm2D(E, mesh=mesh), RMSNorm2D(E, mesh=mesh)):  # on q > 1 it gave integers, no error
        with pytest.raises(TypeError, match=r"expects a floating activation block, got torch.int64"):
            norm(ints)
    if mesh.q == 1:
        pytest.skip("every size divides by 1")
    with pytest.raises(ValueError, match=rf"LayerNorm2D: hidden size {E + 1} is not divisible by q={mesh.q}"):
        LayerNorm2D(E + 1, mesh=mesh)
    with pytest.raises(ValueError, match=rf"RMSNorm2D: hidden size {E + 1} is not divisible by q={mesh.q}"):
        RMSNorm2D(E + 1, mesh=mesh)
    with pytest.raises(ValueError, match=rf"embedding_dim={E + 1} is not divisible by q={mesh.q}"):
        Embedding2D(10, E + 1, mesh=mesh)


@pytest.mark.parametrize("features", [(12, 36), (72, 36)], ids=["ab", "abt"])
def test_transposed_linear_with_parts_matches_a_conv1d(mesh, features):
    """A [in, out] weight (GPT-2's Conv1D) with its output in three parts, in both SUMMA forms."""
    from optimus2d.layers import TransposedLinear2D

    fin, fout = features
    torch.manual_seed(0)
    weight, bias = torch.randn(fin, fout), torch.randn(fout)
    serial = nn.Linear(fin, fout)
    with torch.no_grad():
        serial.weight.copy_(weight.t())
        serial.bias.copy_(bias)
    holder = nn.Module()
    holder.weight, holder.bias = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())
    third = fout // 3
    parallel = TransposedLinear2D.from_serial(holder, mesh, parts=(third, third, third))
    assert parallel.summa == ("ab" if fin <= fout else "abt")
    x = _x(mesh, fin)
    y_local = parallel(scatter(x, mesh))  # block j of each part: [q_j, k_j, v_j]
    from optimus2d.comm import Sharding, unshard

    out_sharding = Sharding((("depth", "col"), (), ("row",)), (x.shape[0], SEQ, fout), (third,) * 3, parts_dim=2)
    y = unshard(y_local.detach().contiguous(), mesh, out_sharding)
    assert_close(y, serial(x), what="output")
    state = serial_state_dict(parallel)
    assert torch.equal(state["weight"], weight) and torch.equal(state["bias"], bias)
    holder.weight.requires_grad_(False)
    assert not TransposedLinear2D.from_serial(holder, mesh).weight.requires_grad
    with pytest.raises(ValueError, match=r"parts \(4, 4\) do not add up to out_features=36"):
        TransposedLinear2D(12, 36, parts=(4, 4), mesh=mesh)


def test_a_mesh_of_one_row_runs_torchs_own_kernels_bit_for_bit(mesh):
    """Where q = 1 the hidden dim and the vocabulary are whole: norms, the embedding, a Conv1D-style
    layer and the loss are torch's own ops, with outputs and gradients equal to the last bit (on a
    1×1×d stack the gradients are summed over depth: equal to the whole batch's up to rounding)."""
    if mesh.q != 1:
        pytest.skip("a mesh with q = 1")
    from optimus2d.layers import TransposedLinear2D

    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2 * mesh.depth, SEQ))
    conv = nn.Linear(E, 3 * E)  # stands for Conv1D: a weight stored [in, out]
    conv.weight = nn.Parameter(torch.randn(E, 3 * E))
    serial = nn.ModuleDict(
        {"emb": nn.Embedding(11, E, padding_idx=0), "ln": nn.LayerNorm(E), "rms": nn.RMSNorm(E), "conv": conv}
    )
    parallel = {
        "emb": Embedding2D.from_serial(serial.emb, mesh),
        "ln": LayerNorm2D.from_serial(serial.ln, mesh),
        "rms": RMSNorm2D.from_serial(serial.rms, mesh),
        "conv": TransposedLinear2D.from_serial(serial.conv, mesh),
    }

    def serial_logits(ids):
        h = serial.rms(serial.ln(serial.emb(ids)))
        return torch.addmm(conv.bias, h.flatten(0, 1), conv.weight).view(*ids.shape, -1)  # as Conv1D multiplies

    local_ids = scatter_batch(ids, mesh)
    out = parallel["conv"](parallel["rms"](parallel["ln"](parallel["emb"](local_ids))))
    assert torch.equal(out, serial_logits(local_ids).detach())
    target = torch.randint(0, 3 * E, ids.shape)
    F.cross_entropy(serial_logits(ids).flatten(0, 1), target.flatten()).backward()  # the whole batch
    cross_entropy(out, scatter_batch(target, mesh), mesh).backward()
    for name, module in parallel.items():
        for pname, param in module.named_parameters():
            want = getattr(serial[name], pname).grad
            if mesh.depth == 1:
                assert torch.equal(param.grad, want), f"{name}.{pname}"
            else:  # each depth slice's share, summed over depth: equal up to the order of the sums
                assert_close(param.grad, want, 1e-5, f"{name}.{pname}")


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smooth"])
def test_cross_entropy_in_fp64_computes_in_fp64(mesh, smoothing):
    b, vocab = 2 * mesh.depth * mesh.q, 5 * mesh.q
    torch.manual_seed(0)
    logits = torch.randn(b, SEQ, vocab, dtype=torch.float64) * 4
    target = torch.randint(0, vocab, (b, SEQ))
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), label_smoothing=smoothing)
    ref.backward()
    full = logits.clone().requires_grad_()
    loss = cross_entropy(scatter(full, mesh), scatter_batch(target, mesh), mesh, label_smoothing=smoothing)
    loss.backward()
    assert loss.dtype == torch.float64
    assert_close(loss, ref, 1e-12, "loss")
    assert_close(full.grad, ref_logits.grad, 1e-12, "logits grad")


class _OffMeta(TorchDispatchMode):
    """Every op that makes a tensor off the meta device."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.ops.append(str(func))
        return out


def _subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in {sub, *_subclasses(sub)} if c.__module__.startswith("optimus2d")}


def _public_layer_classes() -> set[type]:
    """Every public ShardedModule class of optimus2d, its families' modules imported first."""
    import importlib
    import pkgutil

    import optimus2d.families
    from optimus2d.layers.base import ShardedModule

    for info in pkgutil.iter_modules(optimus2d.families.__path__, "optimus2d.families."):
        importlib.import_module(info.name)
    return {c for c in _subclasses(ShardedModule) if not c.__name__.startswith("_")}


def test_every_layer_is_built_by_declaring_its_blocks_and_filling_them(mesh):
    """One construction path: each ShardedModule's ``shardings`` is exactly its parameters, each
    parameter's owner is the module that declared it, ``requires_grad`` follows the serial tensor,
    and ``from_serial`` of a serial module on meta allocates nothing (its blocks stay on meta, for
    ``materialize``). Every ShardedModule class optimus2d defines is built here."""
    from optimus2d.convert.positions import PositionsFromInputs2D
    from optimus2d.families import hf
    from optimus2d.families.hf_seq2seq import HeadTable2D, LearnedPositionalEmbedding2D, ScaledEmbedding2D
    from optimus2d.families.vision import PatchConv2D, PositionEmbedding2D
    from optimus2d.layers import Linear2D, TiedHead2D, TransposedLinear2D
    from optimus2d.layers.base import ShardedModule, param_sharding
    from optimus2d.layers.block import TransformerDecoderBlock2D

    class Conv1D(nn.Module):  # transformers' [in, out] weight
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.empty(E, 3 * E)), nn.Parameter(torch.empty(3 * E))

    class OffsetPositions(nn.Embedding):  # OPT's: ids computed from the mask
        def forward(self, attention_mask):
            return super().forward(attention_mask.cumsum(dim=1) + 1)

    def embedding(**attrs):  # BART's, with their attributes
        module = nn.Embedding(10, E)
        module.__dict__.update(attrs)
        return module

    parts = {"parts": (E, E, E)}
    with torch.device("meta"):  # cls: (serial module, from_serial's keywords)
        table = nn.Embedding(10, E)
        serials = {
            Linear2D: (nn.Linear(E, 3 * E), parts),
            TransposedLinear2D: (Conv1D(), parts),
            MultiheadAttention2D: (nn.MultiheadAttention(E, HEADS, batch_first=True), {}),
            Embedding2D: (table, {}),
            TiedHead2D: (nn.Linear(E, 10), {}),
            LayerNorm2D: (nn.LayerNorm(E), {}),
            RMSNorm2D: (nn.RMSNorm(E), {}),
            MLP2D: (nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E)), {}),
            TransformerBlock2D: (nn.TransformerEncoderLayer(E, HEADS, 2 * E, batch_first=True), {}),
            TransformerDecoderBlock2D: (nn.TransformerDecoderLayer(E, HEADS, 2 * E, batch_first=True), {}),
            PatchConv2D: (nn.Conv2d(3, E, 4, stride=4), {}),
            PositionEmbedding2D: (nn.Embedding(10, E), {}),
            HeadTable2D: (nn.Embedding(10, HEADS), {}),
            ScaledEmbedding2D: (embedding(embed_scale=2.0), {}),
            LearnedPositionalEmbedding2D: (embedding(offset=2), {}),
            hf.ScaledEmbedding2D: (table, {}),  # Gemma's: an Embedding2D given this class
            PositionsFromInputs2D: (OffsetPositions(10, E), {}),
        }
    for serial, _ in serials.values():
        next(serial.parameters()).requires_grad_(False)  # a frozen tensor stays frozen
    seen = set()
    for cls, (serial, kw) in serials.items():
        watch = _OffMeta()
        with watch:
            if cls is HeadTable2D:  # built from its serial table: no from_serial
                layer = cls(serial, mesh)
            else:
                layer = cls.from_serial(
                    serial, Embedding2D.from_serial(table, mesh) if cls is TiedHead2D else mesh, **kw
                )
        assert not watch.ops, f"{cls.__name__}.from_serial of a meta module allocates: {watch.ops[:4]}"
        flags = {n: p.requires_grad for n, p in serial.named_parameters()}
        if cls is MLP2D:
            flags = {n.replace("0.", "fc1.").replace("2.", "fc2."): f for n, f in flags.items()}
        assert {n: p.requires_grad for n, p in layer.named_parameters()} == flags, cls.__name__
        for sub in layer.modules():
            if not isinstance(sub, ShardedModule):
                continue
            seen.add(type(sub))
            own = {n: p for n, p in sub.named_parameters(recurse=False)}
            assert set(own) == set(sub.shardings), (
                f"{type(sub).__name__}: declared {set(sub.shardings)}, holds {set(own)}"
            )
            for n, p in own.items():
                assert p.is_meta and tuple(p.shape) == sub.shardings[n].local_shape(mesh), f"{type(sub).__name__}.{n}"
                assert param_sharding(p) is sub.shardings[n] and p._optimus2d_mesh is mesh
    public = _public_layer_classes()
    assert public <= seen, f"not built here: {public - seen}"

    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(E, HEADS, 2 * E, batch_first=True)
    serial.self_attn.out_proj.bias.requires_grad_(False)
    serial.norm2.weight.requires_grad_(False)
    parallel = TransformerBlock2D.from_serial(serial, mesh)  # real tensors: blocks of serial's, flags kept
    assert {n: p.requires_grad for n, p in parallel.named_parameters()} == {
        n: p.requires_grad for n, p in serial.named_parameters()
    }
    assert_close(serial_state_dict(parallel)["linear1.weight"], serial.linear1.weight, 0.0)
