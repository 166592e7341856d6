"""``plan={path: megatron.Megatron(mesh)}``: a module run with Megatron's 1D tensor parallelism over
every rank (torch's ``parallelize_module``), the rest of the model on a 2D/2.5D or data-parallel
mesh; the activation crossing the boundary all-gathered into the whole tensor and split back.
Against the real torch and transformers classes: outputs, input gradients and one AdamW step equal
to serial, frozen and trained, for every mesh shape of the world (4: 2×2 and 1×1×4; 8: 2×2×2 and
1×1×8; 9: 3×3 and 1×1×9); the boundary's traffic exact; refusals on every rank before anything."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import meshes_of
from helpers import assert_close, check_against_serial
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import optimus2d
from optimus2d import count_comm, gather, parallelize, scatter_batch, serial_state_dict
from optimus2d.megatron import Megatron

pytestmark = pytest.mark.mpi


class EncoderProjector(nn.Module):
    """An MLP encoder (the 1D region), a norm and a projector on the model's mesh."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.encoder(x)))


def _serial(world, frozen: bool) -> EncoderProjector:
    torch.manual_seed(0)
    model = EncoderProjector(6 * world.size, 12 * world.size).double()
    model.encoder.requires_grad_(not frozen)
    return model


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_mlp_region_exact_on_every_mesh(world, frozen):
    torch.manual_seed(1)
    x = torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64)
    for mesh in meshes_of(world):
        serial = _serial(world, frozen)
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)})
        first, last = parallel.encoder[0], parallel.encoder[2]
        if world.size > 1:  # one rank: nothing to split
            assert isinstance(first.weight, DTensor) and first.weight.placements == (Shard(0),)
            assert first.weight.to_local().shape == (12, 6 * world.size)  # [out/p, in]
            assert last.weight.placements == (Shard(1),) and last.bias.placements == (Replicate(),)
        assert parallel.proj.mesh is mesh
        check_against_serial(serial, parallel, x, mesh, tol=1e-9, optimizer=torch.optim.AdamW)
        if frozen:
            assert all(p.grad is None for p in parallel.encoder.parameters())


def test_boundary_sends_one_all_gather_each_way(world):
    """Forward: the input's blocks all-gathered (p·|block| elements recorded, the gathered whole);
    backward: the output's gradient blocks all-gathered. A frozen region whose input needs no
    gradient sends nothing backward but torch's own all-reduces (not recorded here)."""
    if world.size == 1:
        pytest.skip("one rank splits nothing")
    mesh = meshes_of(world)[0]
    b, s, h = 2 * world.size, 3, 6 * world.size
    serial = _serial(world, frozen=False)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)})
    x = optimus2d.scatter(torch.randn(b, s, h, dtype=torch.float64), mesh)
    with count_comm() as forward:
        y = parallel(x)
    assert forward.by("kind", "axis")[("all_gather", "mesh")] == b * s * h
    with count_comm() as backward:
        y.sum().backward()
    assert backward.by("kind", "axis")[("all_gather", "mesh")] == b * s * h
    parallel.encoder.requires_grad_(False)
    y = parallel(x)  # x needs no gradient: neither does the frozen region's output
    with count_comm() as frozen:
        y.sum().backward()
    assert frozen.by("kind", "axis")[("all_gather", "mesh")] == 0


def test_clip_grad_norm_of_a_region_alone_asks_for_its_mesh(world):
    if world.size == 1:
        pytest.skip("one rank splits nothing")
    mesh = meshes_of(world)[0]
    parallel = parallelize(_serial(world, frozen=False), mesh, plan={"encoder": Megatron(mesh)})
    parallel(
        optimus2d.scatter(torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64), mesh)
    ).sum().backward()
    with pytest.raises(ValueError, match="pass mesh="):
        optimus2d.clip_grad_norm_(parallel.encoder.parameters(), 1.0)
    torch.manual_seed(0)  # with the mesh: the serial norm of the encoder's gradients
    serial = _serial(world, frozen=False)
    x = torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64)
    serial(x).sum().backward()
    parallel.zero_grad()
    parallel(optimus2d.scatter(x, mesh)).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(serial.encoder.parameters(), 1e9)
    assert_close(optimus2d.clip_grad_norm_(parallel.encoder.parameters(), 1e9, mesh), want, 1e-9, "norm")


def test_serial_state_dict_round_trip(world):
    mesh = meshes_of(world)[-1]
    serial = _serial(world, frozen=False)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)})
    state = serial_state_dict(parallel)
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 0.0, key)
    changed = {key: value + 1 for key, value in serial.state_dict().items()}
    optimus2d.load_serial_state_dict(parallel, changed)
    for key, value in serial_state_dict(parallel).items():
        assert_close(value, changed[key], 0.0, key)


def test_refusals_on_every_rank(world):
    """Sizes the ranks do not divide and dropout that may draw: one ValueError on every rank naming
    every offender, the model unchanged."""
    if world.size == 1:
        pytest.skip("one rank splits nothing")
    mesh = meshes_of(world)[0]
    torch.manual_seed(0)
    model = EncoderProjector(6, 2 * world.size + 1).double()
    model.encoder.insert(2, nn.Dropout(0.1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="1D tensor parallelism") as info:
        parallelize(model, mesh, plan={"encoder": Megatron(mesh)})
    text = str(info.value)
    assert "encoder.0 (Linear): output features" in text and "encoder.2 (Dropout): dropout p=0.1" in text
    assert "encoder.3 (Linear): input features" in text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---- Hugging Face LLaVA: a CLIP tower and LLaMA ------------------------------------------------
IMAGE, SEQ = 95, 10


def _llava(world, frozen_tower: bool, tower_heads: int | None = None):
    """Head counts of the world size (each rank a head of 6 dims), every weight off its init."""
    transformers = pytest.importorskip("transformers")
    p = world.size
    heads = tower_heads or p
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=6 * heads, intermediate_size=12 * p, num_hidden_layers=2, num_attention_heads=heads,
            image_size=16, patch_size=8,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=96, hidden_size=6 * p, intermediate_size=12 * p, num_hidden_layers=1, num_attention_heads=p,
            num_key_value_heads=p, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        ),
        image_token_id=IMAGE, vision_feature_layer=-2, vision_feature_select_strategy="default",
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.model.vision_tower.requires_grad_(not frozen_tower)
    return model


def _batch(b: int):
    torch.manual_seed(1)
    ids, mask = torch.randint(1, IMAGE, (b, SEQ)), torch.ones(b, SEQ, dtype=torch.long)
    for row in range(b):
        ids[row, 1 + row % 4 : 5 + row % 4] = IMAGE
        mask[row, SEQ - row % 3 :] = 0
    labels = ids.masked_fill((ids == IMAGE) | (mask == 0), -100)
    return dict(input_ids=ids, pixel_values=torch.randn(b, 3, 16, 16), attention_mask=mask, labels=labels)


@pytest.mark.families
@pytest.mark.parametrize(
    "region,frozen_tower",
    [("model.vision_tower", True), ("model.vision_tower", False), ("model", True)],
    ids=["tower-frozen", "tower-trained", "all-but-head"],
)
def test_llava_module_in_1d(world, region, frozen_tower):
    """The tower (CLIPAttention, CLIPMLP split), or all of LLaVA but its head (the projector,
    LlamaAttention and LlamaMLP split too), in 1D, the rest on each mesh of the world: logits,
    loss and one AdamW step as serial."""
    batch = _batch(world.size)
    for mesh in meshes_of(world):
        serial = _llava(world, frozen_tower)
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={region: Megatron(mesh)})
        inside = parallel.get_submodule(region)
        split = [m for m in inside.modules() if isinstance(getattr(m, "weight", None), DTensor)]
        assert all(m.weight.device_mesh.size() == world.size for m in split) and (split or world.size == 1)
        out_ref = serial(**batch)
        out_ref.loss.backward()
        out = parallel(**{k: scatter_batch(v, mesh) for k, v in batch.items()})
        out.loss.backward()
        assert_close(gather(out.logits.detach(), mesh)[..., :96], out_ref.logits, 1e-4, "logits")
        assert_close(out.loss, out_ref.loss, 1e-5, "loss")
        if frozen_tower:
            assert all(p.grad is None for p in parallel.model.vision_tower.parameters())
        scale = max(p.grad.abs().max().item() for p in serial.parameters() if p.grad is not None)
        norm_ref = torch.nn.utils.clip_grad_norm_([p for p in serial.parameters() if p.grad is not None], 1e9)
        norm = optimus2d.clip_grad_norm_([p for p in parallel.parameters() if p.grad is not None], 1e9, mesh)
        assert_close(norm, norm_ref, 1e-5, "gradient norm")  # each shard once, each replicated tensor once
        for model in (serial, parallel):
            trained = [p for p in model.parameters() if p.requires_grad]
            torch.optim.AdamW(trained, lr=1e-2, eps=1e-3 * scale).step()
        state = serial_state_dict(parallel)
        for key, value in serial.state_dict().items():
            assert_close(state[key], value, 1e-4, key)


@pytest.mark.families
def test_heads_the_ranks_do_not_divide_are_refused(world):
    if world.size == 1:
        pytest.skip("one rank splits nothing")
    mesh = meshes_of(world)[0]
    model = _llava(world, True, tower_heads=world.size + 1)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        parallelize(model, mesh, plan={"model.vision_tower": Megatron(mesh)})
    text = str(info.value)
    where = "model.vision_tower.encoder.layers.0.self_attn"
    assert f"{where} (CLIPAttention): num_attention_heads = {world.size + 1} not divisible by the {world.size}" in text
    assert f"{where}.q_proj (Linear): output features {6 * (world.size + 1)} not divisible" in text
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


@pytest.mark.families
def test_a_region_module_called_from_outside_is_refused(world):
    """LLaVA calls its language model's ``embed_tokens`` itself, on blocks of its mesh: with the
    language model in 1D that call is refused on every rank, before anything is sent."""
    mesh = meshes_of(world)[-1]
    parallel = parallelize(_llava(world, True), mesh, plan={"model.language_model": Megatron(mesh)})
    batch = {k: scatter_batch(v, mesh) for k, v in _batch(world.size).items()}
    with pytest.raises(ValueError, match=r"model.language_model.embed_tokens \(Embedding\) is inside the 1D region"):
        parallel(**batch)


def test_a_plan_entry_inside_a_region_is_refused(world):
    mesh = meshes_of(world)[0]
    model = _serial(world, frozen=False)
    with pytest.raises(ValueError, match=r"holds no other plan entry: 'encoder.0' inside 'encoder'"):
        parallelize(model, mesh, plan={"encoder": Megatron(mesh), "encoder.0": mesh})


def test_checkpoint_moves_between_meshes_with_a_region(world, shared_dir):
    """Saved with the model on the first mesh (the encoder in 1D), loaded with it on the last: the
    same serial tensors, and AdamW's state goes on stepping exactly."""
    first, last = meshes_of(world)[0], meshes_of(world)[-1]
    torch.manual_seed(3)
    x = torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64)
    trained = parallelize(_serial(world, False), first, plan={"encoder": Megatron(first)})
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    trained(optimus2d.scatter(x, first)).sum().backward()
    opt.step()
    optimus2d.checkpoint.save(f"{shared_dir}/ckpt", trained, opt)
    torch.manual_seed(7)
    fresh = parallelize(
        EncoderProjector(6 * world.size, 12 * world.size).double(), last, plan={"encoder": Megatron(last)}
    )
    opt_fresh = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    optimus2d.checkpoint.load(f"{shared_dir}/ckpt", fresh, opt_fresh)
    for model, mesh, optimizer in ((trained, first, opt), (fresh, last, opt_fresh)):
        optimizer.zero_grad()
        model(optimus2d.scatter(x, mesh)).sum().backward()
        optimizer.step()
    want, got = serial_state_dict(trained), serial_state_dict(fresh)
    for key, value in want.items():
        assert_close(got[key], value, 1e-12, key)


class _Shared(nn.Module):
    """``first`` is also the region's first linear: one module at two paths."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.enc = nn.Sequential(self.first, nn.GELU(), nn.Linear(16, 8))
        self.proj = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.enc(x)) + self.first(x)


class _WeightedActivation(nn.Module):
    """An MLP whose activation has a weight (``nn.PReLU``), taught to split as fc1 → fc2."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 2 * width), nn.PReLU(), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_modules_split_where_they_could_be_wrong_are_refused(world):
    """A module of the region reachable outside it, and an activation with a weight inside a split
    module (it would see one shard and get a part of its gradient): refused, nothing changed."""
    from optimus2d.megatron import plans, register_split

    mesh = meshes_of(world)[0]
    with pytest.raises(ValueError, match=r"first \(Linear\): is also enc.0, inside a 1D region"):
        parallelize(_Shared(), mesh, plan={"enc": Megatron(mesh)})
    register_split(_WeightedActivation, {"fc1": "colwise", "fc2": "rowwise"})
    try:
        holder = nn.Sequential(_WeightedActivation(4 * world.size))
        with pytest.raises(ValueError, match=r"0.act \(PReLU\): holds weight and would run on this rank's shard"):
            parallelize(holder, mesh, plan={"0": Megatron(mesh)})
    finally:
        del plans.SPLITS[f"{_WeightedActivation.__module__}.{_WeightedActivation.__qualname__}"]


class _Centered(nn.ReLU):
    """A subclass of an element-wise class whose forward mixes the last dim: not element-wise."""

    def forward(self, x):
        return x - x.mean(-1, keepdim=True)


def test_only_what_acts_element_by_element_runs_on_a_shard(world):
    """Between the two linears of a split, an activation must act element by element. A subclass of
    an element-wise class with a forward of its own is not trusted: a Sequential around it runs
    replicated (exact), torch's layer given it is refused, with the same text on every rank (a
    function's address is not in it). Functions known to act element by element (F.silu) split."""
    mesh = meshes_of(world)[0]
    p = world.size
    torch.manual_seed(1)
    x = torch.randn(2 * p, 3, 6 * p, dtype=torch.float64)
    serial = _serial(world, frozen=False)
    serial.encoder[1] = _Centered()
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)})
    assert all(set(getattr(t, "placements", (Replicate(),))) == {Replicate()} for t in parallel.encoder.parameters())
    check_against_serial(serial, parallel, x, mesh, tol=1e-9, optimizer=torch.optim.AdamW)

    twice = _serial(world, frozen=False)  # one Linear at both ends: not a split (it runs replicated), exact
    twice.encoder = nn.Sequential(nn.Linear(6 * p, 6 * p), nn.GELU()).double()
    twice.encoder.append(twice.encoder[0])
    parallel = parallelize(copy.deepcopy(twice), mesh, plan={"encoder": Megatron(mesh)})
    check_against_serial(twice, parallel, x, mesh, tol=1e-9, optimizer=torch.optim.AdamW)

    def layer(activation) -> nn.Module:
        torch.manual_seed(0)
        made = nn.TransformerEncoderLayer(6 * p, p, 12 * p, dropout=0.0, activation=activation, batch_first=True)
        return nn.Sequential(made.double())

    for activation, refused in ((_Centered(), "activation _Centered()"), (lambda t: t.relu(), "<lambda> is not known")):
        with pytest.raises(ValueError, match="1D tensor parallelism") as info:
            parallelize(layer(activation), mesh, plan={"0": Megatron(mesh)})
        assert refused in str(info.value) and "disagree" not in str(info.value), str(info.value)
    serial = layer(torch.nn.functional.silu)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"0": Megatron(mesh)})
    assert world.size == 1 or isinstance(parallel[0].linear1.weight, DTensor)
    check_against_serial(serial, parallel, x, mesh, tol=1e-9)  # SGD: the key bias's gradient is rounding alone


def test_load_state_dict_takes_the_serial_tensors(world):
    mesh = meshes_of(world)[0]
    serial = _serial(world, frozen=False)
    parallel = parallelize(copy.deepcopy(serial), mesh, plan={"encoder": Megatron(mesh)})
    changed = {key: value * 2 for key, value in serial.state_dict().items()}
    parallel.load_state_dict(changed)
    for key, value in serial_state_dict(parallel).items():
        assert_close(value, changed[key], 0.0, key)


class _PassThrough(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, mask


def test_a_batch_tensor_keeps_its_layout_through_a_region(world):
    """A float ``[b, k]`` given by scatter_batch and returned unchanged leaves as a batch block."""
    mesh = meshes_of(world)[-1]
    holder = nn.ModuleDict({"inner": _PassThrough()})
    parallelize(holder, mesh, plan={"inner": Megatron(mesh)})
    mask = torch.arange(2.0 * world.size * 5).reshape(2 * world.size, 5)
    x = torch.randn(2 * world.size, 3, 6 * world.size)
    out, mask_out = holder["inner"](optimus2d.scatter(x, mesh), scatter_batch(mask, mesh))
    assert torch.equal(gather(out, mesh), x)
    assert torch.equal(mask_out, scatter_batch(mask, mesh))


class _FirstSample(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:1]


def test_an_output_the_mesh_does_not_divide_is_refused_with_its_numbers(world):
    """The whole output goes back to the caller's blocks: a batch of 1 on depth·q > 1 ranks is
    refused on every rank alike (the whole tensor is the same everywhere), naming shape and mesh."""
    mesh = meshes_of(world)[-1]
    if mesh.depth * mesh.q == 1:
        pytest.skip("one rank divides every batch")
    holder = nn.ModuleDict({"inner": _FirstSample()})
    parallelize(holder, mesh, plan={"inner": Megatron(mesh)})
    x = optimus2d.scatter(torch.randn(2 * world.size, 3, 6 * world.size), mesh)
    n = mesh.depth * mesh.q
    want = rf"batch dim 0 of tensor \(1, 3, {6 * world.size}\) is not divisible by depth·q = {n} of Mesh"
    with pytest.raises(ValueError, match=want):
        holder["inner"](x)


class _TiedList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.layers, self.head = nn.Embedding(10, 8), nn.ModuleList([nn.Linear(8, 8)]), nn.Linear(8, 10)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[0](self.emb(ids)))


def test_regions_with_no_forward_a_tied_weight_or_meta_tensors_are_refused(world):
    mesh = meshes_of(world)[0]
    with pytest.raises(ValueError) as info:
        parallelize(_TiedList(), mesh, plan={"layers": Megatron(mesh), "head": Megatron(mesh)})
    text = str(info.value)
    assert "layers (ModuleList): has no forward of its own" in text
    assert "head (Linear): shares weight with an embedding (tied)" in text
    with torch.device("meta"):
        meta = EncoderProjector(6 * world.size, 12 * world.size)
    with pytest.raises(ValueError, match=r"encoder \(Sequential\): on the meta device"):
        parallelize(meta, mesh, plan={"encoder": Megatron(mesh)})
