"""parallelize keeps a forward only when something says it is correct on blocks: a converter, a
declaration (``keep=True``), a probe (element-wise leaves, norms) or a reading of its code; every
other module is refused, all of them in one error, before anything changes or is sent."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check_against_serial
from torch import nn

import optimus2d
from optimus2d import parallelize
from optimus2d.convert.registry import _CONVERTERS

pytestmark = pytest.mark.mpi
E, FF = 12, 24


def _x(mesh, h=E):
    torch.manual_seed(3)
    return torch.randn(2 * mesh.depth * mesh.q, 3, h)


class Square(nn.Module):  # an activation no list names: a probe finds it element-wise
    def forward(self, x):
        return x * x.abs()


class MyRMSNorm(nn.Module):  # a hand-written RMSNorm storing its eps: a probe finds what it computes
    def __init__(self, h, eps=1e-6, offset=0.0):
        super().__init__()
        self.weight, self.variance_epsilon, self.offset = nn.Parameter(torch.rand(h) + 0.5), eps, offset

    def forward(self, x):
        x32 = x.float()
        rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return x32 * rms * (self.offset + self.weight)


class GatedMLP(nn.Module):  # a container whose forward only calls children, element-wise: kept
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down, self.act = nn.Linear(E, FF), nn.Linear(E, FF), nn.Linear(FF, E), Square()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * F.silu(self.up(x)))


class FusedMLP(nn.Module):  # Phi-3's habit without Phi-3's names: chunk of the hidden dim, refused
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(E, 2 * FF), nn.Linear(FF, E)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.out(F.silu(gate) * up)


class Normalised(nn.Module):  # CLIP's habit: a norm over the last dim in a container's forward
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        y = self.proj(x)
        return y / y.norm(dim=-1, keepdim=True)


class Sliced(nn.Module):  # slices the hidden dim by a size: refused
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        return self.proj(x)[..., : E // 2]


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
def test_probed_norms_and_activations_and_a_read_container_convert_exactly(mesh, offset):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(E, E), MyRMSNorm(E, offset=offset), GatedMLP(), Square())
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert isinstance(parallel[1], optimus2d.layers.RMSNorm2D) and parallel[1].weight_offset == offset
    assert type(parallel[2]) is GatedMLP and isinstance(parallel[2].gate, optimus2d.layers.Linear2D)
    check_against_serial(serial, parallel, _x(mesh), mesh)


def test_every_offender_is_named_in_one_error_on_every_rank(mesh):
    model = nn.Sequential(FusedMLP(), nn.Linear(E, E), Normalised(), nn.Softmax(-1), Sliced(), nn.Linear(E, E))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError) as err:
        parallelize(model, mesh)
    text = str(err.value)
    assert "4 module(s) cannot be converted" in text
    assert "0 (FusedMLP): its forward FusedMLP.forward, line" in text and ".chunk()" in text
    assert "2 (Normalised)" in text and ".norm()" in text
    assert "3 (Softmax): is not known to act element by element" in text
    assert "4 (Sliced)" in text and "slices the last dim" in text
    assert "register_converter(cls, keep=True)" in text
    assert type(model[1]) is nn.Linear  # refused before anything changed
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_keep_true_declares_a_forward_the_reader_refuses(mesh):
    class Halves(nn.Module):  # correct on blocks (each half of the hidden dim alone), but uses chunk
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(E, E)

        def forward(self, x):
            a, b = self.proj(x).chunk(2, dim=-1)
            return torch.cat([a, b], -1) * 2

    model = nn.Sequential(nn.Linear(E, E), Halves())
    with pytest.raises(TypeError, match=r"1 \(Halves\): its forward"):
        parallelize(copy.deepcopy(model), mesh)
    optimus2d.convert.register_converter(Halves, keep=True)
    try:
        parallel = parallelize(copy.deepcopy(model), mesh)
        assert type(parallel[1]) is Halves
    finally:
        _CONVERTERS.pop(Halves)
    with pytest.raises(TypeError, match="not both"):
        optimus2d.convert.register_converter(Halves, lambda m, mesh: m, keep=True)


def test_a_norm_over_one_heads_features_is_kept_whole_and_its_gradient_summed(mesh):
    class HeadNormAttention(nn.Module):  # Qwen3's q_norm: a norm over head_dim, whole on every rank
        def __init__(self):
            super().__init__()
            self.head_dim = 4
            self.q_proj, self.o_proj = nn.Linear(E, E), nn.Linear(E, E)
            self.q_norm = MyRMSNorm(self.head_dim)

        def forward(self, x):
            hidden_shape = (*x.shape[:-1], -1, self.head_dim)
            q = self.q_norm(self.q_proj(x).view(hidden_shape))
            return self.o_proj(q.reshape(*x.shape[:-1], -1))

    if 3 % mesh.q:
        pytest.skip("3 heads of 4 do not split over q = 2")
    torch.manual_seed(0)
    serial = HeadNormAttention()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert type(parallel.q_norm) is MyRMSNorm  # whole: its weight is [head_dim] on every rank
    x = _x(mesh)
    serial(x).square().sum().backward()
    optimus2d.gather(parallel(optimus2d.scatter(x, mesh)), mesh).square().sum().backward()
    assert_close(parallel.q_norm.weight.grad, serial.q_norm.weight.grad, 1e-5, "q_norm.weight.grad")


class Weightless(nn.Module):  # OLMo's habit: a norm with no weight, its width in normalized_shape
    def __init__(self, h, rms=False):
        super().__init__()
        self.normalized_shape, self.rms = (h,), rms

    def forward(self, x):
        if self.rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # no eps attribute: tried
        return F.layer_norm(x, self.normalized_shape, None, None, 1e-5)


class ScaledSquare(nn.Module):  # xIELU's habit: scalar parameters and buffers, element by element
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([0.7]))
        self.register_buffer("beta", torch.tensor(0.3))

    def forward(self, x):
        return self.alpha * x * x.abs() + self.beta * x


class Tempered(nn.Module):  # a scalar parameter, but a softmax over the last dim: refused
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return torch.softmax(x * self.t, -1)


class MaxScaled(nn.Module):  # a width in normalized_shape, but not a norm torch has: refused
    def __init__(self, h):
        super().__init__()
        self.normalized_shape = (h,)

    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True)


def test_weightless_norms_and_scalar_activations_convert_exactly(mesh):
    torch.manual_seed(0)
    serial = nn.Sequential(
        nn.Linear(E, E), Weightless(E), nn.Linear(E, FF), ScaledSquare(), nn.Linear(FF, E), Weightless(E, rms=True)
    )
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert type(parallel[1]) is optimus2d.layers.LayerNorm2D and parallel[1].weight is None
    assert type(parallel[5]) is optimus2d.layers.RMSNorm2D and parallel[5].eps == 1e-6
    assert type(parallel[3]) is ScaledSquare  # whole on every rank, alpha's gradient summed over the mesh
    check_against_serial(serial, parallel, _x(mesh), mesh)  # outputs, input gradients, alpha after a step
    assert parallel[3].alpha.item() != 0.7


def test_lookalikes_of_scalar_activations_and_weightless_norms_are_refused(mesh):
    model = nn.Sequential(nn.Linear(E, E), Tempered(), MaxScaled(E), nn.Linear(E, E))
    with pytest.raises(TypeError) as err:
        parallelize(model, mesh)
    text = str(err.value)
    assert "2 module(s) cannot be converted" in text
    assert "1 (Tempered): holds t and has no converter" in text
    assert "2 (MaxScaled): is not known to act element by element" in text
    assert type(model[0]) is nn.Linear


class Centered(nn.Module):  # a mean over the batch: the same on each half of the last dim, not of the batch
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Normalized(nn.Module):  # F.normalize over dim 1: the hidden dim of a [b, h] activation
    def forward(self, x):
        return F.normalize(x, dim=1)


def test_leaves_that_mix_the_batch_or_the_hidden_dim_of_two_dim_inputs_are_refused(mesh):
    """The probe took halves of the last dim of a ``[rows, 3, 8]`` input: a mean over the batch, a
    softmax or a norm over dim 1 (the hidden dim of a ``[b, h]`` activation) passed, 0.2-0.7 off.
    Halves of the first dim too, and of ``[rows, 8]``: refused, by name, in eval and in training."""
    leaves = {"Centered": Centered(), "Normalized": Normalized(), "LogSoftmax": nn.LogSoftmax(dim=1),
              "Softmax": nn.Softmax(dim=-2)}  # fmt: skip
    for training in (False, True):
        model = nn.Sequential(nn.Linear(E, E), *leaves.values(), nn.Linear(E, E)).train(training)
        with pytest.raises(TypeError, match=r"4 module\(s\) cannot be converted") as err:
            parallelize(model, mesh)
        for n, name in enumerate(leaves, 1):
            assert f"{n} ({name}): is not known to act element by element" in str(err.value)
    torch.manual_seed(0)  # what acts element by element on any input still converts, exactly
    serial = nn.Sequential(nn.Linear(E, E), Square(), nn.GELU(approximate="tanh"), nn.Linear(E, E))
    check_against_serial(serial, parallelize(copy.deepcopy(serial), mesh), _x(mesh)[:, 0], mesh)
