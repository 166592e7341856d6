"""torch's own tools on a converted model, with no optimus2d wrapper (issue 25).

A converted model's parameters are DTensors of the serial tensors (``convert/dtensor_params.py``),
so a training loop written for one process — ``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW``
(``foreach``), an EMA by ``torch.optim.swa_utils.AveragedModel``, ``torch.distributed.checkpoint``
through ``get_state_dict``/``set_state_dict`` — gives the serial model's numbers. Checked against
transformers' LLaMA itself on the meshes the families promise (1, 2×2 and 1×1×4, 2×2×2, 3×3: DCP over
gloo is slow on CI's 2 cores, and 1×1×8 proves nothing 1×1×4 does not), the checkpoint loaded onto another
mesh shape of the world (1×1×8 among them); and GPT-2, whose fused q/k/v and padded
vocabulary are not DTensor's shards as stored, through DCP onto another mesh.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp._fully_shard._fsdp_common as fsdp_common
from conftest import mesh_shapes
from helpers import assert_close, shared_tmp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import optimus2d
from optimus2d import Mesh, parallelize, scatter_batch, serial_state_dict
from optimus2d.convert import parallelizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi
PROMISED_MESHES_ONLY = True  # conftest: no 1×1×8

SPMD_FSDP = hasattr(fsdp_common, "DataParallelMeshDims")  # torch >= 2.13
ADAM = dict(lr=1e-2, eps=1e-3, weight_decay=0.1)


def _llama(seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=72, hidden_size=72, intermediate_size=144, num_hidden_layers=layers, num_attention_heads=6,
        num_key_value_heads=6, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).double()


def _gpt2(seed: int = 0, vocab: int = 97):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=36, n_layer=2, n_head=6, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg).double().eval()  # no dropout: logits compared


def _step(model, opt, ema, ids, mesh=None):
    """One step written as for one process; ``mesh``: the batch goes in as this rank's rows."""
    rows = ids if mesh is None else scatter_batch(ids, mesh)
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    if ema is not None:
        ema.update_parameters(model)
    return loss.detach(), norm


def _other(mesh: Mesh) -> Mesh:
    """Another mesh shape over the same ranks, where the world has one (else the same shape)."""
    shapes = [s for s in mesh_shapes(mesh.size) if s != (mesh.q, mesh.depth)] or [(mesh.q, mesh.depth)]
    return Mesh(*shapes[0])


def _save_dcp(model, opt, path):
    """torch's distributed checkpoint of ``model`` and ``opt``, as torch documents it."""
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return path


def _load_dcp(model, path):
    """A fresh AdamW for ``model``, both loaded from ``path`` as torch documents it."""
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return opt


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def test_every_parameter_is_a_dtensor_of_the_serial_shape(mesh):
    serial = _llama()
    model = parallelize(copy.deepcopy(serial), mesh)
    if mesh.size == 1:  # one rank (or no torch.distributed): the blocks are the serial tensors
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        return
    shapes = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert p.shape == shapes[name].shape, name
        assert p.device_mesh.mesh_dim_names == ("depth", "row", "col"), name
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in serial.parameters())


def test_the_forward_and_backward_send_what_plain_blocks_sent(mesh, monkeypatch):
    """count_comm of a training step's forward and backward, its records (kind, axis, elements, in
    order), with DTensor parameters and with the plain blocks of before (the pass left out)."""
    serial = _llama()
    ids = torch.randint(0, 72, (2 * mesh.size, 10))
    counts, losses = [], []
    for distribute in (True, False):
        if not distribute:
            monkeypatch.setattr(parallelizer, "distribute_parameters", lambda model, *_: model)
        model = parallelize(copy.deepcopy(serial), mesh)
        assert any(isinstance(p, DTensor) for p in model.parameters()) == (distribute and mesh.size > 1)
        rows = scatter_batch(ids, mesh)
        with optimus2d.count_comm() as counter:
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
        counts.append([(r.kind, r.axis, r.numel) for r in counter.records])
        losses.append(loss.detach())
    assert counts[0] == counts[1] and (counts[0] or mesh.size == 1)
    assert torch.equal(losses[0], losses[1])


def test_three_steps_of_plain_torch_and_a_checkpoint_onto_another_mesh(mesh, tmp_path_factory):
    serial = _llama()
    model = parallelize(copy.deepcopy(serial), mesh)
    opt_ref = torch.optim.AdamW(serial.parameters(), **ADAM, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True, fused=False)
    ema_ref = AveragedModel(serial, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    rows = 2 * mesh.size
    torch.manual_seed(1)
    batches = [torch.randint(0, 72, (rows, 10)) for _ in range(4)]
    for ids in batches[:3]:
        want, want_norm = _step(serial, opt_ref, ema_ref, ids)
        got, norm = _step(model, opt, ema, ids, mesh)
        assert_close(got, want, 1e-6, "loss")
        assert_close(_full(norm), want_norm, 1e-6, "clip_grad_norm_")
    reference, trained = serial.state_dict(), serial_state_dict(model)
    for key, value in trained.items():
        assert_close(value, reference[key], 1e-6, key)
    ema_reference = ema_ref.module.state_dict()
    for key, value in serial_state_dict(ema.module).items():
        assert_close(value, ema_reference[key], 1e-6, f"EMA {key}")

    # torch's distributed checkpoint, as torch documents it, loaded onto a model of another mesh shape
    path = _save_dcp(model, opt, shared_tmp(tmp_path_factory, "dcp"))
    other_mesh = _other(mesh)
    other = parallelize(_llama(seed=5), other_mesh)  # other weights, to be overwritten
    other_opt = _load_dcp(other, path)
    for key, value in serial_state_dict(other).items():
        assert_close(value, trained[key], 0, f"loaded {key}")
    want, _ = _step(serial, opt_ref, None, batches[3])  # the fourth step needs the optimizer's state too
    got, _ = _step(other, other_opt, None, batches[3], other_mesh)
    assert_close(got, want, 1e-6, "loss after loading")
    reference = serial.state_dict()
    for key, value in serial_state_dict(other).items():
        assert_close(value, reference[key], 1e-6, f"after a step from the checkpoint: {key}")


@pytest.mark.parametrize("vocab", [96, 97])
def test_fused_qkv_and_a_padded_vocabulary_go_through_dcp_as_serial_tensors(mesh, tmp_path_factory, vocab):
    """GPT-2's c_attn holds q, k and v each split on its own, and a vocabulary of 97 is padded:
    neither block is a DTensor shard of the serial tensor, so the model's and the optimizer's
    ``state_dict()`` give the serial tensor's DTensor, and ``load_state_dict`` takes it back to
    blocks: two AdamW steps, a DCP checkpoint, loaded on this mesh and another, one more step, all
    as serial (before the optimizer's hooks, its c_attn moments came back 0.0099 off on 1×1×4)."""
    serial = _gpt2(vocab=vocab)
    model = parallelize(copy.deepcopy(serial), mesh)
    state = model.state_dict()
    for key, value in serial.state_dict().items():
        assert state[key].shape == value.shape, key
        assert_close(_full(state[key]), value, 0, key)
    opt_ref = torch.optim.AdamW(serial.parameters(), **ADAM, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True)
    torch.manual_seed(1)
    batches = [torch.randint(0, vocab, (2 * mesh.size, 6)) for _ in range(3)]
    for ids in batches[:2]:
        _step(serial, opt_ref, None, ids)
        _step(model, opt, None, ids, mesh)
    path = _save_dcp(model, opt, shared_tmp(tmp_path_factory, "dcp_gpt2"))
    trained = serial_state_dict(model)
    _step(serial, opt_ref, None, batches[2])
    for target_mesh in (mesh, _other(mesh)):
        other = parallelize(_gpt2(seed=3, vocab=vocab), target_mesh)
        other_opt = _load_dcp(other, path)
        for key, value in serial_state_dict(other).items():
            assert_close(value, trained[key], 0, f"{key} on {target_mesh}")
        _step(other, other_opt, None, batches[2], target_mesh)
        for key, value in serial_state_dict(other).items():  # the moments came back too
            assert_close(value, serial.state_dict()[key], 1e-6, f"{key} after a step on {target_mesh}")
        ids = batches[0]
        got = optimus2d.gather(other(input_ids=scatter_batch(ids, target_mesh)).logits.detach(), target_mesh)
        assert_close(got[..., :vocab], serial(input_ids=ids).logits, 1e-6, "logits")


@pytest.mark.parametrize("vocab", [96, 97])
def test_an_optimizer_state_dict_loads_into_a_fresh_optimizer_before_its_first_step(mesh, vocab):
    """The usual resume by torch alone: ``load_state_dict`` of a saved ``opt.state_dict()`` into a
    fresh optimizer, then a step. Its hooks came at the first step, after the load: the serial
    layout's moments of the fused q/k/v went into the blocks as they were (c_attn.bias 0.56 off)."""
    serial = _gpt2(vocab=vocab)
    model = parallelize(copy.deepcopy(serial), mesh)
    opt_ref = torch.optim.AdamW(serial.parameters(), **ADAM, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True)
    torch.manual_seed(1)
    batches = [torch.randint(0, vocab, (2 * mesh.size, 6)) for _ in range(2)]
    _step(serial, opt_ref, None, batches[0])
    _step(model, opt, None, batches[0], mesh)
    saved = copy.deepcopy(opt.state_dict())
    _step(serial, opt_ref, None, batches[1])
    other = parallelize(_gpt2(seed=3, vocab=vocab), mesh)
    other.load_state_dict(model.state_dict())
    fresh = torch.optim.AdamW(other.parameters(), **ADAM, foreach=True)
    fresh.load_state_dict(saved)
    _step(other, fresh, None, batches[1], mesh)
    for key, value in serial_state_dict(other).items():
        assert_close(value, serial.state_dict()[key], 1e-6, f"{key} after the resumed step")


@pytest.mark.parametrize("when", ["fresh", "stepped"])
def test_a_serial_optimizers_state_dict_loads_into_the_converted_optimizer(mesh, when):
    """A serial run's ``opt.state_dict()`` (plain tensors) into the converted model's optimizer, fresh
    or after a step of its own: its step mixed plain tensors with DTensors and raised on every rank,
    after the load had changed the optimizer. Every parameter's state now becomes its layout (the
    canonical ones DTensors of their shards, the padded and fused ones blocks)."""
    serial = _gpt2(vocab=97)
    opt_ref = torch.optim.AdamW(serial.parameters(), **ADAM, foreach=True)
    torch.manual_seed(1)
    batches = [torch.randint(0, 97, (2 * mesh.size, 6)) for _ in range(2)]
    model = parallelize(copy.deepcopy(serial), mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True)
    if when == "stepped":
        _step(model, opt, None, batches[0], mesh)
    _step(serial, opt_ref, None, batches[0])
    model.load_state_dict(serial.state_dict())
    opt.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
    _step(serial, opt_ref, None, batches[1])
    _step(model, opt, None, batches[1], mesh)
    for key, value in serial_state_dict(model).items():
        assert_close(value, serial.state_dict()[key], 1e-6, f"{key} after the step from the serial state")


def test_a_state_dict_loads_into_a_model_on_another_mesh(mesh):
    """torch's own ``load_state_dict`` of one converted model's ``state_dict()`` into another's, on
    another mesh shape: a DTensor of another mesh is taken back to this mesh's blocks."""
    serial = _gpt2(vocab=97)
    source = parallelize(copy.deepcopy(serial), mesh)
    target = parallelize(_gpt2(seed=4, vocab=97), _other(mesh))
    target.load_state_dict(source.state_dict())
    for key, value in serial_state_dict(target).items():
        assert_close(value, serial.state_dict()[key], 0, key)


def test_dtype_and_device_moves_keep_the_gradient_sums(mesh):
    """``model.double()`` and ``model.to("cpu")`` swap a DTensor parameter's contents
    (``torch.utils.swap_tensors``), dropping its marks and gradient hooks; the module's record gives
    them back at the next forward. Qwen3's q_norm and k_norm run whole on every rank of a row and
    sum their gradient over it (a hook): without it they were 0.85 off after ``.double()``."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=72, hidden_size=72, intermediate_size=144, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=6, head_dim=12, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    serial = transformers.Qwen3ForCausalLM(cfg).float()
    model = parallelize(copy.deepcopy(serial), mesh)
    model.double().to("cpu")
    serial.double()
    ids = torch.randint(0, 72, (2 * mesh.size, 6))
    serial(input_ids=ids, labels=ids).loss.backward()
    rows = scatter_batch(ids, mesh)
    model(input_ids=rows, labels=rows).loss.backward()
    grads = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        assert_close(_full(p.grad), grads[name].grad, 1e-6, name)
    model.load_state_dict(serial.state_dict(), assign=True)  # other tensors put in: marks and hooks kept
    model.zero_grad()
    model(input_ids=rows, labels=rows).loss.backward()
    for name, p in model.named_parameters():
        assert_close(_full(p.grad), grads[name].grad, 1e-6, f"after assign: {name}")


def test_a_serial_state_dict_loads_through_torch_load_state_dict(mesh):
    serial, fresh = _gpt2(), _gpt2(seed=7)
    model = parallelize(fresh, mesh)
    model.load_state_dict(serial.state_dict())
    for key, value in serial_state_dict(model).items():
        assert_close(value, serial.state_dict()[key], 0, key)


def _fsdp(model, dm):
    """torch's FSDP2 over ``dm``'s "dp" dim, each decoder layer its own group, as torchtitan does."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshDims

    dims = DataParallelMeshDims(shard="dp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=dm, dp_mesh_dims=dims)
    return fully_shard(model, mesh=dm, dp_mesh_dims=dims)


@pytest.mark.skipif(not SPMD_FSDP, reason="FSDP2 of DTensors on a mesh of more than 2 dims: torch 2.13's dp_mesh_dims")
def test_fsdp2_over_two_replicas_steps_like_serial(world, tmp_path_factory):
    """Two of the same steps (the EMA's first update copies, the second averages) with torch's FSDP2
    over two replicas of 2×2 on 8 ranks: ``parallelize`` given a DeviceMesh with a "dp" dim makes every
    parameter a DTensor on all of it, ``Replicate`` over "dp", which ``fully_shard(..., dp_mesh_dims=)``
    shards further; then DCP onto 2 replicas of 1×1×4 under FSDP2 and onto one 2×2×2 mesh, a third step
    on each. A LLaMA of one decoder layer (its own FSDP group beside the root's): on 2 cores the test's
    time is DTensor's sharding propagation, parameter by parameter (74 s with two layers, 47 with one)."""
    if world.size != 8:
        pytest.skip("2 replicas of 2×2: 8 ranks")
    dm = init_device_mesh("cpu", (2, 1, 2, 2), mesh_dim_names=("dp", "depth", "row", "col"))
    mesh = optimus2d.comm.mesh.as_mesh(dm)
    serial = _llama(layers=1)
    model = _fsdp(parallelize(copy.deepcopy(serial), dm), dm)
    for name, p in model.named_parameters():
        assert p.device_mesh is dm and p.placements[0] != Replicate(), name  # FSDP's shard of the block
    opt_ref = torch.optim.AdamW(serial.parameters(), **ADAM, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True, fused=False)
    ema_ref = AveragedModel(serial, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}  # FSDP refuses deepcopy
    torch.manual_seed(1)
    batches = [torch.randint(0, 72, (4 * mesh.size, 10)) for _ in range(3)]
    for ids in batches[:2]:  # two steps: the EMA copies, then averages
        want, want_norm = _step(serial, opt_ref, ema_ref, ids)
        got, norm = _step(model, opt, None, ids.chunk(2)[mesh.replica], mesh)  # each replica half the batch
        with torch.no_grad():  # AveragedModel's EMA (its first update copies), written with foreach
            averaged, now = list(ema.values()), [p.detach() for p in model.parameters()]
            torch._foreach_lerp_(averaged, now, 0.2 if ema_ref.n_averaged > 1 else 1.0)
        dist.all_reduce(got, group=dm.get_group("dp"))
        assert_close(got / 2, want, 1e-6, "loss")
        assert_close(_full(norm), want_norm, 1e-6, "clip_grad_norm_")
    for given in (None, mesh, dm):  # FSDP's shards are of every replica: optimus2d's clip sends to torch's
        with pytest.raises(ValueError, match=r"FSDP.*use torch\.nn\.utils\.clip_grad_norm_"):
            optimus2d.clip_grad_norm_(model.parameters(), 1e9, given)
    reference, trained = serial.state_dict(), {k: _full(v) for k, v in model.state_dict().items()}
    for key, value in trained.items():
        assert_close(value, reference[key], 1e-6, key)
    ema_reference = ema_ref.module.state_dict()
    for key, value in ema.items():
        assert_close(_full(value), ema_reference[key], 1e-6, f"EMA {key}")

    path = _save_dcp(model, opt, shared_tmp(tmp_path_factory, "dcp_fsdp"))
    want, _ = _step(serial, opt_ref, None, batches[2])
    reference = serial.state_dict()
    dm4 = init_device_mesh("cpu", (2, 4, 1, 1), mesh_dim_names=("dp", "depth", "row", "col"))
    for other_mesh in (dm4, Mesh(2, 2)):
        fsdp = isinstance(other_mesh, DeviceMesh)
        other = parallelize(_llama(seed=5, layers=1), other_mesh)
        other = _fsdp(other, other_mesh) if fsdp else other
        other_opt = _load_dcp(other, path)
        for key, value in other.state_dict().items():
            assert_close(_full(value), trained[key], 0, f"loaded {key} onto {other_mesh}")
        as_mesh = optimus2d.comm.mesh.as_mesh(other_mesh)
        ids = batches[2].chunk(2)[as_mesh.replica] if fsdp else batches[2]
        got, _ = _step(other, other_opt, None, ids, as_mesh)
        for key, value in other.state_dict().items():
            assert_close(_full(value), reference[key], 1e-6, f"a step after loading onto {other_mesh}: {key}")


def test_a_device_mesh_with_replicas_gives_dtensors_on_all_of_it(world):
    """``parallelize(model, dm)`` with a "dp" dim: every parameter a DTensor on ``dm``, replicated over
    "dp" (what FSDP2 shards; on torch 2.11 its ``fully_shard`` refuses them, rather than reduce one
    block as if whole); the mesh of one replica keeps plain blocks, for DDP; a plan putting a module
    on another mesh is refused on every rank, the model untouched."""
    if world.size != 8:
        pytest.skip("2 replicas of 2×2: 8 ranks")
    dm = init_device_mesh("cpu", (2, 1, 2, 2), mesh_dim_names=("dp", "depth", "row", "col"))
    mesh = optimus2d.comm.mesh.as_mesh(dm)
    serial = _llama()
    model = parallelize(copy.deepcopy(serial), dm)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh is dm and p.placements[0] == Replicate(), name
        assert p.shape == serial.get_parameter(name).shape, name
    plain = parallelize(copy.deepcopy(serial), mesh)
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    if not SPMD_FSDP:
        from torch.distributed.fsdp import fully_shard

        refusals = (NotImplementedError, RuntimeError)  # "FSDP only supports 1D TP/EP", "overlapping meshes"
        with pytest.raises(refusals, match=r"FSDP only supports 1D TP/EP|Cannot concatenate overlapping meshes"):
            fully_shard(model.model.layers[0], mesh=dm["dp"])
    untouched = copy.deepcopy(serial)
    other = Mesh(1, 4, ranks=mesh.ranks)
    with pytest.raises(ValueError, match=r"the plan puts 'model.layers.0' on another mesh"):
        parallelize(untouched, dm, plan={"model.layers.0": other})
    assert all(torch.equal(p, serial.get_parameter(n)) for n, p in untouched.named_parameters())


def test_gradients_reach_the_parameters_as_torch_would_give_them(mesh):
    """A parameter's local tensor is the leaf its gradient reaches (``_leaf``), handed to ``p.grad``:
    as serial after ``.to()``/``.double()`` following a step (a weak reference to the parameter made
    torch's swap refuse it), for a parameter frozen between forward and backward (no gradient, as
    torch), with a hook the user put on a parameter (it runs), and, within
    ``optimus2d.parameters_in_graph()``, for ``torch.autograd.grad`` and ``backward(inputs=)``
    (outside it the parameters are not in the graph: torch says so)."""
    serial = _llama()
    model = parallelize(copy.deepcopy(serial), mesh)
    ids = torch.randint(0, 72, (2 * mesh.size, 6))
    rows = scatter_batch(ids, mesh)

    def check(what, names=None):
        for name, p in model.named_parameters():
            want = serial.get_parameter(name).grad
            if names is None or name in names:
                assert (p.grad is None) == (want is None), f"{what}: {name}"
                if want is not None:
                    assert_close(_full(p.grad), want, 1e-6, f"{what}: {name}")
        serial.zero_grad()
        model.zero_grad()

    serial(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=rows, labels=rows).loss.backward()
    check("a step")
    model.float().double().to("cpu")
    serial(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=rows, labels=rows).loss.backward()
    check("after .float().double().to()")

    frozen = "model.layers.0.mlp.up_proj.weight"
    loss_ref, loss = serial(input_ids=ids, labels=ids).loss, model(input_ids=rows, labels=rows).loss
    serial.get_parameter(frozen).requires_grad_(False)
    model.get_parameter(frozen).requires_grad_(False)
    loss_ref.backward()
    loss.backward()
    check("frozen between forward and backward")
    serial.get_parameter(frozen).requires_grad_(True)
    model.get_parameter(frozen).requires_grad_(True)

    hooked = "model.layers.0.self_attn.o_proj.weight"
    for m in (serial, model):
        m.get_parameter(hooked).register_hook(lambda g: g * 3)
    serial(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=rows, labels=rows).loss.backward()
    check("a user's hook on a parameter")

    names = ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    if mesh.size > 1:  # DTensor parameters (one rank's blocks are the serial tensors, in the graph)
        loss = model(input_ids=rows, labels=rows).loss
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(loss, [model.get_parameter(n) for n in names])
    wanted = torch.autograd.grad(serial(input_ids=ids, labels=ids).loss, [serial.get_parameter(n) for n in names])
    with optimus2d.parameters_in_graph():
        got = torch.autograd.grad(model(input_ids=rows, labels=rows).loss, [model.get_parameter(n) for n in names])
        for name, g, want in zip(names, got, wanted, strict=True):
            assert_close(_full(g), want, 1e-6, f"autograd.grad: {name}")
        serial(input_ids=ids, labels=ids).loss.backward(inputs=[serial.get_parameter(n) for n in names])
        model(input_ids=rows, labels=rows).loss.backward(inputs=[model.get_parameter(n) for n in names])
    check("backward(inputs=)")
