"""Hugging Face LLaMA converted by ``parallelize`` with context parallelism equals transformers' serial model.

The model runs on the sequence layout (c = the mesh's depth) inside ``context.sequence_parallel``:
token ids and shifted targets scattered by ``context.scatter_batch``, position ids from
``context.positions``. Logits, the loss, the gradients and every parameter after one AdamW step
(``helpers.compare_step``) equal serial in float64 (logits and loss ≤ 1e-6; after the step ≤ 1e-5,
the float32 bound: transformers' norms compute in float32), for a causal mask (head–tail split)
and a mixed image–text mask (makespan), with grouped-query attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, compare_step, raises_fast

import optimus2d
from optimus2d import context

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]


def _llama(q: int):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32 * q,
        intermediate_size=32 * q,
        num_hidden_layers=2,
        num_attention_heads=4 * q,
        num_key_value_heads=2 * q,  # two key/value heads a rank: repeated in the right order or not exact
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


@pytest.mark.parametrize(("kind", "method"), [("causal", "head_tail"), ("image", "makespan")])
def test_llama_with_context_parallelism_equals_serial(mesh, kind, method):
    c, q = mesh.depth, mesh.q
    b, s = 2 * q, 2 * c * 8
    mask = context.causal_mask(s) if kind == "causal" else context.image_text_mask(s, [(s // 8, s // 2)])
    a = context.assign(mask, c, method, block=4 if method == "makespan" else None)
    serial = _llama(q)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (b, s))
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]  # shifted in sequence order, before the permutation

    if kind == "causal":
        want = serial(input_ids=ids).logits
    else:
        bias = torch.zeros(s, s, dtype=torch.float64).masked_fill(~mask, float("-inf"))
        want = serial(input_ids=ids, attention_mask=bias[None, None].expand(b, 1, s, s)).logits
    loss = F.cross_entropy(want.reshape(-1, 96), targets.reshape(-1))
    loss.backward()

    with context.sequence_parallel(model, mesh, a, mask):
        positions = context.positions(a, mesh).expand(b // q, -1)
        logits = model(input_ids=context.scatter_batch(ids, mesh, a), position_ids=positions).logits
    got_loss = optimus2d.cross_entropy(logits, context.scatter_batch(targets, mesh, a), mesh)
    got_loss.backward()
    assert_close(context.gather(logits, mesh, a), want, 1e-6, "logits")
    assert_close(got_loss, loss, 1e-6, "loss")
    assert model.config._attn_implementation == "sdpa"  # restored after the block

    # the gradients, their norm, then one AdamW step with eps a thousandth of the largest gradient.
    # transformers' RMSNorm computes in float32 inside a float64 model: about 1e-7 on the logits (on
    # a 2x2 mesh with c = 1 as with c = 4), which Adam's division by |g| turns into a few 1e-6 on
    # some parameters after the step; so the step is held to the float32 bound
    compare_step(serial, model, mesh, tol=1e-5)


def test_a_padding_mask_or_missing_positions_are_refused_on_every_rank(mesh):
    """Inside ``sequence_parallel`` transformers dropped a 2D padding mask (for a kernel it does not
    know) and handed a 4D one to the kernel, which applies the mask given to ``sequence_parallel``
    alone: left padding 0.15 off, a documents' 4D mask 0.26; without position_ids the tokens were
    numbered 0.. on each rank (1.3e-3 off). Each refused on every rank, also where one rank alone
    pads (last, on a mesh of its own: a refusal some ranks make leaves the mesh unusable); a mask of
    ones is taken."""
    c, q = mesh.depth, mesh.q
    b, s = 2 * q, 2 * c * 4
    mask = context.causal_mask(s)
    a = context.assign(mask, c, "head_tail")
    own = optimus2d.Mesh(q, c) if mesh.size > 1 else mesh
    model = optimus2d.parallelize(_llama(q), own)
    ids = context.scatter_batch(torch.randint(0, 96, (b, s)), own, a)
    positions = context.positions(a, own).expand(ids.shape[0], -1)
    padded = torch.ones_like(ids)
    if own.rank == own.ranks[-1]:
        padded[0, 0] = 0  # one rank's sample padded
    four_d = torch.ones(ids.shape[0], 1, ids.shape[1], s, dtype=torch.bool)
    with context.sequence_parallel(model, own, a, mask):
        model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids))  # ones: taken
        message = raises_fast(ValueError, "sequence_parallel", lambda: model(
            input_ids=ids, position_ids=positions, attention_mask=four_d
        ))  # fmt: skip
        assert "masks tokens" in message
        raises_fast(ValueError, "without position_ids", lambda: model(input_ids=ids))
        embeds = model.model.embed_tokens(ids)  # input_ids=None beside them: still refused
        raises_fast(ValueError, "without position_ids", lambda: model(input_ids=None, inputs_embeds=embeds))
        raises_fast(ValueError, "sequence_parallel", lambda: model(  # one rank's: the others name it
            input_ids=ids, position_ids=positions, attention_mask=padded
        ))  # fmt: skip
