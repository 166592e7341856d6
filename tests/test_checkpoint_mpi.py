"""Checkpoints move between meshes (2×2 ⇄ 3×3 ⇄ 2×2×2 ⇄ one process) with nothing lost."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import optimus2d
from optimus2d import checkpoint, scatter, scatter_batch, serial_state_dict

pytestmark = pytest.mark.mpi

E, HEADS, VOCAB, SEQ = 12, 6, 13, 5
SHAPES = [(1, 1), (2, 1), (1, 4), (2, 2), (3, 1)]  # (q, depth) on the first depth·q² ranks
_meshes: dict = {}


class Tiny(nn.Module):
    """Embedding (padded vocabulary), a transformer block (fused q/k/v), a final norm."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, E)
        self.block = nn.TransformerEncoderLayer(E, HEADS, 2 * E, 0.0, "gelu", batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(E)


def _parallel(seed: int, mesh):
    serial = Tiny(seed)
    model = nn.Module()
    model.emb = optimus2d.layers.Embedding2D.from_serial(serial.emb, mesh)
    model.block = optimus2d.layers.TransformerBlock2D.from_serial(serial.block, mesh)
    model.norm = optimus2d.layers.LayerNorm2D.from_serial(serial.norm, mesh)
    return model


def _loss(model, mesh, step: int):
    torch.manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (12, SEQ))  # 12 divides by every depth·q here
    x = model.norm(model.block(model.emb(scatter_batch(ids, mesh))))
    return optimus2d.cross_entropy(model.emb.attend(x), scatter_batch(ids, mesh), mesh)


def _train(model, optimizer, mesh, steps):
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = _loss(model, mesh, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _mesh(world, shape):
    q, d = shape
    if shape not in _meshes:
        _meshes[shape] = optimus2d.Mesh(q, d, ranks=range(d * q * q))
    return _meshes[shape]


def _pairs(world):
    shapes = [s for s in SHAPES if s[1] * s[0] ** 2 <= world.size]
    return [(a, b) for a, b in itertools.product(shapes, shapes) if a != b] or [(shapes[0], shapes[0])]


def test_checkpoint_moves_between_every_pair_of_meshes(world, shared_dir):
    meshes = {s: _mesh(world, s) for s in SHAPES if s[1] * s[0] ** 2 <= world.size}
    root = shared_dir
    for n, (a, b) in enumerate(_pairs(world)):
        path = os.path.join(root, f"pair{n}")
        mesh_a, mesh_b = meshes[a], meshes[b]
        losses_a = None
        if mesh_a.coord is not None:
            model = _parallel(0, mesh_a)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _train(model, opt, mesh_a, range(2))
            before = serial_state_dict(model)
            checkpoint.save(path, model, opt)
            losses_a = _train(model, opt, mesh_a, range(2, 4))  # the uninterrupted run goes on
        dist.barrier()
        saved = checkpoint.read(path)  # in this process alone: plain tensors, serial keys
        if mesh_a.coord is not None:
            assert set(saved["model"]) == set(before)
            for key, value in before.items():
                assert torch.equal(saved["model"][key], value), key
        shared = [losses_a]
        dist.broadcast_object_list(shared, src=0)  # rank 0 is in every mesh
        if mesh_b.coord is not None:
            model = _parallel(1, mesh_b)  # other weights: the load must replace them all
            opt = torch.optim.AdamW(model.parameters(), lr=0.5)
            checkpoint.load(path, model, opt)
            state = serial_state_dict(model)
            assert opt.param_groups[0]["lr"] == 1e-2
            again = os.path.join(root, f"pair{n}-again")
            checkpoint.save(again, model, opt)
            losses_b = _train(model, opt, mesh_b, range(2, 4))
            if mesh_b.index("mesh") == 0:
                resaved = checkpoint.read(again)
                for key, value in saved["model"].items():
                    assert torch.equal(state[key], value), f"{a}→{b}: {key}"
                for pkey, states in saved["optimizer"].items():
                    for name, value in states.items():
                        assert torch.equal(resaved["optimizer"][pkey][name], value), f"{a}→{b}: {pkey}/{name}"
            for got, want in zip(losses_b, shared[0], strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), f"{a}→{b}: losses {losses_b} vs {shared[0]}"
        dist.barrier()


def test_serial_read_loads_into_torch_nn(world, shared_dir):
    mesh = _mesh(world, (1, 1) if world.size < 4 else (2, 1))
    root = shared_dir
    path = os.path.join(root, "plain")
    if mesh.coord is not None:
        checkpoint.save(path, _parallel(3, mesh))
    dist.barrier()
    want = Tiny(3)
    serial = Tiny(99)
    checkpoint.load(path, serial)  # the plain torch model, fused q/k/v whole: in this process alone
    for (key, got), value in zip(serial.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.equal(got, value), key
    plain = checkpoint.load(path)
    again = Tiny(98)
    again.load_state_dict(plain)
    assert torch.equal(again.block.self_attn.in_proj_weight, want.block.self_attn.in_proj_weight)


def test_a_checkpoint_that_does_not_fit_changes_nothing(world, shared_dir):
    mesh = _mesh(world, (1, 1) if world.size < 4 else (2, 1))
    root = shared_dir
    path = os.path.join(root, "model")
    if mesh.coord is None:
        dist.barrier()
        return
    model = _parallel(0, mesh)
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, mesh, range(1))
    checkpoint.save(path, model, opt)

    other = _parallel(5, mesh)
    before = [p.clone() for p in other.parameters()]
    other.extra = optimus2d.layers.Linear2D(E, E, mesh=mesh)  # another architecture
    with pytest.raises(
        ValueError, match=r"does not fit this model: missing \['model\.extra\.bias', 'model\.extra\.weight'\]"
    ):
        checkpoint.load(path, other)
    del other.extra
    with pytest.raises(ValueError, match="holds AdamW optimizer state, not SGD"):
        checkpoint.load(path, other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="no readable checkpoint"):
        checkpoint.load(os.path.join(root, "nowhere"), other)
    dist.barrier(group=mesh.group("mesh")) if mesh.size > 1 else None
    shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    if mesh.index("mesh") == 0:  # truncate one shard file
        with open(os.path.join(path, shard), "r+b") as f:
            f.truncate(16)
    dist.barrier(group=mesh.group("mesh")) if mesh.size > 1 else None
    with pytest.raises(RuntimeError, match="could not read"):
        checkpoint.load(path, other)
    dist.barrier(group=mesh.group("mesh")) if mesh.size > 1 else None
    if mesh.index("mesh") == 0:  # and now a shard file that is not there at all
        os.remove(os.path.join(path, shard))
    dist.barrier(group=mesh.group("mesh")) if mesh.size > 1 else None
    with pytest.raises(RuntimeError, match="could not read"):
        checkpoint.load(path, other)
    for p, b in zip(other.parameters(), before, strict=True):
        assert torch.equal(p, b)
    dist.barrier()


def test_single_rank_scatter_is_plain(world):
    mesh = _mesh(world, (1, 1))
    if mesh.coord is not None:
        x = torch.randn(2, 3, 4)
        assert torch.equal(scatter(x, mesh), x)


class TiedShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, E)
        self.mix = nn.Linear(E, E)
        self.twice = nn.Sequential(self.mix, nn.GELU(), self.mix)
        self.head = nn.Linear(E, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def loss(self, ids, mesh):
        logits = self.head(self.twice(self.emb(ids)))
        return optimus2d.cross_entropy(logits, ids, mesh)


def test_tied_and_shared_model_with_sgd_momentum_moves_to_one_process(world, shared_dir):
    big = max((s for s in SHAPES if s[1] * s[0] ** 2 <= world.size), key=lambda s: s[1] * s[0] ** 2)
    mesh, single = _mesh(world, big), _mesh(world, (1, 1))
    path = os.path.join(shared_dir, "tied")
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (12, SEQ))
    if mesh.coord is not None:
        model = optimus2d.parallelize(TiedShared(), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            model.loss(scatter_batch(ids, mesh), mesh).backward()
            opt.step()
        before = serial_state_dict(model)
        checkpoint.save(path, model, opt)
    dist.barrier()
    if single.coord is not None:
        model = optimus2d.parallelize(TiedShared(), single)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
        checkpoint.load(path, model, opt)
        assert model.head.weight is model.emb.weight
        state = serial_state_dict(model)
        for key, value in before.items():
            assert torch.equal(state[key], value), key
        assert opt.param_groups[0]["momentum"] == 0.9
        momentum = {id(p): s["momentum_buffer"] for p, s in opt.state.items()}
        assert len(momentum) == 3  # embedding/head (one tensor), mix weight, mix bias
    dist.barrier()


def test_fp32_checkpoint_loads_into_a_bf16_model_that_can_step(world, shared_dir):
    mesh = _mesh(world, (1, 1) if world.size < 4 else (2, 1))
    path = os.path.join(shared_dir, "dtype")
    if mesh.coord is not None:
        model = _parallel(0, mesh)
        opt = torch.optim.AdamW(model.parameters())
        _train(model, opt, mesh, range(1))
        checkpoint.save(path, model, opt)
        low = _parallel(0, mesh).to(torch.bfloat16)
        opt_low = torch.optim.AdamW(low.parameters())
        checkpoint.load(path, low, opt_low)
        p = next(iter(low.parameters()))
        assert opt_low.state[p]["exp_avg"].dtype == torch.bfloat16
        assert opt_low.state[p]["step"].device.type == "cpu"
        torch.manual_seed(3)
        ids = torch.randint(0, VOCAB, (12, SEQ))
        loss = optimus2d.cross_entropy(
            low.emb.attend(low.emb(scatter_batch(ids, mesh))), scatter_batch(ids, mesh), mesh
        )
        loss.backward()
        opt_low.step()  # no dtype error
    dist.barrier()


def test_extra_state_is_refused(world, shared_dir):
    class WithExtra(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def get_extra_state(self):
            return {"note": 1}

        def set_extra_state(self, state):
            pass

    with pytest.raises(TypeError, match="extra state"):
        checkpoint.save(os.path.join(shared_dir, "x"), WithExtra())
    # a pipeline whose first stage alone holds it: every stage refuses at once (the others waited for
    # it in DCP's first collective, to the timeout)
    from helpers import raises_fast

    from optimus2d.checkpoint.stages import load_stages, save_stages

    stage = WithExtra() if world.rank == 0 else nn.Linear(2, 2)
    raises_fast(TypeError, "extra state", lambda: save_stages(os.path.join(shared_dir, "stages"), stage))
    checkpoint.save(os.path.join(shared_dir, "whole"), nn.Linear(2, 2)) if world.rank == 0 else None
    dist.barrier() if dist.is_initialized() else None
    raises_fast(ValueError, "extra state", lambda: load_stages(os.path.join(shared_dir, "whole"), stage))


def test_save_and_load_stages_with_one_ranks_optimizer_missing_are_refused(world, shared_dir):
    """``checkpoint.load`` refused it; ``load_stages`` left that rank's blocks' state fresh, and the
    stage's weights parted after one step (1.4e-3). Now refused on every rank, before any read."""
    from collections import OrderedDict

    from helpers import raises_fast, stage_pipe

    from optimus2d.checkpoint.stages import load_stages, save_stages

    if world.size != 4:
        pytest.skip("2 stages of 1×1×2")
    pipe = stage_pipe(2, 1, 2)
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    held = {"0": serial[0], "1": serial[1]} if pipe.stage == 0 else {"2": serial[2]}
    model = optimus2d.parallelize(nn.Sequential(OrderedDict(held)), pipe.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    path = os.path.join(shared_dir, "stages_optimizer")
    given = None if world.rank == 1 else opt
    raises_fast(ValueError, r"some ranks of stage \d+ pass an optimizer and others None",
                lambda: save_stages(path + "_one_none", model, given))  # fmt: skip
    save_stages(path, model, opt)
    raises_fast(ValueError, r"the ranks \[0, 1\] of one stage pass \['no optimizer', 'optimizer AdamW",
                lambda: load_stages(path, model, given))  # fmt: skip


class _Scaled(nn.Module):
    """A Linear beside a 0-d parameter of its own (CLIP's logit_scale), kept as it is
    (``register_converter(keep=True)``): the scale whole on every rank, its gradient summed over
    the mesh."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(E, E)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


optimus2d.convert.register_converter(_Scaled, keep=True)


def _scaled_step(model, optimizer, mesh, step: int) -> None:
    torch.manual_seed(200 + step)
    x, probe = torch.randn(12, SEQ, E, dtype=torch.float64), torch.randn(12, SEQ, E, dtype=torch.float64)
    y = model(x) if mesh is None else optimus2d.gather(model(scatter(x, mesh)), mesh)
    optimizer.zero_grad()
    (y * probe).sum().backward()
    optimizer.step()


def test_a_kept_modules_own_scalar_trains_and_resumes_on_another_mesh(world, shared_dir):
    """A kept module's own 0-d parameter: its gradient is the serial one on every rank (each rank's
    covered its blocks alone: it was never summed, and the ranks drifted apart); its AdamW moments
    come back from a checkpoint as the DTensors the optimizer made (plain tensors: the next step
    failed), and the step after a move to another mesh is the uninterrupted serial one."""
    big = max((s for s in SHAPES if s[1] * s[0] ** 2 <= world.size), key=lambda s: s[1] * s[0] ** 2)
    other = next((s for s in ((1, 4), (2, 1), (1, 1)) if s != big and s[1] * s[0] ** 2 <= world.size), big)
    serial = _Scaled().double()
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    for step in range(3):
        _scaled_step(serial, opt, None, step)
        if step == 0:
            first = serial.scale.grad.clone()
    path = os.path.join(shared_dir, "scaled")
    mesh = _mesh(world, big)
    if mesh.coord is not None:
        model = optimus2d.parallelize(_Scaled().double(), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _scaled_step(model, opt, mesh, 0)
        grad = model.scale.grad
        assert torch.allclose(grad.to_local() if hasattr(grad, "to_local") else grad, first, rtol=1e-12)
        _scaled_step(model, opt, mesh, 1)
        checkpoint.save(path, model, opt)
    dist.barrier()
    mesh = _mesh(world, other)
    if mesh.coord is not None:
        model = optimus2d.parallelize(_Scaled().double(), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        checkpoint.load(path, model, opt)
        from torch.distributed.tensor import DTensor

        moments = {k: isinstance(v, DTensor) for k, v in opt.state[model.scale].items() if k != "step"}
        assert moments == dict.fromkeys(("exp_avg", "exp_avg_sq"), isinstance(model.scale, DTensor))
        _scaled_step(model, opt, mesh, 2)
        state = serial_state_dict(model)
        for key, value in serial.state_dict().items():
            assert torch.allclose(state[key], value, rtol=1e-10, atol=1e-12), key
    dist.barrier()


def test_a_model_in_1d_alone_saves_and_moves_to_a_mesh(world, shared_dir):
    """A model whose only split is a 1D region (its DTensors over the world, no tensor on a mesh):
    saved (it crashed: no mesh to keep the save's groups on) with its AdamW state, loaded into the
    same model and onto a mesh of the world: the serial tensors as saved."""
    from optimus2d.megatron import Megatron

    if world.size == 1:
        pytest.skip("1D needs two ranks or more")
    big = max((s for s in SHAPES if s[1] * s[0] ** 2 <= world.size), key=lambda s: s[1] * s[0] ** 2)
    mesh = _mesh(world, big)
    if mesh.size != world.size:
        pytest.skip("the mesh does not cover the world")
    torch.manual_seed(0)
    f = 2 * world.size  # divided by the world's ranks in 1D
    serial = nn.Sequential(nn.Sequential(nn.Linear(E, f), nn.GELU(), nn.Linear(f, E))).double()
    model = optimus2d.parallelize(serial, mesh, plan={"0": Megatron(mesh)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    model(scatter(torch.randn(12, SEQ, E, dtype=torch.float64), mesh)).sum().backward()
    opt.step()
    path = os.path.join(shared_dir, "in_1d")
    checkpoint.save(path, model, opt)
    before = serial_state_dict(model)
    for plan in ({"0": Megatron(mesh)}, None):
        torch.manual_seed(2)
        fresh = nn.Sequential(nn.Sequential(nn.Linear(E, f), nn.GELU(), nn.Linear(f, E))).double()
        other = optimus2d.parallelize(fresh, mesh, plan=plan)
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        checkpoint.load(path, other, other_opt)
        state = serial_state_dict(other)
        for key, value in before.items():
            assert torch.equal(state[key], value), (plan, key)
        assert len(other_opt.state) == 4


class _Tied(nn.Module):
    """A table of 12 rows (q = 2, 3 divide it) and the head that is it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, E)
        self.head = nn.Linear(E, 12, bias=False)
        self.head.weight = self.emb.weight


def test_an_untied_checkpoint_into_a_tied_model_is_refused_on_every_rank(world, shared_dir):
    """A model whose head is its embedding, given a checkpoint that holds the two apart with other
    values (an untied model's; here its first row only, which one block holds): refused on every
    rank, nothing changed (the last key's values won, silently); the same values apart load as
    one tensor."""
    big = max((s for s in SHAPES if s[1] * s[0] ** 2 <= world.size), key=lambda s: s[1] * s[0] ** 2)
    mesh = _mesh(world, big)
    if mesh.coord is None:
        return
    for shift, refused in ((1.0, True), (0.0, False)):
        untied = _Tied()
        head = untied.emb.weight.detach().clone()
        head[0] += shift
        untied.head.weight = nn.Parameter(head)
        path = os.path.join(shared_dir, f"untied{shift}")
        checkpoint.save(path, optimus2d.parallelize(untied, mesh))
        model = optimus2d.parallelize(_Tied(), mesh)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # not the checkpoint's
        before = serial_state_dict(model)
        if refused:
            with pytest.raises(ValueError, match=r"ties emb.weight and head.weight .* nothing was loaded"):
                checkpoint.load(path, model)
            state = serial_state_dict(model)
            assert all(torch.equal(state[k], v) for k, v in before.items())
        else:
            checkpoint.load(path, model)
            assert torch.equal(serial_state_dict(model)["emb.weight"], _Tied().emb.weight.detach())
        assert model.head.weight is model.emb.weight
