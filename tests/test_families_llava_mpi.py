"""Hugging Face LLaVA (a CLIP tower, the projector, LLaMA), built from a small random config, on the
mesh with no user code: logits, the loss of labels=, gradients and one AdamW step equal to serial,
the images merged at their tokens block by block; a frozen tower stays frozen; text-only batches;
placeholder counts that do not match refused on every rank, before the language model runs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import assert_close, compare_step

import optimus2d
from optimus2d import gather, parallelize, scatter_batch, serial_state_dict

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

IMAGE = 95  # the image token; 16×16 images of 8×8 patches: 4 feature rows per image (class token dropped)
ROWS, SEQ = 4, 10
VISION = dict(
    hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, image_size=16, patch_size=8
)
TEXT = dict(
    vocab_size=96, hidden_size=60, intermediate_size=120, num_hidden_layers=1, num_attention_heads=6,
    num_key_value_heads=6, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


def _llava(vision_feature_layer=-2):
    """-2: the first layer's output (the second layer and post_layernorm get no gradient)."""
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.LlamaConfig(**TEXT),
        image_token_id=IMAGE,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy="default",
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():  # every parameter off its init (norms not one, biases not zero): a wrong block shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _batch(b: int):
    """One image per sample; its 4 tokens at a place that differs by sample; the labels ignore them
    and the padding at the end of some rows."""
    torch.manual_seed(1)
    ids, mask = torch.randint(1, IMAGE, (b, SEQ)), torch.ones(b, SEQ, dtype=torch.long)
    for row in range(b):
        start = 1 + row % 4
        ids[row, start : start + ROWS] = IMAGE
        mask[row, SEQ - row % 3 :] = 0
    labels = ids.masked_fill((ids == IMAGE) | (mask == 0), -100)
    return dict(input_ids=ids, pixel_values=torch.randn(b, 3, 16, 16), attention_mask=mask, labels=labels)


def _image_features(out):
    """The projected image features: ``image_hidden_states`` up to transformers 5.23; from 5.24, which
    deprecates that name, ``image_outputs.pooler_output`` (a tensor per image, concatenated here)."""
    if hasattr(out, "image_outputs"):
        features = None if out.image_outputs is None else out.image_outputs.pooler_output
    else:
        features = out.image_hidden_states
    return torch.cat(list(features)) if isinstance(features, (list, tuple)) else features


def _local(batch, mesh):
    return {k: scatter_batch(v, mesh) for k, v in batch.items()}


def _adamw(model, scale):
    """eps a thousandth of the largest gradient: a gradient that is rounding alone (an attention key
    bias: softmax ignores it) moves nothing."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3 * scale)


@pytest.mark.parametrize("frozen_tower", [False, True], ids=["trained", "frozen_tower"])
def test_llava_logits_loss_and_step(mesh, frozen_tower):
    serial = _llava()
    if frozen_tower:
        serial.model.vision_tower.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in serial.named_parameters()}
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert {n: p.requires_grad for n, p in parallel.named_parameters()} == flags
    batch = _batch(2 * mesh.depth * mesh.q)
    pixels = batch["pixel_values"].clone().requires_grad_(not frozen_tower)
    pixels_ref = batch["pixel_values"].clone().requires_grad_(not frozen_tower)

    out_ref = serial(**{**batch, "pixel_values": pixels_ref})
    out_ref.loss.backward()
    out = parallel(**_local({**batch, "pixel_values": pixels}, mesh))  # logits [b/(d·q), s, 96/q]
    out.loss.backward()
    if not frozen_tower:  # scatter_batch's backward sums the row's parts of the images' gradient
        assert_close(pixels.grad, pixels_ref.grad, 1e-4, "pixel gradient")

    assert_close(gather(out.logits.detach(), mesh)[..., :96], out_ref.logits, 1e-4, "logits")
    assert_close(out.loss, out_ref.loss, 1e-5, "loss")
    features = gather(_image_features(out).detach(), mesh)  # [rows/(d·q), 60/q] → [rows, 60]
    assert_close(features, _image_features(out_ref), 1e-4, "image features")
    if frozen_tower:
        assert all(p.grad is None for p in parallel.model.vision_tower.parameters())
        assert parallel.model.multi_modal_projector.linear_1.weight.grad is not None
    compare_step(serial, parallel, mesh)


def test_text_only_batch(mesh):
    serial = _llava()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    batch = _batch(2 * mesh.depth * mesh.q)
    del batch["pixel_values"]
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE, 7)

    out_ref = serial(**batch)
    out = parallel(**_local(batch, mesh))

    assert _image_features(out) is None
    assert_close(gather(out.logits.detach(), mesh)[..., :96], out_ref.logits, 1e-4, "logits")
    assert_close(out.loss.detach(), out_ref.loss, 1e-5, "loss")
    del batch["labels"]  # generate: full inputs on every rank, serial's tokens; with images refused
    tokens = parallel.generate(**batch, max_new_tokens=2, do_sample=False)
    assert torch.equal(tokens, serial.generate(**batch, max_new_tokens=2, do_sample=False))
    with pytest.raises(ValueError, match="pixel_values not supported"):
        parallel.generate(**batch, pixel_values=torch.randn(len(tokens), 3, 16, 16), max_new_tokens=2)
    if mesh.depth * mesh.q > 1:  # a batch that does not divide is refused by scatter_batch, on every rank
        with pytest.raises(ValueError, match="is not divisible by depth·q"):
            scatter_batch(torch.randn(2 * mesh.depth * mesh.q - 1, 3, 16, 16), mesh)


@pytest.mark.parametrize("case", ["short", "moved"])
def test_placeholders_that_do_not_match_are_refused_on_every_rank(world, mesh_shape, case):
    """Counts that differ on any rank: the same ValueError on every rank, before the language model
    runs. "short": the last sample lost its image tokens (serial refuses too), wrong on its ranks
    only; "moved": right in total, as serial checks, but the last block's tokens in the first block."""
    q, depth = mesh_shape
    if case == "moved" and depth * q == 1:
        pytest.skip("one batch block")
    mesh = optimus2d.Mesh(q, depth)  # a mesh of its own: a disagreement is fatal to a mesh
    parallel = parallelize(_llava(), mesh)
    batch = _batch(2 * depth * q)
    del batch["labels"]
    ids = batch["input_ids"]
    ids[-1][ids[-1] == IMAGE] = 7
    if case == "moved":
        ids[0, -ROWS:] = IMAGE
    match = "rank 0 refused it: .* do not match.*rank \\d+ refused it: " if case == "moved" else "do not match"
    with pytest.raises(ValueError, match=match):
        parallel(**_local(batch, mesh))


def test_feature_layers_concatenated_on_the_hidden_dim_are_refused(mesh):
    with pytest.raises(ValueError, match=r"vision_feature_layer=\[-2, -1\] is not supported"):
        parallelize(_llava(vision_feature_layer=[-2, -1]), mesh)


def _received(src, dst, kind: str, shape: tuple[int, ...]) -> int:
    """Elements all ranks receive moving ``shape`` from ``src``'s layout to ``dst``'s: each rank's
    new box less what it holds (``optimus2d.redistribute``'s formula)."""
    from optimus2d.comm.redistribution import boxes

    old = dict(zip(src.ranks, boxes(src, kind, shape), strict=True))
    total = 0
    for rank, box in zip(dst.ranks, boxes(dst, kind, shape), strict=True):
        both = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, old[rank], strict=True)]
        total += math.prod(b - a for a, b in box) - math.prod(max(0, b - a) for a, b in both)
    return total if (src.q, src.depth) != (dst.q, dst.depth) else 0


@pytest.mark.parametrize("frozen_tower", [True, False], ids=["frozen_tower", "trained"])
def test_vision_tower_on_its_own_mesh(world, frozen_tower):
    """``plan={"model.vision_tower": other}`` for every other mesh shape of the world (2×2 ↔ 1×1×4,
    2×2×2 ↔ 1×1×8, 3×3 ↔ 1×1×9): images move to the tower's mesh, the feature layer LLaVA reads
    moves back (only it: ``hidden_states`` move when read), and logits, loss and one AdamW step
    equal serial's."""
    from conftest import _meshes, mesh_shapes

    shapes = mesh_shapes(world.size)
    if len(shapes) < 2:
        pytest.skip("needs two mesh shapes")
    for shape in shapes:
        _meshes.setdefault(shape, optimus2d.Mesh(*shape))
    batch = _batch(world.size)
    for model_shape, tower_shape in [(shapes[-1], shapes[0]), (shapes[0], shapes[-1])][: 2 if frozen_tower else 1]:
        mesh, tower = _meshes[model_shape], _meshes[tower_shape]
        serial = _llava()
        serial.model.vision_tower.requires_grad_(not frozen_tower)
        parallel = parallelize(copy.deepcopy(serial), mesh, plan={"model.vision_tower": tower})
        assert parallel.model.vision_tower.encoder.layers[0].mlp.fc1.mesh is tower
        assert parallel.model.multi_modal_projector.linear_1.mesh is mesh

        out_ref = serial(**batch)
        out_ref.loss.backward()
        with optimus2d.count_comm() as moved:
            out = parallel(**_local(batch, mesh))
        out.loss.backward()
        assert_close(gather(out.logits.detach(), mesh)[..., :96], out_ref.logits, 1e-4, "logits")
        assert_close(out.loss, out_ref.loss, 1e-5, "loss")
        assert_close(gather(_image_features(out).detach(), mesh), _image_features(out_ref), 1e-4, "features")
        # what the boundary sent, over all ranks: the images to the tower's mesh, and back its last
        # layer, its pooled output and the one feature layer LLaVA reads (hidden_states move when read)
        b = len(batch["pixel_values"])
        moves = [(mesh, tower, "batch", (b, 3, 16, 16))] + [
            (tower, mesh, "activation", shape) for shape in ((b, 5, 48), (b, 48), (b, 5, 48))
        ]
        sent = torch.tensor([moved.by("kind")[("send",)], sum(_received(*move) for move in moves)])
        torch.distributed.all_reduce(sent)
        assert sent[0] == sent[1] // world.size, sent  # every rank adds the same formula
        if frozen_tower:
            assert all(p.grad is None for p in parallel.model.vision_tower.parameters())
        scale = max(p.grad.abs().max().item() for p in serial.parameters() if p.grad is not None)
        _adamw(serial, scale).step()
        _adamw(parallel, scale).step()
        state = serial_state_dict(parallel)
        for key, value in serial.state_dict().items():
            assert_close(state[key], value, 1e-4, key)


def test_the_towers_keywords_reach_it_as_serial(mesh):
    """``interpolate_pos_encoding`` (images larger than the config's) and ``output_attentions`` reach
    the tower where serial's ``LlavaModel`` passes them (from transformers 5.24: the first raised, the
    second gave none), and not where it does not (5.23: larger images refused by both)."""
    serial = _llava()
    serial.config._attn_implementation = "eager"  # attentions given back
    parallel = parallelize(copy.deepcopy(serial), mesh)
    b = 2 * mesh.depth * mesh.q
    batch = _batch(b)
    torch.manual_seed(3)
    batch["pixel_values"] = torch.randn(b, 3, 24, 24)  # 9 patches: 9 feature rows per image
    ids = torch.randint(1, IMAGE, (b, 14))
    ids[:, 2:11] = IMAGE
    batch.update(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.masked_fill(ids == IMAGE, -100))
    with torch.no_grad():
        try:
            want = serial(**batch, interpolate_pos_encoding=True, output_attentions=True)
        except ValueError:  # transformers 5.23 keeps them from its tower: larger images refused, as here
            with pytest.raises(ValueError, match="Input image size"):
                parallel(**_local(batch, mesh), interpolate_pos_encoding=True, output_attentions=True)
            return
        got = parallel(**_local(batch, mesh), interpolate_pos_encoding=True, output_attentions=True)
    assert_close(optimus2d.gather(got.logits, mesh)[..., :96], want.logits, 1e-5, "logits")
    if hasattr(want, "image_outputs"):  # transformers 5.24 and later
        assert len(got.image_outputs.attentions) == len(want.image_outputs.attentions) == 2
