"""parallelize(): users' unmodified torch models on the mesh, equal to their serial selves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check_against_serial
from torch import nn

import optimus2d
from optimus2d import gather, parallelize, scatter, serial_state_dict
from optimus2d.convert.registry import _CONVERTERS

pytestmark = pytest.mark.mpi

E, HEADS, SEQ = 12, 6, 5


class UserModel(nn.Module):
    """What a user already has: a projection, a torch TransformerEncoder stack, a head."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), enable_nested_tensor=False)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(E, 6))

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.encoder(self.embed(x), mask=mask, is_causal=True))


def _x(mesh, features, seed=1):
    torch.manual_seed(seed)
    return torch.randn(2 * mesh.depth * mesh.q, SEQ, features)


@pytest.mark.parametrize("norm_first", [True, False], ids=["prenorm", "postnorm"])
def test_transformer_encoder_stack_matches_serial(mesh, norm_first):
    serial = UserModel(norm_first)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert isinstance(parallel.encoder.layers[0].self_attn, optimus2d.layers.MultiheadAttention2D)
    assert list(serial_state_dict(parallel)) == list(serial.state_dict())
    check_against_serial(serial, parallel, _x(mesh, 6), mesh)


@pytest.mark.parametrize("mask_check", [True, False], ids=["mask_check", "no_mask_check"])
def test_an_encoder_in_eval_takes_torchs_nested_path_where_torch_does(mesh, mask_check):
    """In eval, without grad, given a padding mask, torch's encoder runs its layers on each sample's
    first n tokens (n: those the mask keeps) and returns zeros past them, before its norm; the
    converted stack does too, where torch does: the mask whole or a block, bool or float, positional,
    padded at the end or (without mask_check, torch reading only n) inside; with grad, it does not."""
    import warnings

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True)
    serial = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), mask_check=mask_check).eval()
    assert serial.use_nested_tensor
    parallel = parallelize(copy.deepcopy(serial), mesh)
    x = _x(mesh, E)
    b = x.shape[0]
    at_end = torch.zeros(b, SEQ, dtype=torch.bool)
    at_end[1, -2:] = at_end[-1, -1:] = True
    inside = at_end.clone()
    inside[0, 1] = True
    masks = {"at the end": at_end, "inside": inside, "float": torch.zeros(b, SEQ).masked_fill(at_end, float("-inf"))}
    for grad in (False, True):
        for name, kpm in masks.items():
            with torch.set_grad_enabled(grad), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's: nested tensors are a prototype
                want = serial(x, src_key_padding_mask=kpm)
                for given in (kpm, optimus2d.scatter_batch(kpm, mesh)):
                    got = gather(parallel(scatter(x, mesh), src_key_padding_mask=given), mesh)
                    assert_close(got, want, 1e-5, f"{name}, grad {grad}")
                got = gather(parallel(scatter(x, mesh), None, kpm), mesh)
                assert_close(got, want, 1e-5, f"{name}, positional, grad {grad}")
            nested = not grad and (name != "inside" or not mask_check)  # torch's zeros, then its norm:
            past_end = want[1, -1].sub(serial.norm(torch.zeros(E))).abs().max()
            assert (past_end < 1e-6) == nested, (name, grad, past_end)  # the case is the one meant
    with torch.no_grad(), warnings.catch_warnings():  # torch's fast path on the nested tensor ignores is_causal
        warnings.simplefilter("ignore")
        want = serial(x, src_key_padding_mask=at_end, is_causal=True)
        got = gather(parallel(scatter(x, mesh), src_key_padding_mask=at_end, is_causal=True), mesh)
    assert_close(got, want, 1e-5, "is_causal on the nested path")  # (it was applied: 1.19 off)


class _DropPath(nn.Module):
    """timm's DropPath: a residual branch dropped per sample in training, identity in eval."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop_prob = p

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep) / keep


def test_a_leaf_that_draws_in_training_is_kept_for_eval_and_refused_in_training(mesh):
    """Probed in both modes: element-wise in eval, not in training (a draw a sample, which each rank
    would make for its own block from the same stream: blocks repeating each other's decisions).
    Kept, exact in eval; in training it raises on every rank alike. The probe leaves the caller's
    random stream as it was."""
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(E, E), _DropPath(0.3), nn.Linear(E, 6))
    before = torch.get_rng_state()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert torch.equal(torch.get_rng_state(), before)
    x = _x(mesh, E)
    serial.eval(), parallel.eval()
    assert_close(gather(parallel(scatter(x, mesh)), mesh), serial(x), 1e-5, "eval output")
    parallel.train()
    with pytest.raises(ValueError, match="_DropPath: acts element by element in eval only"):
        parallel(scatter(x, mesh))


def test_transformer_decoder_layer_matches_serial(mesh):
    torch.manual_seed(0)
    serial = nn.TransformerDecoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    tgt, memory = _x(mesh, E, seed=1), _x(mesh, E, seed=2)
    causal = nn.Transformer.generate_square_subsequent_mask(SEQ)
    tgt_ref, mem_ref = tgt.clone().requires_grad_(), memory.clone().requires_grad_()
    out_ref = serial(tgt_ref, mem_ref, tgt_mask=causal, tgt_is_causal=True)
    probe = torch.randn_like(out_ref)  # not Σ out²: a LayerNorm output's squared sum barely depends on x
    (out_ref * probe).sum().backward()
    tgt_full, mem_full = tgt.clone().requires_grad_(), memory.clone().requires_grad_()
    out = parallel(scatter(tgt_full, mesh), scatter(mem_full, mesh), tgt_mask=causal, tgt_is_causal=True)
    (out * scatter(probe, mesh)).sum().backward()
    assert_close(gather(out.detach(), mesh), out_ref, what="decoder output")
    assert_close(tgt_full.grad, tgt_ref.grad, what="tgt grad")
    assert_close(mem_full.grad, mem_ref.grad, what="memory grad")


class ScaleNorm(nn.Module):
    """A hand-written norm: it reads the whole hidden dim, so it must not run on a block."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_a_module_without_converter_is_refused_by_path(mesh):
    model = nn.Sequential(nn.Linear(E, E), nn.ModuleDict({"norm": ScaleNorm(E)}))
    refused = r"1 module\(s\) cannot be converted(.|\n)*1\.norm \(ScaleNorm\): holds weight and has no converter"
    with pytest.raises(TypeError, match=refused):
        parallelize(copy.deepcopy(model), mesh)
    with pytest.raises(TypeError, match=r"0 \(Softmax\): is not known to act element by element"):
        parallelize(nn.Sequential(nn.Softmax(-1)), mesh)


def test_register_converter_for_a_user_module(mesh):
    @optimus2d.convert.register_converter(ScaleNorm)
    def _(norm, mesh):
        rms = nn.RMSNorm(norm.weight.shape[0], eps=1e-6)
        rms.weight = norm.weight
        parallel = optimus2d.layers.RMSNorm2D.from_serial(rms, mesh)
        return parallel

    try:
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Linear(E, E), ScaleNorm(E))
        with torch.no_grad():
            serial[1].weight.uniform_(0.5, 1.5)
        parallel = parallelize(copy.deepcopy(serial), mesh)
        check_against_serial(serial, parallel, _x(mesh, E), mesh)
    finally:
        _CONVERTERS.pop(ScaleNorm)


def test_a_refused_model_is_left_untouched(mesh):
    model = nn.Sequential(nn.Linear(E, E), nn.Softmax(-1))
    with pytest.raises(TypeError, match=r"1 \(Softmax\)"):
        parallelize(model, mesh)
    assert type(model[0]) is nn.Linear  # checked whole before anything changed


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm. is deprecated:FutureWarning")
def test_hooks_and_parametrizations_set_before_parallelize_are_refused_by_name(mesh):
    """A hook set on a serial module was dropped with the module replaced (``out * 2`` on a Linear:
    0.56 off) or ran on blocks on a kept one (a root's ``out - out.mean(-1)``: 0.33 off); a
    parametrized weight became a plain one (after 3 AdamW steps 8.3e-2 off). Each is refused,
    named, the model left as it was; inside a converted layer too; a hook set after converting runs."""
    from torch.nn.utils import parametrizations, parametrize

    double = lambda module, args, out: out * 2  # noqa: E731
    hooked = nn.Sequential(nn.Linear(E, E), nn.GELU(), nn.Linear(E, E))
    hooked[0].register_forward_hook(double)
    hooked[2].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    hooked.register_forward_hook(lambda module, args, out: out - out.mean(-1, keepdim=True))
    hooked[1].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.raises(TypeError, match=r"4 module\(s\) cannot be converted") as refused:
        parallelize(hooked, mesh)
    for line in ("the model itself (Sequential): has a forward hook", "0 (Linear): has a forward hook",
                 "1 (GELU): has a backward hook", "2 (Linear): has a forward pre-hook"):  # fmt: skip
        assert line in str(refused.value)
    assert type(hooked[0]) is nn.Linear
    layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True)
    layer.linear1.register_forward_hook(double)  # inside a layer whose converter takes its children
    with pytest.raises(TypeError, match=r"0\.linear1 \(Linear\): has a forward hook"):
        parallelize(nn.Sequential(layer), mesh)
    for apply in (parametrizations.weight_norm, parametrizations.orthogonal, parametrizations.spectral_norm):
        model = nn.Sequential(nn.Linear(E, E), nn.GELU(), apply(nn.Linear(E, E)))
        with pytest.raises(TypeError, match=r"2 \(ParametrizedLinear\): its weight is parametrized"):
            parallelize(model, mesh)
        assert parametrize.is_parametrized(model[2])
    with pytest.raises(TypeError, match=r"0 \(Linear\): has a forward pre-hook WeightNorm"):
        parallelize(nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(E, E))), mesh)
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(E, E), nn.GELU(), nn.Linear(E, E))
    parallel = parallelize(copy.deepcopy(serial), mesh)
    parallel[0].register_forward_hook(double)  # on the converted model: it sees blocks, and runs
    serial[0].register_forward_hook(double)
    check_against_serial(serial, parallel, _x(mesh, E), mesh)


def test_a_layer_with_a_part_or_activation_torch_would_not_build_is_refused(mesh):
    """torch's encoder layer with a part swapped after construction, or a bias on one linear alone:
    the block is built as torch's constructor builds it, so a bias was dropped (0.10 off), a norm
    replaced crashed half-way through the conversion (the model half converted); a softmax as the
    activation ran on the hidden blocks (3.1e-2 off). Each refused by name, the model untouched;
    an element-wise activation of the user's converts exactly."""

    def layer(**kwargs):
        torch.manual_seed(0)
        return nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True, **kwargs)

    unbiased = layer(bias=False)
    unbiased.linear2 = nn.Linear(2 * E, E)
    swapped = layer()
    swapped.norm2 = nn.RMSNorm(E)
    softmax = layer(activation=lambda t: torch.softmax(t, -1))
    set_after = layer()
    set_after.activation = nn.Softmax(-1)
    cases = ((unbiased, "TransformerEncoderLayer holds linear2.bias, which the converted module has no place for"),
             (swapped, "TransformerEncoderLayer.norm2 is a RMSNorm, not the LayerNorm its constructor makes"),
             (softmax, "its activation .*<lambda> is not known to act element by element"),
             (set_after, "its activation Softmax is not known to act element by element"))  # fmt: skip
    for serial, why in cases:
        model = nn.Sequential(nn.Linear(E, E), serial)
        with pytest.raises(TypeError, match=r"1 \(TransformerEncoderLayer\): TransformerBlock2D.from_serial: " + why):
            parallelize(model, mesh)
        assert type(model[0]) is nn.Linear and model[1] is serial
    serial = layer(activation=lambda t: F.gelu(t, approximate="tanh"))
    check_against_serial(serial, parallelize(copy.deepcopy(serial), mesh), _x(mesh, E), mesh)


class _Centered(nn.ReLU):
    """A subclass of an element-wise class whose forward mixes the hidden dim: not element-wise."""

    def forward(self, x):
        return x - x.mean(-1, keepdim=True)


class _NamedGELU(nn.GELU):
    """A subclass that keeps its class's forward: still element by element."""

    label = "mine"


class _ScaledHead(nn.Linear):
    """A head tied to an embedding whose forward is its own."""

    def forward(self, x):
        return super().forward(x) * 0.5


def test_a_subclass_is_trusted_only_with_its_classs_forward(mesh):
    """A subclass of an element-wise class (or of nn.Linear, as a head tied to an embedding) that
    rewrites the forward is refused by path; one that keeps it converts, exact."""
    with pytest.raises(TypeError, match=r"1 \(_Centered\): is not known to act element by element"):
        parallelize(nn.Sequential(nn.Linear(E, E), _Centered(), nn.Linear(E, E)), mesh)
    head = _ScaledHead(E, 13, bias=False)
    tied = nn.Sequential(nn.Embedding(13, E), head)
    head.weight = tied[0].weight
    with pytest.raises(TypeError, match=r"shared by 0.weight, 1.weight; only an embedding table shared by"):
        parallelize(tied, mesh)
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(6, E), _NamedGELU(), nn.Linear(E, 6))
    check_against_serial(serial, parallelize(copy.deepcopy(serial), mesh), _x(mesh, 6), mesh)


class _Instance(nn.Module):
    """A container whose forward names its instance ``mod``, not ``self``."""

    def __init__(self, reduce: bool) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.reduce = nn.Linear(6, E), nn.GELU(), nn.Linear(E, 6), reduce

    def forward(mod, x):  # noqa: N805
        h = mod.act(mod.fc1(x))
        return mod.fc2(h - h.mean(-1, keepdim=True) if mod.reduce else h)


def test_a_forward_that_names_its_instance_otherwise_is_read_alike(mesh):
    """The reader knows the instance by its first parameter, whatever its name: converted and exact,
    and a reduction over the split dim through that name still refused."""
    torch.manual_seed(0)
    serial = _Instance(reduce=False)
    check_against_serial(serial, parallelize(copy.deepcopy(serial), mesh), _x(mesh, 6), mesh)
    with pytest.raises(TypeError, match=r"the model itself \(_Instance\)(.|\n)*h.mean\(-1"):
        parallelize(_Instance(reduce=True), mesh)


class Shared(nn.Module):
    """A module used twice, and a head declared before the embedding it is tied to."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(E, 13, bias=False)
        self.emb = nn.Embedding(13, E)
        self.head.weight = self.emb.weight
        self.mix = nn.Linear(E, E)
        self.twice = nn.Sequential(self.mix, nn.GELU(), self.mix)

    def forward(self, ids):
        return self.head(self.twice(self.emb(ids)))


def test_shared_modules_and_a_tied_head_stay_shared(mesh):
    serial = Shared()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert parallel.twice[0] is parallel.twice[2] is parallel.mix
    assert parallel.head.weight is parallel.emb.weight
    assert len(list(parallel.parameters())) == len(list(serial.parameters())) == 3
    torch.manual_seed(1)
    ids = torch.randint(0, 13, (2 * mesh.depth * mesh.q, SEQ))
    logits = gather(parallel(optimus2d.scatter_batch(ids, mesh)), mesh)[..., :13]
    assert_close(logits, serial(ids), what="logits")
    assert list(serial_state_dict(parallel)) == list(serial.state_dict())


def test_other_shared_parameters_are_refused(mesh):
    a, b = nn.Linear(E, E), nn.Linear(E, E)
    b.weight = a.weight
    with pytest.raises(TypeError, match=r"one parameter is shared by 0\.weight, 1\.weight"):
        parallelize(nn.Sequential(a, b), mesh)


def test_a_parameter_also_held_outside_the_model_given_is_guarded(mesh):
    """A base model converted alone, its tied head left outside it (``BertForPreTraining``'s decoder
    is its embedding table; the whole class is refused): the model held blocks, the head the serial
    tensor, and training went 0.14 off in one step, silently. The head now raises when called, on
    every rank, and a later ``parallelize`` of it refuses; an untied copy runs as serial."""
    from optimus2d.convert.tied import ELSEWHERE

    torch.manual_seed(0)
    outer = nn.Module()
    outer.base = nn.Sequential(nn.Embedding(13, 4 * mesh.q), nn.Linear(4 * mesh.q, 4 * mesh.q))
    outer.head = nn.Linear(4 * mesh.q, 13, bias=False)
    outer.head.weight = outer.base[0].weight
    untied = nn.Linear(4 * mesh.q, 13, bias=False)
    untied.weight = nn.Parameter(outer.base[0].weight.detach().clone())
    serial_base = copy.deepcopy(outer.base)
    base = parallelize(outer.base, mesh, io="whole")
    ids = torch.randint(0, 13, (2 * mesh.depth * mesh.q, SEQ))
    hidden = base(ids)
    assert_close(hidden, serial_base(ids), what="the base model, converted")
    assert outer.head.weight is not base[0].weight  # a new parameter, at one rank too
    with pytest.raises(ValueError, match=r"Linear: its weight is the 0\.weight of Sequential.*tie is broken"):
        outer.head(hidden)
    with pytest.raises(TypeError, match=r"weight \(tied to 0\.weight of Sequential\)"):
        parallelize(outer.head, mesh)
    assert getattr(untied.weight, ELSEWHERE, None) is None
    assert_close(untied(hidden), F.linear(serial_base(ids), serial_base[0].weight), what="an untied head")


def test_an_optimizer_built_before_parallelize_refuses_to_step(mesh):
    """It holds the serial parameters, which the converted model no longer holds: its step moved
    nothing the model uses (an SGD step left every block as it was, no error). It now raises at its
    step on every rank; one built after trains as serial, and one over a serial twin is untouched."""
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))
    model = copy.deepcopy(serial)
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1)
    model = parallelize(model, mesh)
    x = torch.randn(2 * mesh.depth * mesh.q, SEQ, E)
    gather(model(scatter(x, mesh)), mesh).pow(2).sum().backward()
    serial(x).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"AdamW: it holds 4 parameters of Sequential \(0\.weight, 0\.bias, 2\.weight"):
        early.step()
    early.param_groups[0]["params"] = list(model.parameters())  # given the model's own: it steps (the hook goes)
    early.state.clear()
    before = [p.detach().clone() for p in model.parameters()]
    early.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    serial_opt.step()
    check_against_serial(copy.deepcopy(serial), parallelize(copy.deepcopy(serial), mesh), x, mesh)


class _Everything(nn.Module):
    """One of every module parallelize converts from torch.nn, in a chain."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(12, 6, 24, dropout=0.0, batch_first=True)
        self.embed = nn.Embedding(10, 12)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.attn = nn.MultiheadAttention(12, 6, batch_first=True)
        self.norm = nn.LayerNorm(12)
        self.rms = nn.RMSNorm(12)
        self.head = nn.Linear(12, 6)

    def forward(self, ids):
        x = self.encoder(self.embed(ids))
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.rms(self.norm(x)))


def test_frozen_parameters_stay_frozen_and_unchanged(mesh):
    torch.manual_seed(0)
    serial = _Everything()
    names = [name for name, _ in serial.named_parameters()]
    frozen = set(names[::2])  # every other parameter, of every kind of module
    for name, param in serial.named_parameters():
        param.requires_grad_(name not in frozen)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    flags = {name: param.requires_grad for name, param in parallel.named_parameters()}
    assert flags == {name: name not in frozen for name in names}
    torch.manual_seed(1)
    ids = torch.randint(0, 10, (2 * mesh.depth * mesh.q, 5))
    before = serial_state_dict(parallel)
    for model, out in (
        (serial, lambda: serial(ids)),
        (parallel, lambda: gather(parallel(optimus2d.scatter_batch(ids, mesh)), mesh)),
    ):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        out().square().sum().backward()
        opt.step()
    assert all(p.grad is None for n, p in parallel.named_parameters() if n in frozen)
    after, want = serial_state_dict(parallel), serial.state_dict()
    for key in want:
        assert_close(after[key], want[key], 1e-5, key)
        if key in frozen:
            assert torch.equal(after[key], before[key]), key


def test_a_scalar_kept_whole_frozen_when_converted_and_unfrozen_after_gets_the_serial_gradient(mesh):
    """A parameter kept whole on every rank has its gradient summed over the mesh by a hook; one
    frozen when converted had none, and once unfrozen (a second phase of training) each rank got its
    own blocks' part alone: 0.09 for 0.41, another on every rank, silently."""
    from helpers import Scale, assert_grads_like_serial

    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(4 * mesh.q, 4 * mesh.q), Scale(), nn.Linear(4 * mesh.q, 2 * mesh.q))
    serial[1].s.requires_grad_(False)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    for model in (serial, parallel):
        model[1].s.requires_grad_(True)
    x = torch.randn(2 * mesh.size, SEQ, 4 * mesh.q)
    serial(x).square().sum().backward()
    parallel(scatter(x, mesh)).square().sum().backward()
    assert_grads_like_serial(serial, parallel, mesh, 1e-5)


def test_a_model_converted_in_eval_mode_stays_in_eval_mode(mesh):
    """Every module keeps its serial module's mode (a converter's new modules their ancestor's): a
    GPT-2 converted in eval mode runs no dropout, as serial does (before, its Dropout2D were made in
    training mode and the logits were 0.23 off, silently)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=24, n_layer=1, n_head=6, n_positions=16)
    serial = transformers.GPT2LMHeadModel(cfg).double().eval()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 6))
    got = gather(parallel(input_ids=optimus2d.scatter_batch(ids, mesh)).logits.detach(), mesh)
    assert_close(got, serial(input_ids=ids).logits, 1e-12, "logits in eval mode")
    serial.transformer.h[0].mlp.train()  # one part in training mode: it stays so (its dropout drawn)
    modes = {path: m.training for path, m in parallelize(copy.deepcopy(serial), mesh).named_modules()}
    assert modes["transformer.h.0.mlp"] and modes["transformer.h.0.mlp.dropout"]
    assert not any(mode for path, mode in modes.items() if not path.startswith("transformer.h.0.mlp"))


def test_a_model_without_parameters_converts(mesh):
    model = parallelize(nn.Sequential(nn.GELU(), nn.Identity()), mesh)  # nothing to compare: no exchange fails
    x = torch.randn(2 * mesh.depth * mesh.q, 3, 4 * mesh.q)
    assert torch.equal(gather(model(scatter(x, mesh)), mesh), nn.functional.gelu(x))


def test_serial_state_dict_sees_through_torchs_checkpoint_wrapper(mesh):
    """torch's ``checkpoint_wrapper`` rewrites the state_dict keys (it drops its own prefix): the
    serial view still finds each tensor's owner, so the blocks are gathered, not passed as whole."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12))
    parallel = parallelize(copy.deepcopy(serial), mesh)
    parallel[0] = checkpoint_wrapper(parallel[0])
    state = optimus2d.serial_state_dict(parallel)
    assert list(state) == list(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert torch.equal(state[key], value), key
    optimus2d.load_serial_state_dict(parallel, {k: v + 1 for k, v in serial.state_dict().items()})
    assert torch.equal(optimus2d.serial_state_dict(parallel)["0.weight"], serial[0].weight + 1)
