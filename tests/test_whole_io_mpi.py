"""``parallelize(..., io="whole")``: a model that takes its inputs whole on every rank and gives its
outputs whole (``convert/whole_io.py``), as torch's ``parallelize_module`` takes and gives them.

Against the real torch classes: outputs, input gradients and one AdamW step equal to serial on
every mesh shape of the world (4: 2×2 and 1×1×4; 8: 2×2×2 and 1×1×8; 9: 3×3 and 1×1×9), with the
model on its mesh, a module in 1D, a module on another mesh shape, frozen and trained. A model that
is one 1D region sends exactly torch's own collectives for it (as torch dispatches them) and none
of optimus2d's; a model on a mesh sends one all-gather of its output forward and nothing for its
input. Refusals on every rank before anything is sent."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import meshes_of
from helpers import assert_close, assert_state_close
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import optimus2d
from optimus2d import Auto, count_comm, parallelize, scatter, serial_state_dict
from optimus2d.convert import register_converter
from optimus2d.megatron import Megatron

pytestmark = pytest.mark.mpi


class Holder(nn.Module):
    """One MLP, the model's only module (in 1D, the whole model is its region)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class EncoderProjector(nn.Module):
    """An MLP encoder (planned: 1D or another mesh shape), a norm and a projector on the model's mesh."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.encoder(x)))


def _step_whole(
    serial: nn.Module, parallel: nn.Module, x: torch.Tensor, tol: float = 1e-9, forward=None, what: str = ""
) -> None:
    """fwd+bwd+AdamW step of both on the same whole input (``forward(model, x)``, default
    ``model(x)``): the parallel output whole on this rank, the input's gradient whole, the parameters
    after the step, all equal to serial's."""
    forward = forward or (lambda model, x: model(x))
    x_serial, x_whole = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_serial = forward(serial, x_serial)
    torch.manual_seed(2)
    probe = torch.randn_like(y_serial)
    (y_serial * probe).sum().backward()
    y = forward(parallel, x_whole)
    assert getattr(y, "_optimus2d_layout", None) is None  # whole: no block of any mesh
    assert_close(y.detach(), y_serial, tol, f"{what} output")
    (y * probe).sum().backward()
    assert_close(x_whole.grad, x_serial.grad, tol, f"{what} input grad")
    for model in (serial, parallel):
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    assert_state_close(serial_state_dict(parallel), serial.state_dict(), tol)


class TorchCollectives(TorchDispatchMode):
    """Every collective torch dispatches (DTensor's, torch.distributed's), as (op, elements) in order.
    (torch's ``CommDebugMode`` would do, but its module tracker wraps a module's inputs in new tensors,
    which drops the layouts optimus2d notes on them.)"""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d_functional", "c10d") and "wait" not in func.__name__:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.sent.append((func.__name__, first.numel() if first is not None else 0))
        return func(*args, **(kwargs or {}))


def _serial(cls, world, frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = cls(6 * world.size).double()
    if frozen:
        next(iter(model.children())).requires_grad_(False)
    return model


def _x(world) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64)


def test_a_model_in_1d_is_exact_and_sends_only_what_torch_sends(world):
    """The whole model one 1D region: its input taken whole, its output given whole, so nothing of
    optimus2d's is sent; torch's collectives the same as ``parallelize_module`` of the same MLP."""
    x = _x(world)
    for mesh in meshes_of(world):
        serial = _serial(Holder, world)
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"inner": Megatron(mesh)}, io="whole")
        _step_whole(serial, parallel, x)
        ours, theirs = TorchCollectives(), TorchCollectives()
        with count_comm() as sent, ours:
            parallel(x.clone().requires_grad_()).sum().backward()
        assert sent.records == []
        if world.size == 1:
            continue
        from torch.distributed.device_mesh import init_device_mesh

        styles = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        torch_model = parallelize_module(copy.deepcopy(serial.inner), init_device_mesh("cpu", (world.size,)), styles)
        with theirs:
            torch_model(x.clone().requires_grad_()).sum().backward()
        assert ours.sent == theirs.sent and len(ours.sent) >= 2  # an all-reduce each way at least


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_models_on_meshes_with_a_planned_module_are_exact(world, frozen):
    """The encoder in 1D, on the other mesh shape, or not planned; the rest on the model's mesh."""
    x = _x(world)
    meshes = meshes_of(world)
    for mesh in meshes:
        other = meshes[-1] if mesh is meshes[0] else meshes[0]
        for plan in ({"encoder": Megatron(mesh)}, {"encoder": other}, None):
            serial = _serial(EncoderProjector, world, frozen)
            parallel = parallelize(copy.deepcopy(serial), mesh, plan=plan, io="whole")
            _step_whole(serial, parallel, x)


def test_a_model_on_a_mesh_sends_one_all_gather_of_its_output(world):
    """Input: each rank cuts its own block, nothing sent forward, and backward only where the input
    needs a gradient (its blocks' gradients all-gathered: the input's elements); output: one
    all-gather forward (the whole output's elements recorded), nothing backward."""
    if world.size == 1:
        pytest.skip("one rank sends nothing")
    mesh = meshes_of(world)[0]
    parallel = parallelize(_serial(EncoderProjector, world), mesh, io="whole")
    for needs_grad in (False, True):
        x = _x(world).requires_grad_(needs_grad)
        with count_comm() as forward:
            y = parallel(x)
        assert forward.by("kind", "axis")[("all_gather", "mesh")] == y.numel()
        with count_comm() as backward:
            y.sum().backward()
        assert backward.by("kind", "axis").get(("all_gather", "mesh"), 0) == (x.numel() if needs_grad else 0)


def test_a_block_changed_in_place_is_gathered_not_taken_whole(world):
    """A forward that changes its input's block in place before a 1D region: the region must see
    the changed tensor, so it all-gathers the blocks instead of taking the whole input."""

    class Scaled(Holder):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x.mul_(2))

    x = _x(world)
    mesh = meshes_of(world)[0]
    serial = _serial(Scaled, world)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"inner": Megatron(mesh)}, io="whole")
    want = serial(x.clone())
    with count_comm() as sent:
        got = parallel(x.clone())
    assert_close(got.detach(), want.detach(), 1e-9, "output")
    if world.size > 1:
        assert sent.by("kind", "axis")[("all_gather", "mesh")] == x.numel()


def test_refusals_on_every_rank(world):
    """An io= that is neither "blocks" nor "whole", or one that differs between ranks: a ValueError
    on every rank before anything is converted; a block given to a model that takes whole tensors:
    a ValueError naming it, before anything is sent."""
    mesh = meshes_of(world)[0]
    model = _serial(EncoderProjector, world)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"io= is 'blocks'.*got 'replicated'"):
        parallelize(model, mesh, io="replicated")
    if world.size > 1:
        with pytest.raises(ValueError, match="io='whole'"):
            parallelize(model, mesh, io="whole" if world.rank == 0 else "blocks")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    parallel = parallelize(model, mesh, io="whole")
    with count_comm() as sent, pytest.raises(ValueError, match=r"argument 0 of shape .* is a block of a mesh"):
        parallel(scatter(_x(world), mesh))
    assert sent.records == []


class _Weighted(nn.Module):
    """A weight a token, ``[b, s]`` floats: a value per row of the activation, not an activation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * weights.unsqueeze(-1)


class _Packed(_Weighted):
    """The same, its inputs in one dict argument; or (``_Spread``) in ``*args``."""

    def forward(self, batch: dict) -> torch.Tensor:
        return self.lin(batch["x"]) * batch["weights"].unsqueeze(-1)


class _Spread(_Weighted):
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.lin(inputs[0]) * inputs[1].unsqueeze(-1)


def test_a_float_argument_of_two_dims_is_declared_or_refused(world):
    """A floating ``[b, s]`` argument whose name says nothing: cut as an activation its s would be
    split over q (and broadcast, silently wrong, where s = q): refused on every rank, naming it,
    before anything is sent; declared (``io={"weights": "batch"}``), exact on every mesh."""
    torch.manual_seed(1)
    b, s, h = 2 * world.size, 2, 6 * world.size
    x, weights = torch.randn(b, s, h, dtype=torch.float64), torch.randn(b, s, dtype=torch.float64)
    for mesh in meshes_of(world):
        torch.manual_seed(0)
        serial = _Weighted(h).double()
        refused = parallelize(copy.deepcopy(serial), mesh, io="whole")
        with (
            count_comm() as sent,
            pytest.raises(ValueError, match=r"weights of shape \(.*\) is a floating tensor of 2"),
        ):
            refused(x, weights)
        assert sent.records == []
        parallel = parallelize(copy.deepcopy(serial), mesh, io={"weights": "batch"})
        assert_close(parallel(x, weights).detach(), serial(x, weights).detach(), 1e-9, "output")
        # inside a container, or past the named parameters: each tensor by its own path, declared alike
        for cls, args, path in ((_Packed, ({"x": x, "weights": weights},), "batch['weights']"),
                                (_Spread, (x, weights), "argument 1")):  # fmt: skip
            torch.manual_seed(0)
            serial = cls(h).double()
            with pytest.raises(ValueError, match=re.escape(f"declare it: io={{{path!r}: 'activation'}}")):
                parallelize(copy.deepcopy(serial), mesh, io="whole")(*args)
            parallel = parallelize(copy.deepcopy(serial), mesh, io={path: "batch"})
            assert_close(parallel(*args).detach(), serial(*args).detach(), 1e-9, f"{cls.__name__} output")
    with pytest.raises(ValueError, match=r"io=\{name: kind\} takes kinds \('batch', 'activation', 'whole'\)"):
        parallelize(_Weighted(h), meshes_of(world)[0], io={"weights": "replicated"})


def test_an_activation_declared_whole_is_refused_by_the_module_taking_it(world):
    """``io={"input": "whole"}`` on the activation: it reaches the first layer as it is, the same on
    every rank. On 2×2 its width did not fit; on 1×1×4 every rank took the whole batch as its block
    (the output ``[4b, s, h]``, no error). Refused by that layer on every rank of every mesh (a mask
    declared whole still goes where masks go: ``test_torch_attention_masks_are_given_whole``)."""
    torch.manual_seed(1)
    x = torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64)
    for mesh in meshes_of(world):
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Linear(x.shape[-1], 12), nn.GELU(), nn.Linear(12, 6)).double()
        parallel = parallelize(copy.deepcopy(serial), mesh, io={"input": "whole"})
        if mesh.size == 1:
            assert_close(parallel(x).detach(), serial(x).detach(), 1e-12, "output")
            continue
        with pytest.raises(ValueError, match=r"Linear2D: its input of shape \[\d+, 3, \d+\] is whole, the same"):
            parallel(x)
        declared = parallelize(copy.deepcopy(serial), mesh, io={"input": "activation"})
        assert_close(declared(x).detach(), serial(x).detach(), 1e-9, "declared an activation")


def test_plan_auto_with_whole_io_is_exact_and_times_its_copies_with_whole_tensors(world):
    """``plan=Auto(measure=step)`` with ``io="whole"``: the copies it times take what the model will
    (whole tensors: a copy taking blocks would refuse ``step``'s whole input), and the pick is exact."""
    x = _x(world)
    mesh = meshes_of(world)[0]
    timed = []

    def step(model: nn.Module) -> None:
        timed.append(model(x).shape)
        model(x).sum().backward()

    auto = Auto(tokens=x.numel() // x.shape[-1], seq=x.shape[1], measure=step, top=4)
    serial = _serial(Holder, world)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan=auto, io="whole")
    assert timed and all(shape == x.shape for shape in timed)  # every copy gave its output whole
    _step_whole(serial, parallel, x)


@pytest.mark.families
@pytest.mark.parametrize("region", [None, "model"], ids=["on-the-mesh", "all-but-head-in-1d"])
def test_llava_takes_its_batch_whole_and_gives_logits_and_loss_whole(world, region):
    """Hugging Face's LLaVA (a CLIP tower, LLaMA) with ``io="whole"``: ids, images, mask and labels
    given whole (the images cut as a batch, not an activation), the logits and the loss given whole,
    one AdamW step: as serial, on every mesh of the world, on the mesh or all but its head in 1D."""
    from test_megatron_mpi import _batch, _llava

    batch = _batch(world.size)
    for mesh in meshes_of(world):
        serial = _llava(world, frozen_tower=True)
        plan = {region: Megatron(mesh)} if region else None
        parallel = parallelize(copy.deepcopy(serial), mesh, plan=plan, io="whole")
        out_ref = serial(**batch)
        out_ref.loss.backward()
        out = parallel(**batch)
        out.loss.backward()
        assert getattr(out.logits, "_optimus2d_layout", None) is None
        assert out.logits.shape == out_ref.logits.shape
        assert_close(out.logits.detach(), out_ref.logits, 1e-4, "logits")
        assert_close(out.loss, out_ref.loss, 1e-5, "loss")
        scale = max(p.grad.abs().max().item() for p in serial.parameters() if p.grad is not None)
        for model in (serial, parallel):
            torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3 * scale).step()
        state = serial_state_dict(parallel)
        for key, value in serial.state_dict().items():
            assert_close(state[key], value, 1e-4, key)


# ---- what taking the whole tensor must not skip or keep --------------------------------------------
class TwoRegions(nn.Module):
    """Two MLPs (each a 1D region), a hook scaling the gradient of the activation between them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.b = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: -0.5 * g)  # a gradient reversal between two modules
        return self.b(h)


register_converter(TwoRegions, keep=True)  # its forward: element-wise on blocks, and a hook


def test_a_hook_on_a_block_between_regions_is_kept(world):
    """The block between two 1D regions carries a gradient hook: the second region must take that
    block (all-gathered), not the whole tensor it was cut from, or the hook is skipped."""
    x = _x(world)
    mesh = meshes_of(world)[0]
    serial = _serial(TwoRegions, world)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"a": Megatron(mesh), "b": Megatron(mesh)}, io="whole")
    _step_whole(serial, parallel, x)


class Stack(nn.Module):
    """Eight MLPs, each a 1D region, with norms on the model's mesh between them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(8)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms, strict=True):
            x = norm(x + layer(x))
        return x


register_converter(Stack, keep=True)  # its forward: a loop of element-wise sums and its children


def test_a_regions_whole_output_is_not_kept_past_its_blocks(world):
    """Each region's whole output is noted on the blocks cut from it, weakly kept by the model's
    call: once those blocks are gone (the norm read them), the whole tensor goes too, as with blocks."""
    import gc
    import weakref

    from optimus2d.convert import layouts

    x = _x(world)
    mesh = meshes_of(world)[0]
    serial = _serial(Stack, world)
    outputs, alive = [], {}
    original = layouts.WholeBoundary._out

    def noted(self, t):
        outputs.append(weakref.ref(t))
        return original(self, t)

    for io in ("blocks", "whole"):
        outputs.clear()
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"layers.*": Megatron(mesh)}, io=io)
        layouts.WholeBoundary._out = noted
        try:
            with torch.no_grad():
                parallel(x if io == "whole" else scatter(x, mesh))
        finally:
            layouts.WholeBoundary._out = original
        gc.collect()
        alive[io] = sum(ref() is not None for ref in outputs)
    assert len(outputs) == 8 and alive == {"blocks": 0, "whole": 0}
    assert_close(parallel(x), serial(x), 1e-9, "output")


# ---- Hugging Face LLaMA: keywords, hidden states, generate ------------------------------------------
def _llama(world):
    transformers = pytest.importorskip("transformers")
    p = world.size
    config = transformers.LlamaConfig(
        vocab_size=72, hidden_size=4 * p, intermediate_size=8 * p, num_hidden_layers=1, num_attention_heads=p,
        num_key_value_heads=p, bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _padded(world) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids [2p, 8] and a float attention mask with the first row padded after 5 tokens."""
    torch.manual_seed(1)
    ids, mask = torch.randint(1, 72, (2 * world.size, 8)), torch.ones(2 * world.size, 8, dtype=torch.float64)
    mask[0, 5:] = 0
    return ids, mask


@pytest.mark.families
@pytest.mark.parametrize("region", [None, "model"], ids=["on-the-mesh", "all-but-head-in-1d"])
def test_llama_float_mask_hidden_states_and_generate_whole(world, region):
    """A float attention mask with padding (a mask by its name: a batch tensor, not an activation),
    the hidden states asked for (whole when read, also those a 1D region gives), ``cache_position``
    (as it is), and ``generate`` (its own hooks cut and gather; ``io="whole"``'s step aside): as serial."""
    mesh = meshes_of(world)[0]
    serial = _llama(world)
    ids, mask = _padded(world)
    s = ids.shape[1]
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={region: Megatron(mesh)} if region else None, io="whole")
    kw = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False,
              cache_position=torch.arange(s))  # fmt: skip
    ref, got = serial(**kw), parallel(**kw)
    assert_close(got.logits.detach(), ref.logits, 1e-6, "logits")
    assert len(got.hidden_states) == len(ref.hidden_states)
    for n, (mine, theirs) in enumerate(zip(got.hidden_states, ref.hidden_states, strict=True)):
        assert getattr(mine, "_optimus2d_layout", None) is None
        assert_close(mine.detach(), theirs, 1e-6, f"hidden state {n}")
    serial.eval(), parallel.eval()
    want = serial.generate(ids[:, :5], max_new_tokens=3, do_sample=False)
    assert torch.equal(parallel.generate(ids[:, :5], max_new_tokens=3, do_sample=False), want)
    out = parallel(input_ids=ids, use_cache=False)  # and after generate, whole again
    assert_close(out.logits.detach(), serial(input_ids=ids, use_cache=False).logits, 1e-6, "logits after generate")


class _LogitsOf(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


@pytest.mark.families
def test_a_causal_lms_whole_logits_have_serials_vocabulary(world):
    """``io="whole"``: a causal LM whose vocabulary (97) the mesh does not divide gives its logits
    ``[b, s, 97]`` as serial, in a ModelOutput and in a tuple after its loss (they kept the padded
    column, which Gemma 2's final soft cap makes −3, not −inf: a softmax over them was off)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=97, hidden_size=8 * world.size, intermediate_size=4 * world.size, num_hidden_layers=1, head_dim=8,
        num_attention_heads=world.size, num_key_value_heads=world.size, final_logit_softcapping=3.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    serial = transformers.Gemma2ForCausalLM(config)
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (2 * world.size, 6))
    ref = serial(input_ids=ids, use_cache=False)
    ref_loss, ref_logits = serial(input_ids=ids, labels=ids, use_cache=False, return_dict=False)[:2]
    for mesh in meshes_of(world):
        parallel = parallelize(copy.deepcopy(serial), mesh, io="whole")
        got = parallel(input_ids=ids, use_cache=False).logits
        assert got.shape == ref.logits.shape, (got.shape, mesh)
        assert_close(got.detach(), ref.logits, 1e-5, f"logits on {mesh}")
        assert_close(got.logsumexp(-1).detach(), ref.logits.logsumexp(-1), 1e-5, f"their softmax on {mesh}")
        loss, logits = parallel(input_ids=ids, labels=ids, use_cache=False, return_dict=False)[:2]
        assert logits.shape == ref_logits.shape and abs(loss.item() - ref_loss.item()) < 1e-5 * ref_loss.item()
        logits = parallelize(_LogitsOf(copy.deepcopy(serial)), mesh, io="whole")(ids)  # the LM inside a model
        assert logits.shape == ref.logits.shape, (logits.shape, mesh)
        assert_close(logits.detach(), ref.logits, 1e-5, f"a wrapper's logits on {mesh}")


def test_plan_auto_prices_whole_io_at_the_models_edges(world):
    """``parallelize(plan="auto", io="whole")`` prices what runs: the 1D row of a wrapper of one MLP
    without its boundary's all-gathers (cheaper than with blocks), a mesh row with its output's."""
    if world.size == 1:
        pytest.skip("one rank: no 1D row")
    from optimus2d.convert import choose_plan

    mesh = meshes_of(world)[0]
    model = _serial(Holder, world)
    auto = Auto(tokens=6 * world.size, seq=3)
    rows = {
        io: {row[0]["inner"]: row[1] for row in choose_plan(model, mesh, auto, io=io)[0].table}
        for io in ("blocks", "whole")
    }
    assert rows["whole"]["1d"] < rows["blocks"]["1d"]
    here = f"{mesh.q}×{mesh.q}×{mesh.depth}"
    assert rows["whole"][here] > rows["blocks"][here]  # its output all-gathered to leave whole


class Pair(TwoRegions):
    """The same two regions, nothing between them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


register_converter(Pair, keep=True)


def test_a_hook_asked_of_a_block_taken_whole_after_the_forward_is_refused(world):
    """A block the next 1D region took whole is out of the backward graph: a gradient hook or
    ``retain_grad`` asked of it after the forward (as a forward hook keeps it) would never fire, so
    it is refused with a message; with ``io="blocks"`` the same hook fires as in serial."""
    if world.size == 1:
        pytest.skip("one rank: the region's block is the whole tensor")
    x = _x(world)
    mesh = meshes_of(world)[0]
    plan = {"a": Megatron(mesh), "b": Megatron(mesh)}
    for io in ("blocks", "whole"):
        parallel = parallelize(_serial(Pair, world), mesh, plan=plan, io=io)
        seen: list[torch.Tensor] = []
        parallel.a.register_forward_hook(lambda module, args, out, seen=seen: seen.append(out))
        parallel(x if io == "whole" else scatter(x, mesh)).sum().backward()
        block = seen[0]
        if io == "blocks":
            block.register_hook(lambda g: g)
            block.retain_grad()
            continue
        with pytest.raises(RuntimeError, match="handed whole to the next module"):
            block.register_hook(lambda g: g)
        with pytest.raises(RuntimeError, match="handed whole to the next module"):
            block.retain_grad()


@pytest.mark.families
def test_llama_positional_float_mask_and_broadcast_position_ids(world):
    """A float mask given by position is cut by its parameter's name (a batch tensor); ``position_ids``
    of one row ``[1, s]`` (Hugging Face's broadcast shape) goes as it is: exact on every rank."""
    mesh = meshes_of(world)[0]
    serial = _llama(world)
    ids, mask = _padded(world)
    s = ids.shape[1]
    parallel = parallelize(copy.deepcopy(serial), mesh, io="whole")
    assert_close(parallel(ids, mask).logits.detach(), serial(ids, mask).logits, 1e-6, "logits, mask by position")
    positions = torch.arange(s)[None]
    got = parallel(input_ids=ids, position_ids=positions).logits.detach()
    assert_close(got, serial(input_ids=ids, position_ids=positions).logits, 1e-6, "logits, positions [1, s]")


class Inner(nn.Module):
    """Two residual MLPs giving their hidden states (a Hugging Face-like output)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.m1 = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.m2 = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutput

        h1 = x + self.m1(x)
        h2 = h1 + self.m2(h1)
        return BaseModelOutput(last_hidden_state=h2, hidden_states=(h1, h2))


class Middle(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner, self.norm = Inner(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutput

        out = self.inner(x)
        return BaseModelOutput(last_hidden_state=self.norm(out.last_hidden_state), hidden_states=out.hidden_states)


class Nested(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mid, self.proj = Middle(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutput

        out = self.mid(x)
        return BaseModelOutput(last_hidden_state=self.proj(out.last_hidden_state), hidden_states=out.hidden_states)


for _cls in (Inner, Middle, Nested):
    register_converter(_cls, keep=True)  # their forwards: children and element-wise work


@pytest.mark.families
@pytest.mark.parametrize("io", ["blocks", "whole"])
def test_hidden_states_of_nested_planned_modules_reach_the_model_mesh(world, io):
    """Hidden states a 1D region gives inside a module on another mesh shape: moved on through each
    boundary when read, to the model's mesh (blocks) or whole (io="whole"), exact."""
    pytest.importorskip("transformers")
    meshes = meshes_of(world)
    mesh, other = meshes[0], meshes[-1]
    serial = _serial(Nested, world)
    x = _x(world)
    plans = [{"mid": other, "mid.inner": Megatron(other)}, {"mid": other}, {"mid.inner": Megatron(mesh)}]
    for plan in plans:
        parallel = parallelize(copy.deepcopy(serial), mesh, plan=plan, io=io)
        got, want = parallel(x if io == "whole" else scatter(x, mesh)), serial(x)
        for mine, theirs in zip(got.hidden_states, want.hidden_states, strict=True):
            if io == "blocks":
                if world.size > 1:  # (one rank: one mesh, no boundary, nothing tagged)
                    assert mine._optimus2d_layout == optimus2d.comm.calls.layout(mesh)
                mine = optimus2d.gather(mine, mesh)
            assert_close(mine.detach(), theirs, 1e-9, f"hidden state, plan {plan}")


def test_a_converted_layer_as_the_whole_model_takes_and_gives_whole_tensors(world):
    """``parallelize(nn.Linear)`` is itself an optimus2d layer (its call checks its inputs first): the
    hooks sit around that check; exact, and its output is no block."""
    x = _x(world)
    for mesh in meshes_of(world):
        torch.manual_seed(0)
        serial = nn.Linear(6 * world.size, 12 * world.size).double()
        parallel = parallelize(copy.deepcopy(serial), mesh, io="whole")
        assert isinstance(parallel, optimus2d.layers.base.ShardedModule)
        _step_whole(serial, parallel, x)


class _Masked(nn.Module):
    """A wrapper whose own ``mask`` reaches torch.nn's encoder as its ``[L, S]`` attention mask."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask=mask)


def test_torch_attention_masks_are_given_whole(world):
    """torch.nn's attention masks (``[L, S]``, ``[b·H, L, S]``: not batch-major alone) reach the
    converted attention whole, by keyword or by position, beside a padding mask cut by batch: exact
    (outputs, input gradients, one AdamW step); a wrapper's own ``mask`` declared
    ``io={"mask": "whole"}`` too (cut by batch, it was refused: it did not fit [L, S])."""
    b, s, h, heads = 2 * world.size, 5, 6 * world.size, 6
    torch.manual_seed(1)
    x = torch.randn(b, s, h, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(s, dtype=torch.float64)
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 3:] = True
    per_head = torch.randn(b * heads, s, s, dtype=torch.float64)
    calls = {
        "keyword [L, S]": lambda m, x: m(x, mask=causal, is_causal=True),
        "positional [L, S] and padding": lambda m, x: m(x, causal, padding),
        "[b·H, L, S]": lambda m, x: m(x, mask=per_head),
    }
    for mesh in meshes_of(world):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(h, heads, 2 * h, dropout=0.0, batch_first=True, dtype=torch.float64)
        serial = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        for what, call in calls.items():
            parallel = parallelize(copy.deepcopy(serial), mesh, io="whole")
            _step_whole(copy.deepcopy(serial), parallel, x, 1e-6, call, what)  # the key bias: a zero gradient
        wrapped = _Masked(copy.deepcopy(serial))
        if mesh.size > 1:  # one rank cuts nothing
            with pytest.raises(
                ValueError, match=r"attn_mask of shape .* does not fit \[L, S\]|\(5, 5\) is not divisible"
            ):
                parallelize(copy.deepcopy(wrapped), mesh, io="whole")(x, causal)
        parallel = parallelize(copy.deepcopy(wrapped), mesh, io={"mask": "whole"})
        _step_whole(wrapped, parallel, x, 1e-6, lambda m, x: m(x, causal), "declared")
