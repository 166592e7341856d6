"""Context parallelism with data-parallel copies: c = 3 on 9 ranks (3 copies of Mesh(1, 3)).

The world is a DeviceMesh ("dp", "depth", "row", "col"): each copy a Mesh(1, c) whose depth axis
splits the sequence of a LLaMA body (``plan={"model": context.ContextParallel(mesh)}``) under a
causal, an image–text or a packed-document mask, the copies averaging their gradients with
torch's ``DistributedDataParallel`` over the dp group. Each copy
takes an equal share of the batch and its loss is the mean over it, so one AdamW step equals
transformers' serial model's on the whole batch (float32: the loss and the weights ≤ 1e-5).
Shapes: 9 ranks (c = 3, dp = 3), 8 (c = 4, dp = 2), 4 (c = 2, dp = 2).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close, context_mask
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import optimus2d
from optimus2d import context

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

SHAPES = {9: (3, 3), 8: (2, 4), 4: (2, 2)}  # world size → (copies, c)


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)  # float32: DDP broadcasts parameters and buffers in one dtype


@pytest.mark.parametrize(
    ("kind", "attention"), [("causal", "all_gather"), ("image", "ring"), ("documents", "all_gather")]
)
def test_context_parallel_copies_step_like_serial(world, kind, attention):
    if world.size not in SHAPES:
        pytest.skip(f"copies × c for {sorted(SHAPES)} ranks")
    dp, c = SHAPES[world.size]
    dm = init_device_mesh("cpu", (dp, c, 1, 1), mesh_dim_names=("dp", "depth", "row", "col"))
    mesh = optimus2d.Mesh.from_device_mesh(dm["depth", "row", "col"])
    serial = _llama()
    per, s = 2 * c, 2 * c * 6  # samples a copy (batch over depth outside the body), tokens
    mask = context_mask(kind, s)
    balance = "head_tail" if kind == "causal" else "makespan"
    spec = context.ContextParallel(mesh, mask=mask, balance=balance, block=2, attention=attention)
    model = DistributedDataParallel(
        optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": spec}), process_group=dm.get_group("dp")
    )
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (dp * per, s))
    opt_ref = torch.optim.AdamW(serial.parameters(), lr=1e-2, eps=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    bias = torch.zeros(s, s).masked_fill(~mask, float("-inf"))[None, None].expand(len(ids), 1, s, s)
    want = serial(input_ids=ids, labels=ids, attention_mask=bias if kind != "causal" else None).loss
    want.backward()
    opt_ref.step()
    mine = ids[per * mesh.replica : per * (mesh.replica + 1)]
    loss = model(input_ids=optimus2d.scatter_batch(mine, mesh), labels=optimus2d.scatter_batch(mine, mesh)).loss
    loss.backward()  # DDP: averaged over the copies
    opt.step()
    losses = [torch.zeros(()) for _ in range(dp)]
    dist.all_gather(losses, loss.detach(), group=dm.get_group("dp"))
    # every copy's tokens count alike (no -100 labels): the mean of the copies' means is the serial mean
    assert_close(torch.stack(losses).mean(), want, 1e-5, "loss")
    state = optimus2d.serial_state_dict(model.module)
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-5, key)
