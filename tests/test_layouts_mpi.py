"""``parallelize(..., plan=)``: a module on its own mesh over the same ranks, the tensors crossing
its boundary moved by ``redistribute``. Every pair of mesh shapes of the world (4: 2×2 and 1×1×4;
8: 2×2×2 and 1×1×8; 9: 3×3 and 1×1×9) as (model mesh, encoder mesh): outputs, input gradients
and one AdamW step equal to serial."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import meshes_of
from helpers import assert_close, assert_state_close, check_against_serial
from torch import nn

import optimus2d
from optimus2d import count_comm, parallelize, scatter, serial_state_dict

pytestmark = pytest.mark.mpi


def _layer(width: int) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(width, 6, 2 * width, dropout=0.0, batch_first=True)


class EncoderProjectorLM(nn.Module):
    """A small multimodal shape: an encoder, a projector to the LM's width, the LM."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(_layer(24), 1, enable_nested_tensor=False)
        self.proj = nn.Linear(24, 36)
        self.lm = nn.TransformerEncoder(_layer(36), 1, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.proj(self.encoder(x)))


def _serial(frozen: bool = False) -> EncoderProjectorLM:
    torch.manual_seed(0)
    model = EncoderProjectorLM().double()
    model.encoder.requires_grad_(not frozen)
    return model


def _input(world) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(world.size, 3, 24, dtype=torch.float64)


def test_every_pair_exact(world):
    x = _input(world)
    for model_mesh, encoder_mesh in itertools.product(meshes_of(world), repeat=2):
        serial = _serial()
        parallel = parallelize(copy.deepcopy(serial), model_mesh, plan={"encoder": encoder_mesh})
        assert parallel.encoder.layers[0].linear1.mesh is encoder_mesh
        assert parallel.lm.layers[0].linear1.mesh is model_mesh and parallel.proj.mesh is model_mesh
        check_against_serial(serial, parallel, x, model_mesh, tol=1e-5, optimizer=torch.optim.AdamW)


def test_glob_keys_and_the_innermost_wins(world):
    meshes = meshes_of(world)
    outer, inner = meshes[0], meshes[-1]
    serial = _serial()
    parallel = parallelize(copy.deepcopy(serial), outer, plan={"*": inner, "lm": outer, "lm.layers.*": inner})
    assert parallel.encoder.layers[0].linear1.mesh is inner and parallel.proj.mesh is inner  # a Linear2D's boundary
    assert parallel.lm.layers[0].linear1.mesh is inner and parallel.lm.norm is None
    if outer is not inner:  # "*" names the model's children, not the model itself
        assert "_optimus2d_boundary" not in vars(parallel) and "_optimus2d_boundary" in vars(parallel.proj)
    x = _input(world)
    check_against_serial(serial, parallel, x, outer, tol=1e-9)


def test_the_most_specific_key_wins_so_a_glob_has_exceptions(world):
    """``{"[el]*.layers.0": inner, "lm.layers.0": outer}``: the longer glob took lm.layers.0 and the
    exception was refused as naming no module. A key without globs in more atoms wins now; a glob
    whose every module another key takes is named with them."""
    meshes = meshes_of(world)
    outer, inner = meshes[0], meshes[-1]
    serial = _serial()
    parallel = parallelize(copy.deepcopy(serial), outer, plan={"[el]*.layers.0": inner, "lm.layers.0": outer})
    assert parallel.encoder.layers[0].linear1.mesh is inner and parallel.lm.layers[0].linear1.mesh is outer
    check_against_serial(serial, parallel, _input(world), outer, tol=1e-9)
    with pytest.raises(ValueError, match=r"at 'pro\*' \('pro\*' names only proj \(given 'proj'\), each given a"):
        parallelize(_serial(), outer, plan={"pro*": inner, "proj": outer})


def test_a_module_planned_back_on_the_models_mesh_inside_another(world):
    """``{"lm": inner, "lm.layers.*": model_mesh}``: the layers were converted on ``inner`` (their
    parent's) while their boundary moved their input to the model's mesh: the first forward raised."""
    meshes = meshes_of(world)
    outer, inner = meshes[0], meshes[-1]
    serial = _serial()
    parallel = parallelize(copy.deepcopy(serial), outer, plan={"lm": inner, "lm.layers.*": outer})
    assert parallel.lm.layers[0].linear1.mesh is outer and parallel.lm.norm is None
    check_against_serial(serial, parallel, _input(world), outer, tol=1e-9)


def test_plan_refusals(world):
    mesh = meshes_of(world)[0]
    with pytest.raises(ValueError, match=r"plan= names no module of the model at 'vision'"):
        parallelize(_serial(), mesh, plan={"vision": mesh})
    with pytest.raises(TypeError, match="plan= maps module paths"):
        parallelize(_serial(), mesh, plan={"encoder": (2, 2)})


class _Twice(nn.Module):
    """One Linear at two paths, ``a.0`` and ``b.0``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared, act = nn.Linear(12, 12).double(), nn.GELU()  # the GELU holds no tensors: on any mesh
        self.a, self.b = nn.Sequential(shared, act), nn.Sequential(shared, nn.Tanh(), act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_module_at_two_paths_on_two_meshes_is_refused_and_on_one_is_exact(world):
    """Planned onto another mesh at one path and not at the other, a module would be converted for
    one mesh and handed the other's blocks: refused by ``parallelize``, naming both paths; both paths
    under one entry (a glob), or on meshes of one layout, it converts once and is exact."""
    meshes = meshes_of(world)
    if len(meshes) < 2:
        pytest.skip("needs two mesh shapes")
    outer, inner = meshes
    for plan in ({"a": inner}, {"a": inner, "b.0": inner}):  # on two meshes; on one, called from two
        with pytest.raises(ValueError, match=r"reached on two meshes:\n  b.0 \(Linear\): on .*, and is also a.0, on"):
            parallelize(_Twice(), outer, plan=plan)
    for plan in ({"*": inner}, {"a": outer}):
        serial = _Twice()
        parallel = parallelize(copy.deepcopy(serial), outer, plan=plan)
        check_against_serial(serial, parallel, _input(world)[..., :12].contiguous(), outer, tol=1e-9)


class _TiedTables(nn.Module):
    """Two embeddings and a head sharing one table (as BART's encoder, decoder and LM head do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        first, second = nn.Embedding(18, 12).double(), nn.Embedding(18, 12).double()  # 18: q = 2, 3 divide it
        second.weight = first.weight
        self.a = nn.Sequential(first, nn.Linear(12, 12).double())
        self.b = nn.Sequential(second, nn.Linear(12, 12).double())
        self.head = nn.Linear(12, 18, bias=False).double()
        self.head.weight = first.weight

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.a(ids)), self.b(ids)


def test_a_tensor_tied_across_two_meshes_is_refused_and_on_one_is_exact(world):
    """A table shared by modules the plan puts on meshes of different layouts would be split for one
    and handed, as blocks of the wrong shape, to the other (an id below the block's rows looked up
    the wrong block): refused, naming each holder; every holder on one mesh, it is exact."""
    from optimus2d import gather, scatter_batch

    meshes = meshes_of(world)
    if len(meshes) < 2:
        pytest.skip("needs two mesh shapes")
    outer, inner = meshes
    for plan in ({"a": inner}, {"b": inner}, {"head": inner}):
        with pytest.raises(ValueError, match=r"reached on two meshes:\n  \S+\.weight \((Embedding|Linear)'s weight\)"):
            parallelize(_TiedTables(), outer, plan=plan)
    serial = _TiedTables()
    parallel = parallelize(copy.deepcopy(serial), outer, plan={"*": inner})
    ids = torch.randint(0, 10, (4 * outer.size, 8))
    want = serial(ids)
    probes = [torch.randn_like(t) for t in want]
    sum((t * p).sum() for t, p in zip(want, probes, strict=True)).backward()
    got = parallel(scatter_batch(ids, outer))
    sum((t * scatter(p, outer)).sum() for t, p in zip(got, probes, strict=True)).backward()
    for model in (serial, parallel):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    for t, w in zip(got, want, strict=True):
        assert_close(gather(t.detach(), outer), w, 1e-9, "output")
    assert_state_close(serial_state_dict(parallel), serial.state_dict(), 1e-9)


def test_a_batch_the_planned_mesh_cannot_divide_is_refused_naming_the_module(world):
    """A batch the model's mesh divides but a planned module's does not: refused on every rank before
    anything is sent, naming the module; the meshes stay usable."""
    meshes = meshes_of(world)
    if len(meshes) < 2:
        pytest.skip("needs two mesh shapes")
    outer, inner = sorted(meshes, key=lambda m: m.depth * m.q)
    b = 2 * outer.depth * outer.q
    if b % (inner.depth * inner.q) == 0:
        b = 3 * outer.depth * outer.q
    parallel = parallelize(_serial(), outer, plan={"encoder": inner})
    with pytest.raises(ValueError, match=r"parallelize: encoder \(on .*\), its input: redistribute: batch dim 0"):
        parallel(scatter(_input(world)[:1].expand(b, -1, -1).contiguous(), outer))
    x = _input(world)
    assert parallel(scatter(x, outer)).shape[0] == x.shape[0] // (outer.depth * outer.q)


def test_clip_grad_norm_over_two_meshes_is_the_serial_norm(world):
    """Parameters on two meshes over the same ranks: each counts its replicas on its own mesh (on
    the mesh given, a replicated LayerNorm weight counted q·q or d times was 30 % off)."""
    meshes = meshes_of(world)
    outer, inner = meshes[0], meshes[-1]
    serial = _serial()
    parallel = parallelize(copy.deepcopy(serial), outer, plan={"encoder": inner})
    x = _input(world)
    serial(x).square().sum().backward()
    parallel(scatter(x, outer)).square().sum().backward()
    want = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
    for mesh in (None, outer, inner):
        assert_close(optimus2d.clip_grad_norm_(parallel.parameters(), 1e9, mesh), want, 1e-9, f"norm on {mesh}")


def test_untagged_input_refused_on_every_rank(world):
    meshes = meshes_of(world)
    if len(meshes) < 2:
        pytest.skip("needs two mesh shapes")
    outer, inner = meshes
    parallel = parallelize(_serial(), outer, plan={"encoder": inner})
    x = scatter(_input(world), outer)
    with pytest.raises(ValueError, match=r"encoder .* receives argument 0 of shape .* whose layout cannot be known"):
        parallel.encoder(x * 1.0)  # a product of plain torch: its layout is not known


def test_frozen_encoder_state(world):
    """A frozen encoder on its own mesh stays frozen and gets no gradient; the rest trains as serial."""
    meshes = meshes_of(world)
    serial = _serial(frozen=True)
    parallel = parallelize(copy.deepcopy(serial), meshes[0], plan={"encoder": meshes[-1]})
    assert not any(p.requires_grad for p in parallel.encoder.parameters())
    x = _input(world)
    check_against_serial(serial, parallel, x, meshes[0], tol=1e-5, optimizer=torch.optim.AdamW)
    assert all(p.grad is None for p in parallel.encoder.parameters())
    assert set(serial_state_dict(parallel)) == set(serial.state_dict())
    with count_comm() as c:  # the model's mesh → the encoder's and back: sent, and no graph recorded
        features = parallel.encoder(scatter(_input(world), meshes[0]))
    assert features.grad_fn is None
    assert (c.count() > 0) == (world.size > 1), c.summary()


def test_autocast_sender_and_receiver_agree(world):
    """Under autocast the encoder's output crosses the boundary in the dtype serial's encoder gives
    (the receiver's buffer takes the sender's, agreed with the shape) and the model stays close to
    serial's autocast."""
    meshes = meshes_of(world)
    torch.manual_seed(0)
    serial = EncoderProjectorLM()
    parallel = parallelize(copy.deepcopy(serial), meshes[0], plan={"encoder": meshes[-1]})
    x = _input(world).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_features = serial(x), serial.encoder(x)
        features = parallel.encoder(scatter(x, meshes[0]))  # moved to the encoder's mesh and back
        got = parallel(scatter(x, meshes[0]))
    assert features.dtype == want_features.dtype and got.dtype == want.dtype
    from optimus2d import gather

    err = (gather(got.float(), meshes[0]) - want.float()).abs().max() / want.float().abs().max()
    assert err < 5e-2, err


class _Attends(nn.Module):
    def __init__(self, average: bool = True) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(12, 6, batch_first=True)
        self.average = average

    def forward(self, x: torch.Tensor):
        return self.attn(x, x, x, average_attn_weights=self.average)


def test_attention_weights_leave_a_planned_module_by_batch(world):
    """``nn.MultiheadAttention``'s weights ``[b, L, S]`` (returned by default) leave a module on
    another mesh shape as the batch tensor they are (they were moved as an activation, their S split:
    0.59 off); per-head weights, which no layout holds, are refused on every rank."""
    torch.manual_seed(1)
    x = torch.randn(world.size, 3, 12, dtype=torch.float64)
    torch.manual_seed(0)
    serial = _Attends().double()
    out_ref, weights_ref = serial(x)
    for outer, inner in itertools.permutations(meshes_of(world), 2):
        parallel = parallelize(copy.deepcopy(serial), outer, plan={"attn": inner})
        out, weights = parallel(scatter(x, outer))
        assert_close(optimus2d.gather(out.detach(), outer), out_ref, 1e-9, "output")
        assert_close(weights.detach(), optimus2d.scatter_batch(weights_ref.detach(), outer), 1e-9, "weights")
        per_head = copy.deepcopy(serial)
        per_head.average = False
        parallel = parallelize(per_head, outer, plan={"attn": inner})
        with pytest.raises(ValueError, match="per-head weights"):
            parallel(scatter(x, outer))
    if world.size > 1:  # in 1D: the whole weights leave cut by batch
        from optimus2d.megatron import Megatron

        outer, h = meshes_of(world)[0], 2 * world.size
        torch.manual_seed(0)
        serial.attn = nn.MultiheadAttention(h, world.size, batch_first=True).double()  # a head a rank
        x = torch.randn(world.size, 3, h, dtype=torch.float64)
        out_ref, weights_ref = serial(x)
        parallel = parallelize(copy.deepcopy(serial), outer, plan={"attn": Megatron(outer)})
        out, weights = parallel(scatter(x, outer))
        assert_close(optimus2d.gather(out.detach(), outer), out_ref, 1e-9, "output in 1D")
        assert_close(weights.detach(), optimus2d.scatter_batch(weights_ref.detach(), outer), 1e-9, "weights in 1D")


def test_attention_weights_gradient_is_the_sum_of_the_rows_replicas(world):
    """The averaged weights are a batch block held by a row's q ranks; their boundaries (a plan's
    ``redistribute``, ``io="whole"``'s gather) hand a block's gradient to one holder, as every batch
    block's: the weights' backward sums the row's (it took each rank's own: the in-projection's
    gradient through the weights 1.0 off on 2×2 with ``io="whole"``)."""
    from helpers import assert_grads_like_serial

    torch.manual_seed(1)
    x = torch.randn(world.size, 3, 12, dtype=torch.float64)
    probe_o, probe_w = torch.randn(world.size, 3, 12, dtype=torch.float64), torch.rand(world.size, 3, 3).double()
    torch.manual_seed(0)
    serial = _Attends().double()
    out, weights = serial(x)
    ((out * probe_o).sum() + (weights * probe_w).sum()).backward()
    for outer, inner in [(m, m) for m in meshes_of(world)] + list(itertools.permutations(meshes_of(world), 2)):
        model = copy.deepcopy(serial)
        model.zero_grad()
        parallel = parallelize(model, outer, plan={"attn": inner}, io="whole")
        out, weights = parallel(x)
        ((out * probe_o).sum() + (weights * probe_w).sum()).backward()
        assert_grads_like_serial(serial, parallel, inner, 1e-9)
    if world.size > 1:  # in 1D the weights are whole, all-reduced over the mesh: they leave it cut by batch
        from optimus2d.megatron import Megatron

        outer, h = meshes_of(world)[0], 2 * world.size
        torch.manual_seed(0)
        serial.attn = nn.MultiheadAttention(h, world.size, batch_first=True).double()
        x, probe_o = torch.randn(world.size, 3, h).double(), torch.randn(world.size, 3, h).double()
        serial.zero_grad()
        out, weights = serial(x)
        ((out * probe_o).sum() + (weights * probe_w).sum()).backward()
        parallel = parallelize(copy.deepcopy(serial), outer, plan={"attn": Megatron(outer)}, io="whole")
        parallel.zero_grad()
        out, weights = parallel(x)
        ((out * probe_o).sum() + (weights * probe_w).sum()).backward()
        assert_grads_like_serial(serial, parallel, outer, 1e-9)


class _Masked(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        return self.attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0]


def test_a_learned_mask_given_whole_gets_its_whole_gradient(world):
    """A float ``attn_mask`` or ``key_padding_mask`` that needs a gradient (a bias learned outside the
    model), given whole: each rank uses its batch block and heads of it, and every rank's gradient is
    the sum of theirs, in 2D and in a 1D region (each rank's was its own part: 0.4-1.2 off)."""
    from optimus2d.megatron import Megatron

    width, heads, b, s = 2 * world.size, world.size, 2 * world.size, 4
    torch.manual_seed(0)
    serial = _Masked(width, heads).double()
    x, probe = torch.randn(b, s, width).double(), torch.randn(b, s, width).double()
    masks = {"attn_mask": torch.randn(s, s).double(), "key_padding_mask": torch.randn(b, s).double()}
    for name, mask in masks.items():
        want = mask.clone().requires_grad_()
        (serial(x, **{name: want}) * probe).sum().backward()
        for mesh in meshes_of(world):
            for plan, io in ((None, "whole"), (None, "blocks"), ({"attn": Megatron(mesh)}, "whole")):
                parallel = parallelize(copy.deepcopy(serial), mesh, plan=plan, io=io)
                got = mask.clone().requires_grad_()
                if io == "whole":
                    (parallel(x, **{name: got}) * probe).sum().backward()
                else:
                    out = parallel(scatter(x, mesh), **{name: got})
                    (out * scatter(probe, mesh)).sum().backward()
                assert_close(got.grad, want.grad, 1e-9, f"{name}'s gradient, {plan}, io={io}, on {mesh}")


def test_per_target_losses_moved_by_a_boundary_keep_their_gradient(world):
    """``cross_entropy(reduction="none")`` gives a batch block each rank of a row takes the whole
    gradient of (a loss computed alike from it); moved whole (``to_whole``) or to another mesh
    shape (``redistribute``), the logits' gradient is serial's (the boundaries handed the gradient to
    one replica: the others' vocabulary columns got none, 1.0 off on 2×2); used where they are, as before."""
    import torch.nn.functional as F

    from optimus2d.comm.whole import to_whole

    torch.manual_seed(0)
    b, s, vocab = 2 * world.size, 3, 6 * world.size
    logits, weight = torch.randn(b, s, vocab, dtype=torch.float64), torch.randn(b, s, dtype=torch.float64)
    target = torch.randint(0, vocab, (b, s))
    ref_logits = logits.clone().requires_grad_()
    (F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction="none").view(b, s) * weight).sum().backward()
    for src, dst in [(m, m) for m in meshes_of(world)] + list(itertools.permutations(meshes_of(world), 2)):
        for how in ("where they are", "whole", "moved"):
            full = logits.clone().requires_grad_()
            per = optimus2d.cross_entropy(
                scatter(full, src), optimus2d.scatter_batch(target, src), src, reduction="none"
            )
            if how == "where they are":
                (per * optimus2d.scatter_batch(weight, src)).sum().backward()
            elif how == "whole":
                (to_whole(per, src, "batch") * weight).sum().backward()
            else:  # on dst, then whole there
                (to_whole(optimus2d.redistribute(per, src, dst), dst, "batch") * weight).sum().backward()
            assert_close(full.grad, ref_logits.grad, 1e-9, f"logits gradient, {how}, {src} to {dst}")


def test_hidden_states_of_a_planned_module_leave_the_model_as_a_tuple_with_their_graph(world):
    """A planned module's hidden states are moved when read inside the model (LLaVA reads one of its
    tower's): a first read under ``no_grad`` (a statistic) keeps the graph of the later ones (it kept
    none: the module's gradient 0.86 off); they leave the model a tuple, moved in its forward (a
    ``MovedOnRead``: ``torch.stack`` of it failed, and a read on one rank alone waited forever)."""
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(12, 12), nn.Linear(12, 12)

        def forward(self, x):
            a = self.l1(x)
            b = self.l2(a)
            return modeling_outputs.BaseModelOutput(last_hidden_state=b, hidden_states=(x, a, b))

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.head = Enc(), nn.Linear(12, 12)

        def forward(self, x):
            o = self.enc(x)
            with torch.no_grad():
                self.stat = o.hidden_states[1].norm()  # a statistic first
            out = self.head(o.last_hidden_state) + o.hidden_states[1]
            return modeling_outputs.BaseModelOutput(last_hidden_state=out, hidden_states=o.hidden_states)

    optimus2d.convert.register_converter(Enc, keep=True)
    optimus2d.convert.register_converter(Top, keep=True)
    torch.manual_seed(1)
    x = torch.randn(world.size, 3, 12, dtype=torch.float64)
    torch.manual_seed(0)
    serial = Top().double()
    for outer, inner in itertools.permutations(meshes_of(world), 2):

        def loss(out, mesh):
            y = out.last_hidden_state + torch.stack(out.hidden_states).sum(0)
            return ((optimus2d.gather(y, mesh) if mesh is not None else y) ** 2).sum()

        reference = copy.deepcopy(serial)
        loss(reference(x), None).backward()
        parallel = parallelize(copy.deepcopy(serial), outer, plan={"enc": inner})
        out = parallel(scatter(x, outer))
        assert isinstance(out.hidden_states, tuple)
        loss(out, outer).backward()
        grads = {k: v.grad for k, v in reference.named_parameters()}
        for name, p in parallel.named_parameters():
            assert_close(p.grad, grads[name], 1e-9, name)
        if outer.rank == outer.ranks[0]:  # read on one rank alone: nothing left to move
            assert out.hidden_states[0].shape[-1] == 12 // outer.q
