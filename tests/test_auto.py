"""The planner behind ``plan="auto"`` (``optimus2d.cost.auto``): candidates, prices and choices.

No communication: a ``Hardware`` is given. The choices follow the cost model's trends: few tokens a
weight (weight-heavy) favour 1D, which moves activations; many favour the meshes, which move weight
blocks or split activations; a memory cap moves the choice to a layout that fits."""

from __future__ import annotations

import dataclasses

import pytest

from optimus2d.cost.auto import Block, candidates, choose, predict
from optimus2d.cost.planner import Hardware

HW = Hardware(flops=50e9, bandwidth=2e9, latency=50e-6, bytes_per_element=4)


def _mlp(rows: int, **kw) -> Block:
    return Block("mlp", "mlp", rows, 1024, 4096, splits_1d=True, **kw)


def test_candidates_are_every_mesh_shape_then_1d_where_the_module_splits():
    assert candidates(_mlp(8), 4) == ["2×2×1", "1×1×4", "1d"]
    assert candidates(_mlp(8), 8) == ["2×2×2", "1×1×8", "1d"]
    assert candidates(_mlp(8), 9) == ["3×3×1", "1×1×9", "1d"]
    assert candidates(Block("x", "mlp", 8, 64, 256), 4) == ["2×2×1", "1×1×4"]  # splits_1d False
    assert candidates(_mlp(8), 1) == ["1×1×1"]


def test_few_tokens_pick_1d_many_pick_a_mesh():
    assert choose([_mlp(1024)], 4, HW).layouts == {"mlp": "1d"}
    assert choose([_mlp(1 << 17)], 4, HW).layouts["mlp"] != "1d"


def test_a_memory_cap_moves_the_choice_to_a_layout_that_fits():
    free = choose([_mlp(1 << 15)], 4, HW)
    table = {row[0]["mlp"]: row[2] for row in free.table}
    cap = min(table.values()) * 1.01  # only the leanest layout fits
    lean = min(table, key=table.get)
    capped = choose([_mlp(1 << 15)], 4, HW, memory_cap=cap)
    assert capped.layouts == {"mlp": lean} and capped.memory <= cap
    assert [row[3] for row in capped.table].count(True) == 1 and capped.table[0][3]
    nothing = choose([_mlp(1 << 15)], 4, HW, memory_cap=1.0)  # none fits: the least memory
    assert nothing.layouts == {"mlp": lean} and not nothing.table[0][3]


def test_the_table_holds_every_combination_best_first_and_explains_it():
    blocks = [_mlp(4096), Block("head", "mlp", 4096, 1024, 1024, frozen=True, input_grad=True, splits_1d=True)]
    choice = choose(blocks, 4, HW)
    assert len(choice.table) == 9  # 3 × 3
    times = [row[1] for row in choice.table]
    assert times == sorted(times) and choice.seconds == times[0]
    text = choice.explain(limit=3)
    assert text.count("\n") == 3 and "predicted ms" in text and "mlp: " in text and "head: " in text
    assert "measured ms" not in text and text.splitlines()[1].endswith("<- picked")


def test_measured_rows_get_their_column_and_show_past_the_limit():
    choice = choose([_mlp(4096)], 4, HW)
    slow_first = dataclasses.replace(choice, layouts=choice.table[2][0], measured={0: 0.5, 2: 0.25})
    lines = slow_first.explain(limit=1).splitlines()
    assert "measured ms" in lines[0] and len(lines) == 3  # row 0, and row 2 although past the limit
    assert "500.00" in lines[1] and "250.00" in lines[2] and lines[2].endswith("<- picked")
    assert "<- picked" not in lines[1]


def test_a_frozen_block_is_cheaper_and_holds_no_gradients_or_moments():
    trained, frozen = _mlp(4096), _mlp(4096, frozen=True)
    for layout in ("2×2×1", "1×1×4", "1d"):
        t_trained, m_trained = predict(trained, layout, 4, HW)
        t_frozen, m_frozen = predict(frozen, layout, 4, HW)
        assert t_frozen < t_trained and m_frozen < m_trained
    # frozen without an input gradient: no backward at all, only the weights (4 bytes an element)
    assert predict(frozen, "1×1×4", 4, HW)[1] == pytest.approx(2 * 1024 * 4096 * 4)


def test_a_boundary_between_mesh_shapes_is_priced_by_what_redistribute_moves():
    a = Block("a", "mlp", 4096, 1024, 4096)
    b = Block("b", "mlp", 4096, 1024, 4096, input_grad=True)
    same = next(row for row in choose([a, b], 4, HW).table if row[0] == {"a": "2×2×1", "b": "2×2×1"})
    moved = next(row for row in choose([a, b], 4, HW).table if row[0] == {"a": "2×2×1", "b": "1×1×4"})
    alone = predict(b, "1×1×4", 4, HW)[0] - predict(b, "2×2×1", 4, HW)[0]
    assert moved[1] - same[1] > alone  # the move of b's input (and its gradient back) costs on top


def test_the_blocks_are_the_mlps_with_their_flags_in_order():
    """``plan="auto"``'s blocks: every MLP the 1D split knows, outermost first, the model itself
    excepted; frozen when none of its weights trains; an input gradient when something before it trains
    (the model's own parameters first, as a class token); a gated MLP priced as f' = 3f/2."""
    import torch
    from torch import nn

    from optimus2d.convert.auto import _blocks

    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2)

    class Model(nn.Module):
        def __init__(self, token: bool) -> None:
            super().__init__()
            if token:
                self.token = nn.Parameter(torch.zeros(8))
            self.tower = nn.Module()
            self.tower.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).requires_grad_(False)
            self.mid = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # no activation between: a Sequential MLP
            self.gated = transformers.models.llama.modeling_llama.LlamaMLP(llama)

    blocks = _blocks(Model(token=False), tokens=64, ranks=4)
    assert [(b.path, b.hidden, b.ffn, b.frozen, b.input_grad) for b in blocks] == [
        ("tower.mlp", 8, 32, True, False),
        ("mid", 8, 8, False, False),  # 2·h·f = 8·8 + 8·8
        ("gated", 8, 24, False, True),  # 3·8·16 = 2·8·24
    ]
    assert all(b.splits_1d and b.rows == 64 and b.kind == "mlp" for b in blocks)
    assert [b.input_grad for b in _blocks(Model(token=True), tokens=64, ranks=4)] == [True, True, True]
    assert [b.splits_1d for b in _blocks(Model(token=False), tokens=64, ranks=3)] == [False, False, False]


def test_torch_transformer_layers_are_blocks_offered_only_the_grids_their_sizes_divide():
    from torch import nn

    from optimus2d.convert.auto import _blocks

    def layer(heads):
        return nn.TransformerEncoderLayer(24, heads, 48, dropout=0.0, batch_first=True)

    model = nn.Sequential(layer(3), layer(6))
    model[0].requires_grad_(False)
    blocks = _blocks(model, tokens=64, ranks=4, seq=8, own_q=1)
    got = [(b.path, b.kind, b.hidden, b.ffn, b.heads, b.seq, b.frozen, b.input_grad) for b in blocks]
    assert got == [("0", "layer", 24, 48, 3, 8, True, False), ("1", "layer", 24, 48, 6, 8, False, False)]
    assert candidates(blocks[0], 4) == ["1×1×4"] and candidates(blocks[1], 4) == ["2×2×1", "1×1×4"]
    assert candidates(_blocks(model, tokens=64, ranks=4, own_q=2)[0], 4) == ["2×2×1", "1×1×4"]  # the mesh's own
    few = _blocks(model, tokens=16, ranks=4, seq=8, own_q=2)  # a batch of 2: 1×1×4 cannot split it
    assert [candidates(b, 4) for b in few] == [["2×2×1"], ["2×2×1"]]


def test_a_part_of_blocks_is_laid_out_whole_with_one_boundary_in_and_out():
    """A module of two or more blocks of one width (an ``nn.TransformerEncoder``, a Sequential of
    MLPs) is one "part": laid out whole on each mesh shape, its boundary paid once; MLPs alone in 1D."""
    from torch import nn

    from optimus2d.convert.auto import _blocks

    def layer():
        return nn.TransformerEncoderLayer(24, 4, 48, dropout=0.0, batch_first=True)

    def mlp(width=24):
        return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.TransformerEncoder(layer(), 3, norm=nn.LayerNorm(24), enable_nested_tensor=False)
            self.mlps = nn.Sequential(mlp(), nn.LayerNorm(24), mlp())
            self.mixed = nn.Sequential(mlp(), nn.Linear(24, 24), mlp())  # a weight of its own: no part
            self.widths = nn.Sequential(mlp(), nn.Linear(24, 12), mlp(12))  # two widths: no part
            self.head = mlp()

    model = Model()
    model.encoder.requires_grad_(False)
    blocks = _blocks(model, tokens=64, ranks=4, seq=8, own_q=2)
    assert [(b.path, b.kind) for b in blocks] == [
        ("encoder", "part"), ("mlps", "part"), ("mixed.0", "mlp"), ("mixed.2", "mlp"), ("widths.0", "mlp"),
        ("widths.2", "mlp"), ("head", "mlp"),
    ]  # fmt: skip
    encoder, mlps = blocks[:2]
    assert [b.path for b in encoder.inner] == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    assert encoder.frozen and not encoder.input_grad and encoder.qs == (1, 2) and encoder.hidden == 24
    assert encoder.params == sum(b.params for b in encoder.inner)
    for layout in ("2×2×1", "1×1×4"):  # whole: its blocks' prices summed
        assert predict(encoder, layout, 4, HW) == tuple(
            map(sum, zip(*(predict(b, layout, 4, HW) for b in encoder.inner), strict=True))
        )
    options = {tuple(sorted(row[0].items())) for row in choose([encoder], 4, HW, layout="2×2×1").table}
    each = tuple((f"encoder.layers.{n}", "1d") for n in range(3))  # torch's layers split by heads in 1D too
    assert options == {(("encoder", "2×2×1"),), (("encoder", "1×1×4"),), (("encoder", "1d"),), each}
    inside = [predict(b, "1d", 4, HW, boundary=False) for b in encoder.inner]  # whole in 1D: one gather in
    gather = 64 * 24 * 3 / 4 * 4 / HW.bandwidth + 2 * HW.latency  # forward only (frozen); latency · log2(4)
    assert predict(encoder, "1d", 4, HW)[0] == pytest.approx(sum(t for t, _ in inside) + gather, rel=1e-12)
    assert predict(encoder.inner[0], "1d", 4, HW)[0] == pytest.approx(inside[0][0] + gather, rel=1e-12)
    rows = {tuple(sorted(row[0].items())): row[1] for row in choose([mlps], 4, HW, layout="2×2×1").table}
    assert set(rows) == {
        (("mlps", "2×2×1"),), (("mlps", "1×1×4"),), (("mlps", "1d"),), (("mlps.0", "1d"), ("mlps.2", "1d"))
    }  # fmt: skip
    assert rows[(("mlps", "1d"),)] < rows[(("mlps.0", "1d"), ("mlps.2", "1d"))]  # one boundary, not two
    whole = predict(mlps, "1×1×4", 4, HW)[0]
    one_boundary = rows[(("mlps", "1×1×4"),)] - whole  # in and out once, not around each MLP
    alone = choose([mlps.inner[0]], 4, HW, layout="2×2×1").table
    assert one_boundary == pytest.approx(next(r[1] for r in alone if r[0] == {"mlps.0": "1×1×4"}) - predict(
        mlps.inner[0], "1×1×4", 4, HW)[0])  # fmt: skip


def _llama(layers: int):
    """A tiny ``LlamaForCausalLM``: vocabulary 64, hidden 32, MLP 64, 4 heads (skipped without transformers)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_llama_stack_is_a_region_offered_whole_in_1d_or_left_with_its_mlps_alone():
    """LLaMA's ``model`` holds attention Megatron splits: one region, whole in 1D (its embedding then
    whole on every rank) or on the mesh with each MLP laid out alone; not where 1D is refused."""
    from optimus2d.convert.auto import _blocks

    model = _llama(layers=3)
    [region] = _blocks(model, tokens=64, ranks=4, seq=8, own_q=2)
    assert (region.path, region.kind, region.layers, region.hidden, region.heads) == ("model", "region", 3, 32, 4)
    assert [b.path for b in region.inner] == [f"model.layers.{n}.mlp" for n in range(3)]
    assert region.ffn == 96 and region.other == 64 * 32  # gated: 3·64/2; the embedding
    table = {tuple(sorted(row[0].items())): row for row in choose([region], 4, HW, layout="2×2×1").table}
    assert len(table) == 1 + 3**3  # whole in 1D; each MLP on 2×2, 1×1×4 or in 1D
    mlps = [f"model.layers.{n}.mlp" for n in range(3)]
    stay = table[tuple(sorted({"model": "2×2×1", **dict.fromkeys(mlps, "2×2×1")}.items()))]
    assert stay[1] == pytest.approx(predict(region, "2×2×1", 4, HW)[0])
    assert table[(("model", "1d"),)][1] == pytest.approx(predict(region, "1d", 4, HW)[0])
    layers = sum(predict(region.layer(n == 0), "1d", 4, HW)[1] for n in range(3))
    assert predict(region, "1d", 4, HW)[1] == pytest.approx(layers + 64 * 32 * 16)  # the embedding whole, trained
    assert all(b.kind == "mlp" for b in _blocks(model, tokens=63, ranks=3, seq=1))  # 4 heads on 3 ranks: no region


def test_torchs_decoder_layer_is_not_priced_as_an_mlp():
    """Its linears split in 1D, but it holds attention: not an MLP block (it stays on the model's mesh)."""
    from torch import nn

    from optimus2d.convert.auto import _blocks

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
            self.head = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    assert [(b.path, b.kind) for b in _blocks(Decoder(), tokens=64, ranks=4, seq=8, own_q=2)] == [("head", "mlp")]


def test_whole_io_prices_a_block_at_the_models_edges_as_it_runs():
    """``parallelize(io="whole")``: a block taking the model's whole input and giving its whole output
    pays nothing at the edges in 1D (the whole tensors taken and given as they are) and, on a mesh,
    one all-gather of its output forward (nothing to enter: each rank cuts its block); ``_edges``
    places them on a wrapper of one module, on neither where the model holds weights of its own."""
    import torch
    from torch import nn

    from optimus2d.convert.auto import _blocks, _edges
    from optimus2d.cost.planner import comm_time

    block = _mlp(1024)
    edged = dataclasses.replace(block, whole_in=True, whole_out=True)
    gather = comm_time([("all_gather", 4, 1024 * 1024 * 2, 2)], HW, 0.0)  # the input in, the gradient out
    assert predict(block, "1d", 4, HW)[0] - predict(edged, "1d", 4, HW)[0] == pytest.approx(gather)
    rows = {row[0]["mlp"]: row[1] for row in choose([edged], 4, HW, layout="2×2×1").table}
    out = comm_time([("all_gather", 4, 1024 * 1024, 1)], HW, 0.0)
    assert rows["2×2×1"] == pytest.approx(predict(block, "2×2×1", 4, HW)[0] + out)
    assert rows["1d"] == pytest.approx(predict(edged, "1d", 4, HW)[0])
    assert choose([edged], 4, HW).seconds < choose([block], 4, HW).seconds  # 1D: weight-heavy, cheaper still

    class Holder(nn.Module):
        def __init__(self, token: bool) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
            self.token = nn.Parameter(torch.zeros(8)) if token else None

    for token in (False, True):
        (priced,) = _edges(Holder(token), _blocks(Holder(token), 64, 4))
        assert (priced.whole_in, priced.whole_out) == (not token, not token)


def test_an_example_prices_each_block_at_the_rows_it_sees():
    """``Auto(example=)``: each block at the rows and sequence of the first tensor it is called with in
    a forward on the meta device (a pool before the LM: a quarter of the encoder's; a layer not
    ``batch_first``: its sequence from dim 0; ids: a region's rows), not ``tokens`` and ``seq``;
    a forward that cannot run on meta is refused, naming its error."""
    import torch
    from torch import nn

    from optimus2d.convert.auto import _blocks

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(24, 4, 48, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.proj = nn.Linear(24, 32)
            self.lm = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)  # [s, b, h]
            self.head = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pooled = self.encoder(x).unflatten(1, (-1, 4)).mean(dim=2)  # [b, s/4, 24]
            return self.head(self.lm(self.proj(pooled).transpose(0, 1)))

    model, x = Pooled(), torch.randn(6, 16, 24)
    plain = {b.path: (b.rows, b.seq) for b in _blocks(model, tokens=96, ranks=4, seq=16)}
    assert plain == {"encoder": (96, 16), "lm": (96, 16), "head": (96, 16)}
    blocks = _blocks(model, tokens=96, ranks=4, seq=16, example=x)
    seen = {b.path: (b.rows, b.seq) for b in blocks}  # the head: [4, 6, 32], 6 rows a slice of dim 0
    assert seen == {"encoder": (96, 16), "lm": (24, 4), "head": (24, 6)}
    assert [(b.rows, b.seq) for b in blocks[0].inner] == [(96, 16)] * 2
    assert not any(t.is_meta for t in model.parameters())  # the model itself untouched
    keyword = {b.path: b.rows for b in _blocks(model, 96, 4, 16, example={"x": x})}
    assert keyword == {"encoder": 96, "lm": 24, "head": 24}

    class Counts(Pooled):  # reads a value: not on meta, so once for real (no_grad, eval), as LLaVA's forward
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = int(x.abs().sum().item() > 0) * x.shape[1] // 2
            return self.head(self.lm(self.proj(self.encoder(x)[:, :keep]).transpose(0, 1)))

    counts = Counts().train()
    counts.encoder.requires_grad_(False)
    seen = {b.path: (b.rows, b.seq) for b in _blocks(counts, 96, 4, 16, example=x)}
    assert seen == {"encoder": (96, 16), "lm": (48, 8), "head": (48, 6)}
    assert all(m.training for m in counts.modules()) and all(p.grad is None for p in counts.parameters())
    with torch.device("meta"):  # nothing to run for real
        unreal = Counts()
    with pytest.raises(ValueError, match=r"Auto\(example=\) runs the model once .* on the meta device .*item"):
        _blocks(unreal, tokens=96, ranks=4, seq=16, example=x)


def test_an_example_gives_a_llama_region_the_rows_of_its_ids():
    import torch

    from optimus2d.convert.auto import _blocks

    model = _llama(layers=2)
    ids = torch.randint(0, 64, (3, 10))
    [region] = _blocks(model, tokens=64, ranks=4, seq=8, own_q=2, example={"input_ids": ids})
    assert (region.path, region.rows, region.seq) == ("model", 30, 10)
    assert [(b.rows, b.seq) for b in region.inner] == [(30, 10)] * 2  # each MLP: [3, 10, 32]


def test_an_example_gives_llavas_tower_projector_and_lm_their_own_rows():
    """LLaVA reads its image tokens' count (``.item()``): traced once for real. The tower sees 5 tokens
    an image (4 patches and the class token), the projector 4, the LM the text's 10 a sample."""
    transformers = pytest.importorskip("transformers")
    import torch

    from optimus2d.convert.auto import _blocks

    vision = transformers.CLIPVisionConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, image_size=16, patch_size=8
    )
    text = transformers.LlamaConfig(
        vocab_size=96, hidden_size=60, intermediate_size=120, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=6, max_position_embeddings=32,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=95, vision_feature_layer=-2,
        vision_feature_select_strategy="default", attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlavaForConditionalGeneration(config)
    ids = torch.randint(1, 95, (3, 10))
    ids[:, 1:5] = 95  # one image a sample: its 4 feature rows
    example = {"input_ids": ids, "pixel_values": torch.randn(3, 3, 16, 16)}
    seen = {b.path.rpartition(".")[2] if "layers" not in b.path else b.path: (b.rows, b.seq)
            for b in _blocks(model, tokens=64, ranks=4, seq=16, own_q=2, example=example)}  # fmt: skip
    assert seen == {
        "model.vision_tower.encoder.layers.0.mlp": (15, 5), "model.vision_tower.encoder.layers.1.mlp": (15, 5),
        "multi_modal_projector": (12, 4), "model.language_model.layers.0.mlp": (30, 10),
    }  # fmt: skip


def test_an_examples_call_and_description_what_a_block_reads_of_it():
    """A tokenizer's mapping is keyword arguments, anything but a tensor, a tuple or a mapping is refused;
    the description keeps keywords (in any order) and shapes, and names objects by type (their repr
    holds an address that differs by rank). A block reads its activation wherever it is in the call,
    ids only without one (the largest), and skips empty and nested tensors."""
    from collections import UserDict

    import torch
    from torch import nn

    from optimus2d.convert.auto_example import call_of, describe, traced_rows

    x, ids = torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    assert call_of(UserDict(input_ids=ids)) == ((), {"input_ids": ids}) and call_of([x]) == ((x,), {})
    with pytest.raises(TypeError, match=r"Auto\(example=\) is one step's inputs.*not int"):
        call_of(5)
    assert describe({"b": ids, "a": x}) == describe({"a": x, "b": ids}) != describe({"a": ids, "b": x})
    assert describe((x, None, 3, object())) == "((2, 3, 8):torch.float32, None, 3, object)"

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, position_ids=None, hidden=None, ids=None):
            return self.fc(hidden) if hidden is not None else self.fc(torch.zeros(*ids.shape, 8))

    class Calls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second, self.empty = Block(), Block(), Block()

        def forward(self, x, ids):
            self.empty(hidden=x[:0])  # no rows: not read (its later call is)
            self.empty(hidden=x)
            positions = torch.arange(x.shape[1])[None]
            return self.first(position_ids=positions, hidden=x) + self.second(position_ids=positions, ids=ids)

    seen = traced_rows(Calls(), (x, ids), {"first": 8, "second": 8, "empty": 8})
    assert seen == {"empty": (6, 3), "first": (6, 3), "second": (6, 3)}  # ids [2, 3], not positions [1, 3]


def test_a_module_sharing_a_parameter_with_the_rest_is_not_offered():
    """A module held at two paths, or tied to a module outside it, is not a block, part or region:
    moved alone, its other holder would stay behind (``parallelize`` refuses it); what is inside it
    and entangled with nothing still is."""
    import torch
    from torch import nn

    from optimus2d.convert.auto import _blocks

    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.again = self.mlp  # the same MLP at a second path
            self.other = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.other(self.again(self.mlp(x)))

    assert [b.path for b in _blocks(Aliased(), tokens=64, ranks=4)] == ["other"]
    model = _llama(layers=2)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    assert [(b.path, b.kind) for b in _blocks(model, tokens=64, ranks=4, seq=8, own_q=2)] == [
        ("model.layers.0.mlp", "mlp"),
        ("model.layers.1.mlp", "mlp"),
    ]


def test_a_damaged_calibration_cache_is_measured_again_and_rewritten(tmp_path):
    """The cache is read and written on one rank alone (the others wait in the broadcast): a file
    that is JSON but not a table, or an entry past float's range, reads as absent and never raises
    (it raised TypeError / OverflowError on rank 0 alone, and the others timed out)."""
    import json

    from optimus2d.cost.calibration import _cached, _store

    path = tmp_path / "hardware.json"
    good = [1e9, 2e9, 1e-5, 3e9, 2e-5]
    for text in ("[]", "3", '"x"', "{not json", json.dumps({"k": [10**400, 1, 1, 1, 1]}),
                 json.dumps({"k": [True, 1, 1, 1, 1]}), json.dumps({"k": [1, 1, 1]}),
                 json.dumps({"k": [1, 0, 1, 1, 1]})):  # fmt: skip
        path.write_text(text)
        assert _cached(path, "k") is None, text
        _store(path, "k", good)
        assert _cached(path, "k") == good, text
    _store(path, "other", [2.0] * 5)
    assert json.loads(path.read_text()) == {"k": good, "other": [2.0] * 5}


def test_the_model_is_priced_in_its_own_dtype():
    """This machine's costs are measured in fp32; ``plan="auto"`` prices a model's weights, gradients,
    moments, activations and messages in its own dtype (it priced 4 bytes for fp64 and bf16 alike)."""
    import torch
    from torch import nn

    from optimus2d.convert.auto import _element_size

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert _element_size(model) == 4
    assert _element_size(model.double()) == 8
    assert _element_size(model.to(torch.bfloat16)) == 2
    assert _element_size(nn.ReLU()) == 4  # no parameters: fp32
    trained, frozen = _mlp(4096), _mlp(4096, frozen=True)
    for dtype_bytes in (2, 8):
        hw = dataclasses.replace(HW, bytes_per_element=dtype_bytes)
        assert predict(frozen, "1×1×4", 4, hw)[1] == pytest.approx(2 * 1024 * 4096 * dtype_bytes)
        assert predict(trained, "1d", 4, hw)[1] == pytest.approx(dtype_bytes / 4 * predict(trained, "1d", 4, HW)[1])
