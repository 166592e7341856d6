"""timm's VisionTransformer, built from a small random config (no download), on the mesh.

timm imports torchvision, which does not load beside the torch 2.13.0 CPU wheel these machines
pin; `scripts/test.sh` runs this file in a second environment (torch 2.15.0 with torchvision).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

import optimus2d
from optimus2d import clip_grad_norm_, gather, parallelize, scatter_batch, serial_state_dict

timm = pytest.importorskip("timm")
pytestmark = pytest.mark.mpi


def test_vit_logits_and_one_training_step(mesh):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    serial = VisionTransformer(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=6, num_classes=12)
    with torch.no_grad():  # not the zero init: make the class token and positions matter
        serial.cls_token.normal_()
        serial.pos_embed.normal_()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert isinstance(parallel.blocks[0].attn.qkv, optimus2d.layers.Linear2D)
    torch.manual_seed(1)
    b = 2 * mesh.depth * mesh.q
    images, labels = torch.randn(b, 3, 16, 16), torch.randint(0, 12, (b,))

    logits_ref = serial(images)
    loss_ref = F.cross_entropy(logits_ref, labels)
    loss_ref.backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
    torch.optim.SGD(serial.parameters(), lr=0.5).step()

    logits = parallel(images)  # the full images on every rank; logits [b/(d·q), 12/q]
    loss = optimus2d.cross_entropy(logits, scatter_batch(labels, mesh), mesh)
    loss.backward()
    norm = clip_grad_norm_(parallel.parameters(), 1e9, mesh)
    torch.optim.SGD(parallel.parameters(), lr=0.5).step()
    state = serial_state_dict(parallel)

    assert_close(gather(logits.detach(), mesh), logits_ref, 1e-4, "logits")
    assert_close(loss, loss_ref, 1e-5, "loss")
    assert_close(norm, norm_ref, 1e-5, "gradient norm")
    assert list(state) == list(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, key)


def test_vit_attention_dropout_draws_a_mask_per_shard(mesh):
    """timm's fused attention hands attn_drop.p to SDPA (dropout_p) and never calls the module: it
    ran outside shard_rng, each rank's heads under the same mask. Now a seed per rank, the same
    for a seed."""
    from mpi4py import MPI
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    serial = VisionTransformer(img_size=16, patch_size=4, embed_dim=48, depth=1, num_heads=6, attn_drop_rate=0.5)
    parallel = parallelize(serial, mesh).train()
    seeds = []
    parallel.blocks[0].attn.proj.register_forward_pre_hook(lambda *_: seeds.append(torch.initial_seed()))
    images = torch.randn(2 * mesh.depth * mesh.q, 3, 16, 16)
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(parallel(images).detach())
    assert torch.equal(outs[0], outs[1]) and seeds[0] == seeds[1]  # reproducible for a seed
    assert len(set(MPI.COMM_WORLD.allgather(seeds[0]))) == MPI.COMM_WORLD.size  # a seed of its own
