"""The forward reader judges what runs: decorators that only wrap, dead branches, dropout, reductions
over masks and per-head ops are kept and exact; whatever mixes the split hidden dim is refused,
however it is written (a method, a function, a decorator, a helper, a view, an index)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_grads_like_serial, check_against_serial
from torch import nn

import optimus2d
from optimus2d import gather, parallelize, scatter, scatter_batch

pytestmark = pytest.mark.mpi
E, FF = 12, 24

transformers = pytest.importorskip("transformers")
from transformers.utils.deprecation import deprecate_kwarg  # noqa: E402
from transformers.utils.generic import can_return_tuple  # noqa: E402


def _x(mesh, h=E):
    torch.manual_seed(3)
    return torch.randn(2 * mesh.depth * mesh.q, 3, h)


class Decorated(nn.Module):  # Hugging Face's wrappers, as transformers 5.24 puts on every forward
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(E, FF), nn.Linear(FF, E)

    @deprecate_kwarg("past_key_values", "9.0.0", new_name="cache")
    @can_return_tuple
    def forward(self, x, cache=None):
        return self.down(F.silu(self.up(x)))


def centred(fn):  # a user's decorator whose wrapper reads the hidden dim
    @functools.wraps(fn)
    def wrapper(self, x):
        return fn(self, x - x.mean(-1, keepdim=True))

    return wrapper


class Centred(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, E)

    @centred
    def forward(self, x):
        return self.proj(x)


class MaybeNormalised(nn.Module):  # a branch on a flag: read only when it runs
    def __init__(self, normalise: bool):
        super().__init__()
        self.proj, self.normalise, self.q_norm = nn.Linear(E, E), normalise, None

    def forward(self, x):
        y = self.proj(x)
        if self.normalise and self.q_norm is None:
            y = y / y.norm(dim=-1, keepdim=True)
        return F.gelu(y) if not self.normalise else y


class Dropping(nn.Module):  # F.dropout in a forward: element-wise
    def __init__(self, p: float):
        super().__init__()
        self.proj, self.p = nn.Linear(E, E), p

    def forward(self, x):
        return F.dropout(self.proj(x), p=self.p, training=self.training)


class Masked(nn.Module):  # reductions and cumulative sums over a mask, which has no hidden dim
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, E)

    def forward(self, x, attention_mask=None):
        seen = attention_mask.cumsum(dim=1) > 1  # [b, s]
        rows = attention_mask.sum(dim=-1, keepdim=True)  # [b, 1]
        return self.proj(x) * seen.unsqueeze(-1) * rows.unsqueeze(-1)


class FusedHeads(nn.Module):  # GPT-NeoX's habits: qkv fused per head, partial rotary by torch.cat
    def __init__(self, heads: int):
        super().__init__()
        self.head_dim, self.rot = E // heads, 1
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, 3 * self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)
        q = torch.cat([q[..., : self.rot] * 2, q[..., self.rot :]], dim=-1)
        heads = (q * k.sigmoid() + v).softmax(dim=-1)
        return self.out(heads.reshape(b, s, -1))


class HeadsThereAndBack(nn.Module):  # [b, heads, s, head_dim] in between, transposed back before the merge
    def __init__(self, heads: int):
        super().__init__()
        self.head_dim, self.proj = E // heads, nn.Linear(E, E)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = y.softmax(-1) * 2
        return y.transpose(1, 2).reshape(b, s, -1)


class Pair(nn.Module):  # a child that returns a tuple, as Hugging Face's layers do
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        return self.proj(x), None


class ItemsOfOutputs(nn.Module):  # [0] of a tuple of outputs is an item, not a row; len() of a list
    def __init__(self):
        super().__init__()
        self.pair, self.layers = Pair(), nn.ModuleList([nn.Linear(E, E), nn.Linear(E, E)])

    def forward(self, x):
        outputs = self.pair(x)
        y = outputs[0]
        for layer in self.layers[: len(self.layers)]:
            y = layer(y)
        return y


def _heads(mesh):
    return 6 if mesh.q == 3 else 4


def test_wrapping_decorators_dead_branches_and_per_head_ops_convert_exactly(mesh):
    torch.manual_seed(0)
    serial = nn.Sequential(
        Decorated(),
        MaybeNormalised(False),
        FusedHeads(_heads(mesh)),
        Dropping(0.0),
        ItemsOfOutputs(),
        HeadsThereAndBack(_heads(mesh)),
    )
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert [type(m) for m in parallel] == [type(m) for m in serial]  # each kept, its children converted
    assert isinstance(parallel[2].qkv, optimus2d.layers.Linear2D)
    serial.train(), parallel.train()  # dropout with p = 0 draws nothing
    check_against_serial(serial, parallel, _x(mesh), mesh)


def test_reductions_over_a_mask_convert_exactly(mesh):
    torch.manual_seed(0)
    serial = Masked()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    x = _x(mesh)
    mask = (torch.rand(x.shape[:2], generator=torch.Generator().manual_seed(4)) > 0.3).long()
    y_ref = serial(x, attention_mask=mask)
    y = parallel(scatter(x, mesh), attention_mask=scatter_batch(mask, mesh))
    assert_close(gather(y.detach(), mesh), y_ref, 1e-5, "output")
    (y_ref * 1.5).sum().backward()
    (y * 1.5).sum().backward()
    assert_grads_like_serial(serial, parallel, mesh, 1e-5)


def test_a_flag_changed_after_conversion_stops_the_forward(mesh):
    parallel = parallelize(nn.Sequential(MaybeNormalised(False)), mesh)
    parallel(scatter(_x(mesh), mesh))
    parallel[0].normalise = True
    with pytest.raises(RuntimeError, match=r"self.normalise and self.q_norm is None.* False; it is now True"):
        parallel(scatter(_x(mesh), mesh))


def test_an_attention_dropout_set_after_conversion_stops_the_forward(mesh):
    """LLaMA hands ``self.attention_dropout`` to its kernel: 0 when converted, so its forward was not
    put in shard_rng; set to 0.5 after, every rank drew the same mask. Now a guard, as for if-tests."""
    heads = 6 if mesh.q == 3 else 4
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=8 * heads, intermediate_size=96, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=heads, attention_dropout=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    parallel = parallelize(transformers.LlamaForCausalLM(config), mesh).train()
    ids = scatter_batch(torch.randint(0, 96, (2 * mesh.depth * mesh.q, 5)), mesh)
    parallel(input_ids=ids)
    parallel.model.layers[0].self_attn.attention_dropout = 0.5
    with pytest.raises(RuntimeError, match=r"self.attention_dropout\) == 0` True; it is now"):
        parallel(input_ids=ids)


def test_dropout_that_may_draw_draws_a_mask_per_shard(mesh):
    torch.manual_seed(0)
    serial = Dropping(0.5)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    serial.eval(), parallel.eval()  # no draw: exact
    check_against_serial(serial, parallel, _x(mesh), mesh)
    parallel.train()
    x = torch.ones(2 * mesh.depth * mesh.q, 3, E)
    with torch.no_grad():
        kept = gather(parallel(scatter(x, mesh)), mesh) != 0
    assert 0.2 < kept.float().mean() < 0.8
    if mesh.q > 1:  # the column blocks' masks differ (one mask drawn for every shard would repeat)
        blocks = kept.chunk(mesh.q, dim=-1)
        assert not all(torch.equal(blocks[0], b) for b in blocks[1:])


def _module(forward):
    """A container with one Linear child whose forward is ``forward(self, x)``, and a ``helper``."""
    cls = type(forward.__name__.title(), (nn.Module,), {"forward": forward, "helper": lambda self, y: centre(y)})
    module = cls()
    module.proj = nn.Linear(E, E)
    return module


def centre(y):
    return y - y.mean(-1, keepdim=True)


def _mean_method(self, x):
    y = self.proj(x)
    return y - y.mean(-1, keepdim=True)


def _mean_function(self, x):
    y = self.proj(x)
    return y - torch.mean(y, dim=-1, keepdim=True)


def _helper(self, x):
    return centre(self.proj(x))


def _merging_view(self, x):
    y = self.proj(x)
    return y.reshape(y.shape[0], -1).view_as(y)


def _parts_view(self, x):  # Moshi's gate/up MLP: a literal size cuts the split dim into parts
    b, s, _ = x.shape
    y = self.proj(x).view(b, s, 2, -1)
    return (y[..., 0, :] * y[..., 1, :]).repeat(1, 1, 2)


def _input_named_like_a_builtin(self, input):  # `input` is a parameter here, not the builtin
    return self.proj(input - input.mean(-1, keepdim=True))


def _unpacked_hidden_size(self, x):
    _b, _s, h = x.shape
    return self.proj(x) / h


def _size_of_dim_two(self, x):
    return self.proj(x) * x.size(2)


def _numel(self, x):
    y = self.proj(x)
    return y / y.numel()


def _batch_row(self, x):  # rows are split over the mesh too
    y = self.proj(x)
    return y + y[:1]


def _batch_item(self, x):  # y[0] of a tensor is its first row, this rank's (not a tuple's first output)
    y = F.gelu(self.proj(x)) * 2
    return y + y[0]


def _batch_len(self, x):  # len(y) of a tensor: the local batch
    y = self.proj(x)
    return y / len(y)


def _batch_as_number(self, x):
    b, _s, _ = x.shape
    return self.proj(x) / b


def _batch_read_inline(self, x):  # the local batch read where it is used (1.0 off)
    y = self.proj(x)
    return y / y.shape[0] + y / y.size(0)


def _unflattened(self, x):  # a gate/up split by unflatten of the split dim (1.15 off)
    y = self.proj(x).unflatten(-1, (2, -1))
    return F.silu(y[..., 0, :]) * y[..., 1, :]


def _stashed_on_self(self, x):
    self.cache = self.proj(x)
    return self.cache.softmax(-1)


def _transposed_reshape(self, x):
    b, s, _ = x.shape
    return self.proj(x).transpose(1, 2).reshape(b, s, -1)


def _loop_over_functions(self, x):
    for f in (self.proj, centre):
        x = f(x)
    return x


def _method_through_an_alias(self, x):
    me = self
    return me.helper(self.proj(x))


def _reduced_head(self, x):
    b, s, _ = x.shape
    q = self.proj(x).view(b, s, -1, 2)
    return q * q.mean(-1).softmax(-1).unsqueeze(-1)


def _heads_interleaved(self, x):  # [b, s, head_dim, heads]: each head's features spread over the heads
    b, s, _ = x.shape
    head_dim = 2
    return self.proj(x).view(b, s, -1, head_dim).transpose(2, 3).reshape(b, s, -1)


def _heads_before_tokens(self, x):  # [b, heads, s, head_dim] merged as if it were [b, s, heads, head_dim]
    b, s, _ = x.shape
    head_dim = 2
    y = self.proj(x).view(b, s, -1, head_dim).transpose(1, 2)
    return y.reshape(b, s, -1)


def _heads_swapped_by_mt(self, x):
    b, s, _ = x.shape
    head_dim = 2
    return self.proj(x).view(b, s, -1, head_dim).mT.reshape(b, s, -1)


def _head_feature_of_tokens(self, x):  # [b, heads, s]: one feature of each head, heads before tokens
    b, s, _ = x.shape
    head_dim = 2
    y = self.proj(x).view(b, s, -1, head_dim).transpose(1, 2)
    return y[..., 0].reshape(b, s, -1)


def _heads_through_gelu(self, x):  # an element-wise function keeps the heads where they are: [b, heads, s, hd]
    b, s, _ = x.shape
    head_dim = 2
    y = F.gelu(self.proj(x).view(b, s, -1, head_dim).transpose(1, 2))
    return y.reshape(b, s, -1)


def _heads_unsqueezed(self, x):
    b, s, _ = x.shape
    head_dim = 2
    return self.proj(x).view(b, s, -1, head_dim).transpose(1, 2).unsqueeze(0).reshape(b, s, -1)


def _head_features_unbound(self, x):  # unbind(-1) drops head_dim: [b, s, heads] is split like the hidden dim
    b, s, _ = x.shape
    head_dim = 2
    a, c = self.proj(x).view(b, s, -1, head_dim).unbind(-1)
    return torch.cat([a.softmax(-1), c], -1)


def _heads_of_a_spread_shape(self, x):  # how many dims it has is not known: its heads' place neither
    head_dim = 2
    y = self.proj(x).view(*x.shape[:-1], -1, head_dim).transpose(0, 1)
    return y.reshape(*x.shape[:-1], -1)


def _mask_total(self, x, attention_mask=None):
    return self.proj(x) / attention_mask.sum()


def _flattened(self, x):
    return self.proj(x).flatten(1).view_as(x)


def _indexed(self, x):
    y = self.proj(x)
    return y * y[:, :, 3:4]


def _through_a_dict(self, x):  # a dict the forward builds may be copied; what comes out is still judged
    kwargs = {"y": self.proj(x)}
    return kwargs.copy()["y"].mean(-1, keepdim=True) * x


def _live_branch(self, x):
    y = self.proj(x)
    if self.proj is not None:
        y = F.normalize(y, dim=-1)
    return y


@pytest.mark.parametrize(
    ("forward", "named"),
    [
        (_mean_method, ".mean()"),
        (_mean_function, "calls torch.mean"),
        (_helper, "calls centre(), not known to act on blocks"),
        (_merging_view, "may merge the split last dim with another"),
        (_parts_view, "may merge the split last dim with another"),
        (_flattened, "flattens the split last dim with another"),
        (_indexed, "slices the last dim"),
        (_live_branch, "calls F.normalize"),
        (_input_named_like_a_builtin, ".mean()"),
        (_unpacked_hidden_size, "reads the split dim's size"),
        (_size_of_dim_two, "reads a size that may be the split dim's"),
        (_numel, "reads a size that may be the split dim's"),
        (_batch_row, "indexes rows"),
        (_batch_item, "indexes rows"),
        (_batch_len, "uses the local size len(y) as a number"),
        (_batch_as_number, "uses the local size b as a number"),
        (_batch_read_inline, "uses the local size y.shape[0] as a number"),
        (_unflattened, "unflattens a dim that may be the split one"),
        (_stashed_on_self, "assigns self.cache"),
        (_transposed_reshape, "moves the split last dim"),
        (_loop_over_functions, "calls f(), not known to act on blocks"),
        (_method_through_an_alias, "not called through self"),
        (_reduced_head, ".softmax()"),
        (_heads_interleaved, "moves a head's features off the last dim"),
        (_heads_before_tokens, "per-head tensor whose heads are not in place"),
        (_heads_swapped_by_mt, "moves a head's features off the last dim"),
        (_head_feature_of_tokens, "per-head tensor whose heads are not in place"),
        (_heads_through_gelu, "per-head tensor whose heads are not in place"),
        (_heads_unsqueezed, "per-head tensor whose heads are not in place"),
        (_head_features_unbound, ".softmax()"),
        (_heads_of_a_spread_shape, "may merge the split last dim with another"),
        (_mask_total, ".sum()"),
        (_through_a_dict, ".mean()"),
    ],
    ids=[
        "method",
        "function",
        "helper",
        "view",
        "parts-view",
        "flatten",
        "index",
        "live-branch",
        "builtin-name",
        "unpacked-size",
        "size-2",
        "numel",
        "batch-row",
        "batch-item",
        "batch-len",
        "batch-number",
        "batch-inline",
        "unflatten",
        "stash",
        "transpose",
        "loop",
        "alias",
        "reduced-head",
        "heads-interleaved",
        "heads-before-tokens",
        "heads-mT",
        "head-feature",
        "heads-gelu",
        "heads-unsqueezed",
        "heads-unbound",
        "heads-spread",
        "mask-total",
        "dict-copy",
    ],
)
def test_a_forward_that_mixes_the_split_dim_is_refused_however_written(mesh, forward, named):
    model = nn.Sequential(nn.Linear(E, E), _module(forward))
    with pytest.raises(TypeError, match=r"1 module\(s\) cannot be converted") as err:
        parallelize(model, mesh)
    assert named in str(err.value)
    assert type(model[0]) is nn.Linear  # refused before anything changed


def test_every_offender_is_named_once_a_decorator_and_a_live_branch_among_them(mesh):
    model = nn.Sequential(Centred(), MaybeNormalised(True), Dropping(0.1), Decorated())
    with pytest.raises(TypeError) as err:
        parallelize(model, mesh)
    text = str(err.value)
    assert "2 module(s) cannot be converted" in text
    assert "0 (Centred): its forward Centred.forward, line" in text and "decorated by centred" in text
    assert "1 (MaybeNormalised)" in text and ".norm()" in text
