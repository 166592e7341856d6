"""Hugging Face ViT and CLIP, built from small random configs (no download), on the mesh: outputs,
gradients and one AdamW step equal to serial; frozen parameters stay frozen; refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, compare_step

import optimus2d
from optimus2d import gather, parallelize, scatter, scatter_batch
from optimus2d.families.vision import PatchConv2D, PositionEmbedding2D

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

TOWER = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6)  # 6 heads: q = 2, 3
VIT = dict(TOWER, image_size=16, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CLIP_VISION = dict(TOWER, num_hidden_layers=1, image_size=16, patch_size=8)
CLIP_TEXT = dict(
    TOWER,
    num_hidden_layers=1,
    vocab_size=96,
    max_position_embeddings=16,
    eos_token_id=95,
    bos_token_id=0,
    pad_token_id=1,
)


def _perturbed(model):
    """Every parameter moved off its init (biases and tokens not zero, norms not one), so a wrong
    block or a lost gradient shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "logit_scale":
                p.add_(0.05 * torch.randn_like(p))
    return model


def _vit(cls=None, **kwargs):
    config = transformers.ViTConfig(**VIT, num_labels=12, attn_implementation="sdpa")
    torch.manual_seed(0)
    return _perturbed((cls or transformers.ViTForImageClassification)(config, **kwargs))


def _clip():
    config = transformers.CLIPConfig(
        text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=24, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    return _perturbed(transformers.CLIPModel(config))


def _text(b):
    """Ids [b, 7] ending in eos (95) at different lengths, and the attention mask of the padding."""
    torch.manual_seed(1)
    ids, mask = torch.randint(0, 95, (b, 7)), torch.ones(b, 7, dtype=torch.long)
    for row in range(b):
        end = 3 + row % 5
        ids[row, end - 1], mask[row, end:] = 95, 0
    return ids, mask


@pytest.mark.parametrize("family", ["vit", "clip"])
def test_image_classification(mesh, family):
    """ViTForImageClassification (the class token) and CLIPForImageClassification (the mean of the
    patch tokens): logits, the loss of labels=, gradients and one step."""
    if family == "vit":
        serial = _vit()
        parallel = parallelize(copy.deepcopy(serial), mesh)
        assert isinstance(parallel.vit.embeddings.patch_embeddings.projection, PatchConv2D)
        assert isinstance(parallel.vit.layers[0].attention.q_proj, optimus2d.layers.Linear2D)
        assert parallel.vit.layers[0].attention.num_attention_heads == 6 // mesh.q
    else:
        config = transformers.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION, num_labels=12)
        torch.manual_seed(0)
        serial = _perturbed(transformers.CLIPForImageClassification(config))
        parallel = parallelize(copy.deepcopy(serial), mesh)
        assert parallel.vision_model.encoder.layers[0].self_attn.num_heads == 6 // mesh.q
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(1)
    images, labels = torch.randn(b, 3, 16, 16), torch.randint(0, 12, (b,))

    out_ref = serial(pixel_values=images, labels=labels)
    out_ref.loss.backward()
    out = parallel(pixel_values=scatter_batch(images, mesh), labels=scatter_batch(labels, mesh))  # [b/(d·q), 12/q]
    out.loss.backward()

    assert_close(gather(out.logits.detach(), mesh), out_ref.logits, 1e-4, "logits")
    assert_close(out.loss, out_ref.loss, 1e-5, "loss")
    assert list(out.keys()) == list(out_ref.keys())  # the loss first: out[0], to_tuple() as serial's
    as_tuple = parallel(pixel_values=scatter_batch(images, mesh), labels=scatter_batch(labels, mesh), return_dict=False)
    assert as_tuple[0].dim() == 0 and len(as_tuple) == len(out_ref.to_tuple())
    # the Trainer's num_items_in_batch: ViT's loss takes it (a sum over it), CLIP's does not (the mean)
    items = {"num_items_in_batch": 3 * b}
    with torch.no_grad():
        want = serial(pixel_values=images, labels=labels, **items).loss
        got = parallel(pixel_values=scatter_batch(images, mesh), labels=scatter_batch(labels, mesh), **items).loss
    assert_close(got, want, 1e-5, "loss with num_items_in_batch")
    compare_step(serial, parallel, mesh)


def test_clip_model_gives_its_logits_whole_with_whole_io(mesh):
    """``io="whole"``: CLIP's logits and embeddings, whole already (made from gathered embeddings),
    leave as they are (they were gathered again: [2b, 2b]); the towers' outputs are gathered."""
    serial = _clip()
    parallel = parallelize(copy.deepcopy(serial), mesh, io="whole")
    b = 2 * mesh.depth * mesh.q
    ids, mask = _text(b)
    torch.manual_seed(2)
    images = torch.randn(b, 3, 16, 16)
    with torch.no_grad():
        want = serial(input_ids=ids, pixel_values=images, attention_mask=mask, return_loss=True)
        got = parallel(input_ids=ids, pixel_values=images, attention_mask=mask, return_loss=True)
    for key in ("loss", "logits_per_image", "logits_per_text", "text_embeds", "image_embeds"):
        assert_close(got[key], want[key], 1e-5, key)
    assert_close(got.vision_model_output.pooler_output, want.vision_model_output.pooler_output, 1e-5, "pooler")


def test_clip_planned_on_another_mesh_gives_its_logits_whole(world):
    """CLIP on a mesh of its own (``plan={"clip": other}``): its logits, whole already, leave the
    planned module as they are (they were moved as activation blocks: [16, 4] for [8, 8], no error),
    with blocks or whole io; the loss of them and its gradients are serial's."""
    import itertools

    from conftest import meshes_of
    from helpers import assert_grads_like_serial
    from torch import nn

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.clip = _clip()

        def forward(self, input_ids, pixel_values):
            return self.clip(input_ids=input_ids, pixel_values=pixel_values)

    serial = Wrap()
    b = 2 * world.size
    ids, _ = _text(b)
    torch.manual_seed(2)
    images, probe = torch.randn(b, 3, 16, 16), torch.randn(b, b)
    (serial(ids, images).logits_per_image * probe).sum().backward()
    for outer, inner in itertools.permutations(meshes_of(world), 2):
        for io in ("blocks", "whole"):
            parallel = parallelize(copy.deepcopy(serial), outer, plan={"clip": inner}, io=io)
            parallel.zero_grad()
            args = (ids, images) if io == "whole" else (scatter_batch(ids, outer), scatter_batch(images, outer))
            logits = parallel(*args).logits_per_image
            assert_close(logits.detach(), serial(ids, images).logits_per_image, 1e-5, f"logits, io={io}")
            (logits * probe).sum().backward()
            assert_grads_like_serial(serial, parallel, inner, 1e-4)


def test_position_ids_outside_the_table_are_refused_on_every_rank(mesh):
    """CLIP's text positions, each sample its own, one of them past the table (serial: IndexError):
    refused on every rank at once (the ranks whose rows held it raised; the others waited)."""
    from helpers import raises_fast

    config = transformers.CLIPTextConfig(**CLIP_TEXT)
    torch.manual_seed(0)
    parallel = parallelize(transformers.CLIPTextModel(config), mesh)
    b = 2 * mesh.depth * mesh.q
    ids, _ = _text(b)
    positions = torch.arange(7).expand(b, 7).clone()
    positions[-1] += 10  # the last sample: 10 .. 16, and the table holds 16
    raises_fast(
        ValueError,
        r"position ids outside \[0, 16\)",
        lambda: parallel(input_ids=scatter_batch(ids, mesh), position_ids=scatter_batch(positions, mesh)),
    )


def test_vit_model_interpolated_positions_mask_token_and_pooler(mesh):
    serial = _vit(transformers.ViTModel, use_mask_token=True)  # pooler: dense + tanh on the class token
    parallel = parallelize(copy.deepcopy(serial), mesh)
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(1)
    images, masked = torch.randn(b, 3, 24, 24), torch.rand(b, 9) < 0.3  # 3×3 patches, 2×2 positions stored
    probe_seq, probe_pool = torch.randn(b, 10, 48), torch.randn(b, 48)

    out_ref = serial(pixel_values=images, bool_masked_pos=masked, interpolate_pos_encoding=True)
    ((out_ref.last_hidden_state * probe_seq).sum() + (out_ref.pooler_output * probe_pool).sum()).backward()
    out = parallel(
        pixel_values=scatter_batch(images, mesh),
        bool_masked_pos=scatter_batch(masked, mesh),
        interpolate_pos_encoding=True,
    )
    (
        (out.last_hidden_state * scatter(probe_seq, mesh)).sum() + (out.pooler_output * scatter(probe_pool, mesh)).sum()
    ).backward()

    assert_close(gather(out.last_hidden_state.detach(), mesh), out_ref.last_hidden_state, 1e-4, "last_hidden_state")
    assert_close(gather(out.pooler_output.detach(), mesh), out_ref.pooler_output, 1e-4, "pooler_output")
    compare_step(serial, parallel, mesh)


def test_clip_model_logits_contrastive_loss_and_step(mesh):
    serial = _clip()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    embeddings = parallel.text_model.embeddings
    assert isinstance(embeddings.position_embedding, PositionEmbedding2D)
    assert embeddings.position_embedding.weight.shape[0] == 16  # as serial: HF checks the sequence against it
    b = 2 * mesh.depth * mesh.q
    ids, mask = _text(b)
    torch.manual_seed(2)
    images = torch.randn(b, 3, 16, 16)

    out_ref = serial(input_ids=ids, pixel_values=images, attention_mask=mask, return_loss=True)
    out_ref.loss.backward()
    out = parallel(
        input_ids=scatter_batch(ids, mesh),
        pixel_values=scatter_batch(images, mesh),
        attention_mask=scatter_batch(mask, mesh),
        return_loss=True,
    )
    out.loss.backward()

    for name in ("logits_per_image", "logits_per_text", "image_embeds", "text_embeds"):  # full, on every rank
        assert_close(getattr(out, name).detach(), getattr(out_ref, name), 1e-4, name)
    assert_close(out.loss, out_ref.loss, 1e-5, "loss")
    text_pooled = gather(out.text_model_output.pooler_output.detach(), mesh)  # projected, blocks
    assert_close(text_pooled, out_ref.text_model_output.pooler_output, 1e-4, "text pooler_output")
    assert parallel.logit_scale.grad is not None
    compare_step(serial, parallel, mesh)


@pytest.mark.parametrize("tower", ["vision", "text", "vision+projection", "text+projection"])
def test_clip_tower_alone(mesh, tower):
    """CLIPVisionModel / CLIPTextModel (pooled: the class token / the eos token, and the last hidden
    state) and their ...WithProjection variants (the projected pooled output)."""
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(0)
    projection = tower.endswith("+projection")
    if tower.startswith("vision"):  # 24×24 images: the 2×2 stored positions interpolated to 3×3
        cls = transformers.CLIPVisionModelWithProjection if projection else transformers.CLIPVisionModel
        serial = _perturbed(cls(transformers.CLIPVisionConfig(**CLIP_VISION, projection_dim=24)))
        torch.manual_seed(1)
        images = torch.randn(b, 3, 24, 24)
        inputs_ref = dict(pixel_values=images, interpolate_pos_encoding=True)
        inputs = dict(pixel_values=scatter_batch(images, mesh), interpolate_pos_encoding=True)
        seq, pooled = 10, "image_embeds" if projection else "pooler_output"
    else:
        cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
        serial = _perturbed(cls(transformers.CLIPTextConfig(**CLIP_TEXT, projection_dim=24)))
        ids, mask = _text(b)
        inputs_ref = dict(input_ids=ids, attention_mask=mask)
        inputs = dict(input_ids=scatter_batch(ids, mesh), attention_mask=scatter_batch(mask, mesh))
        seq, pooled = 7, "text_embeds" if projection else "pooler_output"
    parallel = parallelize(copy.deepcopy(serial), mesh)
    torch.manual_seed(3)
    probe_seq, probe_pool = torch.randn(b, seq, 48), torch.randn(b, 24 if projection else 48)

    out_ref = serial(**inputs_ref)
    ((out_ref.last_hidden_state * probe_seq).sum() + (out_ref[pooled] * probe_pool).sum()).backward()
    out = parallel(**inputs)  # blocks: [b/(d·q), seq, 48/q], [b/(d·q), 48/q or 24/q]
    (
        (out.last_hidden_state * scatter(probe_seq, mesh)).sum() + (out[pooled] * scatter(probe_pool, mesh)).sum()
    ).backward()

    assert_close(gather(out.last_hidden_state.detach(), mesh), out_ref.last_hidden_state, 1e-4, "last_hidden_state")
    assert_close(gather(out[pooled].detach(), mesh), out_ref[pooled], 1e-4, pooled)
    compare_step(serial, parallel, mesh)


@pytest.mark.parametrize("family", ["vit", "clip"])
def test_frozen_parameters_stay_frozen(mesh, family):
    serial = _vit() if family == "vit" else _clip()
    names = [name for name, _ in serial.named_parameters()]
    frozen = set(names[::2])  # every other one: the patch conv, class token, positions, norms, projections...
    for name, p in serial.named_parameters():
        p.requires_grad_(name not in frozen)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert {n: p.requires_grad for n, p in parallel.named_parameters()} == {n: n not in frozen for n in names}
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(1)
    images = torch.randn(b, 3, 16, 16)
    if family == "vit":
        labels = torch.randint(0, 12, (b,))
        serial(pixel_values=images, labels=labels).loss.backward()
        parallel(pixel_values=scatter_batch(images, mesh), labels=scatter_batch(labels, mesh)).loss.backward()
    else:
        ids, mask = _text(b)
        serial(input_ids=ids, pixel_values=images, attention_mask=mask, return_loss=True).loss.backward()
        local = {
            k: scatter_batch(v, mesh) for k, v in dict(input_ids=ids, pixel_values=images, attention_mask=mask).items()
        }
        parallel(**local, return_loss=True).loss.backward()
    assert all(p.grad is None for n, p in parallel.named_parameters() if n in frozen)
    compare_step(serial, parallel, mesh)


def test_refusals(mesh):
    b = 2 * mesh.depth * mesh.q
    parallel = parallelize(_vit(), mesh)
    images = scatter_batch(torch.randn(b, 3, 16, 16), mesh)
    with pytest.raises(ValueError, match="problem_type='multi_label_classification' is not supported"):
        parallel(pixel_values=images, labels=scatter_batch(torch.rand(b, 12), mesh))
    if mesh.q > 1:  # 4 heads on q = 3, 5 heads on q = 2
        config = transformers.ViTConfig(**dict(VIT, hidden_size=60, num_attention_heads=4 if mesh.q == 3 else 5))
        with pytest.raises(ValueError, match=f"num_attention_heads=[45] is not divisible by q={mesh.q}"):
            parallelize(transformers.ViTModel(config), mesh)


def test_attention_dropout_draws_on_every_shard(mesh):
    """Attention dropout in training: a mask of its own on each shard (shard_rng), reproducible for a seed."""
    config = transformers.ViTConfig(**dict(VIT, attention_probs_dropout_prob=0.5), attn_implementation="eager")
    torch.manual_seed(0)
    parallel = parallelize(transformers.ViTModel(config, add_pooling_layer=False), mesh)
    images = scatter_batch(torch.randn(2 * mesh.depth * mesh.q, 3, 16, 16), mesh)
    parallel.eval()
    with torch.no_grad():
        plain = parallel(pixel_values=images).last_hidden_state
        parallel.train()
        outs = []
        for _ in range(2):
            torch.manual_seed(5)
            outs.append(parallel(pixel_values=images).last_hidden_state)
    assert torch.equal(outs[0], outs[1])
    assert not torch.allclose(outs[0], plain)
