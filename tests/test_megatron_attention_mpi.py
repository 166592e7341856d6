"""torch's ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``
inside a 1D region (``plan={path: megatron.Megatron(mesh)}``): the attention's heads split over the
ranks (``megatron.SplitMultiheadAttention``), the layers' linear1 by column and linear2 by row
(torch's ``parallelize_module``). Against the real torch classes: outputs, input gradients, one
SGD step (one AdamW step, and the gradient norm, where the key bias's gradient, rounding alone, is
not made a step of ±lr: ``compare_step``) and the serial state, frozen and trained, on every mesh
shape of the world; masks, cross-attention, the sequence-first layout and averaged weights; a checkpoint moved
between meshes; refusals on every rank before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import meshes_of
from helpers import assert_close, check_against_serial, compare_step
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import optimus2d
from optimus2d import gather, parallelize, scatter, serial_state_dict
from optimus2d.megatron import Megatron, SplitMultiheadAttention

pytestmark = pytest.mark.mpi


def _heads(world) -> int:
    return 2 * world.size if world.size < 4 else world.size


class EncoderProjector(nn.Module):
    """torch's transformer encoder (the 1D region), a norm and a projector on the model's mesh."""

    def __init__(self, width: int, heads: int, layers: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.encoder(x)))


def _encoder(world, frozen: bool, seed: int = 0) -> EncoderProjector:
    torch.manual_seed(seed)
    h = _heads(world)
    model = EncoderProjector(2 * h, h).double()
    model.encoder.requires_grad_(not frozen)
    return model


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_encoder_layers_exact_on_every_mesh(world, frozen):
    h = _heads(world)
    torch.manual_seed(1)
    x = torch.randn(world.size, 5, 2 * h, dtype=torch.float64)
    for mesh in meshes_of(world):
        serial = _encoder(world, frozen)
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)})
        layer = parallel.encoder.layers[0]
        assert isinstance(layer.self_attn, SplitMultiheadAttention)
        if world.size > 1:  # [3E/p, E]: q, k and v rows of this rank's heads; linear1 [ffn/p, E] by torch
            assert optimus2d.comm.dtensor.local(layer.self_attn.in_proj_weight).shape == (6 * h // world.size, 2 * h)
            assert isinstance(layer.linear1.weight, DTensor) and layer.linear1.weight.placements == (Shard(0),)
            assert layer.linear2.weight.placements == (Shard(1),)
        check_against_serial(serial, parallel, x, mesh, tol=1e-9)
        if frozen:
            assert all(p.grad is None for p in parallel.encoder.parameters())


def test_gradients_their_norm_and_a_step_of_a_trained_encoder(world):
    h, mesh = _heads(world), meshes_of(world)[0]
    torch.manual_seed(2)
    x = torch.randn(world.size, 5, 2 * h, dtype=torch.float64)
    serial = _encoder(world, False)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)})
    serial(x).square().sum().backward()
    parallel(scatter(x, mesh)).square().sum().backward()
    compare_step(serial, parallel, mesh, tol=1e-8)


class Masked(nn.Module):
    """One attention with every mask kind nn.MultiheadAttention takes, cross-attention on a memory
    made inside, the averaged weights used; ``batch_first`` either way."""

    def __init__(self, width: int, heads: int, batch_first: bool, kind: str) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=batch_first)
        self.memory = nn.Linear(width, width)
        self.heads, self.batch_first, self.kind = heads, batch_first, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        seq = x if self.batch_first else x.transpose(0, 1)
        kpm = torch.zeros(b, s, dtype=torch.bool)
        kpm[0, -2:] = True  # the last two keys of the first sequence are padding
        if self.kind == "causal":
            mask = torch.ones(s, s, dtype=torch.bool).triu_(1)
            out, weights = self.attn(seq, seq, seq, key_padding_mask=kpm, attn_mask=mask, is_causal=True)
        elif self.kind == "per-head":
            mask = torch.linspace(-1, 1, b * self.heads * s * s, dtype=x.dtype).view(b * self.heads, s, s)
            out, weights = self.attn(seq, seq, seq, attn_mask=mask)
        else:  # cross-attention on a memory, its padding a float mask
            mem = self.memory(seq)
            out, weights = self.attn(seq, mem, mem, key_padding_mask=kpm.to(x.dtype) * -3.0)
        out = out if self.batch_first else out.transpose(0, 1)
        return out + weights @ x


class Outer(nn.Module):
    def __init__(self, block: nn.Module, width: int) -> None:
        super().__init__()
        self.block, self.proj = block, nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.block(x))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_masks_cross_attention_and_averaged_weights(world, batch_first):
    h, mesh = _heads(world), meshes_of(world)[-1]
    torch.manual_seed(3)
    x = torch.randn(world.size, 6, 2 * h, dtype=torch.float64)
    for kind in ("causal", "per-head", "cross"):
        torch.manual_seed(4)
        serial = Outer(Masked(2 * h, h, batch_first, kind), 2 * h).double()
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"block": Megatron(mesh)})
        assert isinstance(parallel.block.attn, SplitMultiheadAttention)
        check_against_serial(serial, parallel, x, mesh, tol=1e-9)


class Decoder(nn.Module):
    """torch's decoder layer (the region) on a target and a memory made on the model's mesh."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.memory = nn.Linear(width, width)
        self.decoder = nn.TransformerDecoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x, self.memory(x))


def test_decoder_layer_self_and_cross_attention(world):
    h = _heads(world)
    torch.manual_seed(5)
    x = torch.randn(world.size, 4, 2 * h, dtype=torch.float64)
    for mesh in meshes_of(world):
        torch.manual_seed(6)
        serial = Decoder(2 * h, h).double()
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"decoder": Megatron(mesh)})
        assert isinstance(parallel.decoder.multihead_attn, SplitMultiheadAttention)
        check_against_serial(serial, parallel, x, mesh, tol=1e-9)


def test_eval_without_grad_is_the_serial_forward(world):
    """torch's encoder layer has a fused fast path in eval without grad: it must not run on blocks."""
    h, mesh = _heads(world), meshes_of(world)[0]
    torch.manual_seed(7)
    x = torch.randn(world.size, 5, 2 * h, dtype=torch.float64)
    serial = _encoder(world, False).eval()
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)}).eval()
    with torch.no_grad():
        assert_close(gather(parallel(scatter(x, mesh)), mesh), serial(x), 1e-9, "eval output")


class _Padded(nn.Module):
    def __init__(self, encoder: nn.TransformerEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: torch.Tensor, padding: torch.Tensor, is_causal: bool | None = None) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=padding, is_causal=is_causal)


@pytest.mark.parametrize("mask_check", [True, False], ids=["mask_check", "no_mask_check"])
def test_an_encoder_in_eval_takes_torchs_nested_path_where_torch_does(world, mask_check):
    """In eval, without grad, given a padding mask, torch's encoder runs its layers on a nested tensor
    of each sample's first n tokens and returns zeros past them, before its norm: in a 1D region the
    same, dense (the split attention was handed the nested tensor and crashed); with grad, or a mask
    not left-aligned under mask_check, torch's dense path."""
    import warnings

    h = 2 * world.size  # heads: torch's nested path needs an even number
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(2 * h, h, 4 * h, dropout=0.0, batch_first=True)
    serial = _Padded(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(2 * h), mask_check=mask_check)).eval()
    assert serial.encoder.use_nested_tensor
    x = torch.randn(world.size, 5, 2 * h)
    at_end = torch.zeros(world.size, 5, dtype=torch.bool)
    at_end[-1, -2:] = True
    inside = at_end.clone()
    inside[0, 1] = True
    for mesh in meshes_of(world):
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)}, io="whole").eval()
        for grad in (False, True):
            for name, padding in (("at the end", at_end), ("inside", inside)):
                with torch.set_grad_enabled(grad), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's: nested tensors are a prototype
                    want = serial(x, padding)
                    assert_close(parallel(x, padding), want, 1e-5, f"{name}, grad {grad}, {mesh}")
                nested = not grad and (name != "inside" or not mask_check)  # torch's zeros, then its norm
                past_end = want[-1, -1].sub(serial.encoder.norm(torch.zeros(2 * h))).abs().max()
                assert (past_end < 1e-6) == nested, (name, grad, past_end)  # the case is the one meant
        with torch.no_grad(), warnings.catch_warnings():  # torch's fast path on the nested tensor: no is_causal
            warnings.simplefilter("ignore")
            want = serial(x, at_end, True)
            assert_close(parallel(x, at_end, True), want, 1e-5, f"is_causal, {mesh}")  # (it raised)


def test_checkpoint_moves_between_meshes_with_split_attention(world, shared_dir):
    """Saved with the encoder in 1D on the first mesh, loaded on the last: the same serial tensors,
    and AdamW goes on stepping exactly; ``load_serial_state_dict`` takes the serial tensors."""
    first, last = meshes_of(world)[0], meshes_of(world)[-1]
    torch.manual_seed(8)
    x = torch.randn(world.size, 5, 2 * _heads(world), dtype=torch.float64)
    trained = parallelize(_encoder(world, False), first, plan={"encoder": Megatron(first)})
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2, eps=1e-4)  # the key bias's rounding: no ±lr step
    trained(scatter(x, first)).sum().backward()
    opt.step()
    optimus2d.checkpoint.save(f"{shared_dir}/ckpt", trained, opt)
    fresh = parallelize(_encoder(world, False, seed=9), last, plan={"encoder": Megatron(last)})
    opt_fresh = torch.optim.AdamW(fresh.parameters(), lr=1e-2, eps=1e-4)
    optimus2d.checkpoint.load(f"{shared_dir}/ckpt", fresh, opt_fresh)
    for model, mesh, optimizer in ((trained, first, opt), (fresh, last, opt_fresh)):
        optimizer.zero_grad()
        model(scatter(x, mesh)).sum().backward()
        optimizer.step()
    want, got = serial_state_dict(trained), serial_state_dict(fresh)
    assert list(got) == list(_encoder(world, False).state_dict())  # nn.MultiheadAttention's own keys
    for key, value in want.items():
        assert_close(got[key], value, 1e-10, key)
    doubled = {key: 2 * value for key, value in want.items()}
    optimus2d.load_serial_state_dict(fresh, doubled)
    for key, value in serial_state_dict(fresh).items():
        assert_close(value, doubled[key], 0, key)


def test_what_does_not_split_is_refused_on_every_rank(world):
    if world.size == 1:
        pytest.skip("one rank splits every head count")
    mesh, heads = meshes_of(world)[-1], world.size + 1
    cases = {
        "num_heads": nn.MultiheadAttention(2 * heads, heads, batch_first=True),
        "add_bias_kv": nn.MultiheadAttention(2 * world.size, world.size, add_bias_kv=True, batch_first=True),
        "kdim": nn.MultiheadAttention(2 * world.size, world.size, kdim=3, vdim=3, batch_first=True),
    }
    for what, attn in cases.items():
        model = Outer(Masked(attn.embed_dim, attn.num_heads, True, "causal"), attn.embed_dim).double()
        model.block.attn = attn.double()
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError, match=f"block.attn \\(MultiheadAttention\\): .*{what}"):
            parallelize(model, mesh, plan={"block": Megatron(mesh)})
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    layer = nn.TransformerEncoderLayer(2 * world.size, world.size, 4 * world.size, dropout=0.0, batch_first=True)
    layer.activation = nn.Softmax(-1)  # not element by element: it would see a shard of linear1's output
    with pytest.raises(ValueError, match="block \\(TransformerEncoderLayer\\): activation Softmax"):
        parallelize(Outer(layer, 2 * world.size).double(), mesh, plan={"block": Megatron(mesh)})


def test_per_head_weights_and_a_causal_hint_without_mask_are_refused(world):
    mesh, h = meshes_of(world)[-1], _heads(world)
    attn = SplitMultiheadAttention.from_serial(nn.MultiheadAttention(2 * h, h, batch_first=True).double(), mesh)
    x = torch.randn(2, 3, 2 * h, dtype=torch.float64)
    if world.size > 1:
        with pytest.raises(ValueError, match="per-head attention weights"):
            attn(x, x, x, average_attn_weights=False)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        attn(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match=f"query of shape \\(2, 3, {h}\\)"):
        attn(x[..., :h], x, x)


def test_one_all_reduce_forward_and_one_per_input_backward(world):
    """Megatron's split: the out projection's sum all-reduced forward ([b, L, E]); backward one
    all-reduce of the input's gradient (self-attention: the one input entered once), none for an
    input that needs none; cross-attention: one for the query, one for the memory (key is value)."""
    if world.size == 1:
        pytest.skip("one rank sends nothing")
    mesh, h = meshes_of(world)[-1], _heads(world)
    b, s, e = 2, 3, 2 * h
    attn = SplitMultiheadAttention.from_serial(nn.MultiheadAttention(e, h, batch_first=True).double(), mesh)
    x = torch.randn(b, s, e, dtype=torch.float64, requires_grad=True)
    with optimus2d.count_comm() as forward:
        y, _ = attn(x, x, x, need_weights=False)
    assert forward.by("kind", "axis") == {("all_reduce", "mesh"): b * s * e}
    with optimus2d.count_comm() as backward:
        y.sum().backward()
    assert backward.by("kind", "axis") == {("all_reduce", "mesh"): b * s * e}
    memory = torch.randn(b, 5, e, dtype=torch.float64, requires_grad=True)
    y, _ = attn(x, memory, memory, need_weights=False)
    with optimus2d.count_comm() as cross:
        y.sum().backward()
    assert cross.by("kind", "axis") == {("all_reduce", "mesh"): b * s * e + b * 5 * e}
    attn.requires_grad_(False)
    y, _ = attn(x.detach(), x.detach(), x.detach(), need_weights=False)  # frozen, its input needs nothing
    assert not y.requires_grad


def test_built_alone_it_holds_blocks_of_torchs_own_init(world):
    """``SplitMultiheadAttention(E, H, mesh=)`` draws as ``nn.MultiheadAttention`` does: with the same
    seed, the serial module's tensors (``serial_state_dict``), and its output."""
    mesh, h = meshes_of(world)[-1], _heads(world)
    torch.manual_seed(11)
    serial = nn.MultiheadAttention(2 * h, h, batch_first=True, dtype=torch.float64)
    torch.manual_seed(11)
    split = SplitMultiheadAttention(2 * h, h, batch_first=True, mesh=mesh, dtype=torch.float64)
    state = serial_state_dict(split)
    assert list(state) == list(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 0, key)
    x = torch.randn(2, 3, 2 * h, dtype=torch.float64)
    assert_close(split(x, x, x)[0], serial(x, x, x)[0], 1e-12, "output")


def test_heads_and_masks_that_do_not_fit_are_refused_with_their_numbers(world):
    """Before any collective: a head count the ranks do not divide (built alone), a mask of another shape."""
    mesh, h = meshes_of(world)[-1], _heads(world)
    if world.size > 1:
        with pytest.raises(ValueError, match=f"num_heads = {world.size + 1}: .* the {world.size} ranks"):
            SplitMultiheadAttention(2 * (world.size + 1), world.size + 1, mesh=mesh)
    attn = SplitMultiheadAttention.from_serial(nn.MultiheadAttention(2 * h, h, batch_first=True).double(), mesh)
    x = torch.randn(2, 3, 2 * h, dtype=torch.float64)
    with optimus2d.count_comm() as sent:
        with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 4\) does not fit \[L, S\] = \(3, 3\)"):
            attn(x, x, x, attn_mask=torch.zeros(3, 4, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"key_padding_mask of shape \(2, 4\) does not fit \[b, S\] = \(2, 3\)"):
            attn(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
        memory = torch.randn(2, 5, 2 * h, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"key of shape \(2, 5, \d+\) and value of shape \(2, 4, \d+\) must match"):
            attn(x, memory, memory[:, :4])
        with pytest.raises(ValueError, match=r"query of shape \(2, 3, \d+\) and key of shape \(1, 5, \d+\) differ in"):
            attn(x, memory[:1], memory[:1])
    assert sent.bytes == 0
