"""``pipeline.propose_placement``: an encoder and the model after it, together on every rank or apart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from optimus2d.cost.planner import Hardware, Layer, Part, part_time, propose_layouts
from optimus2d.pipeline import propose_placement

HW = Hardware(flops=1e11, bandwidth=1e9, latency=1e-5, bytes_per_element=4)


def _parts(batch: int = 8, seq: int = 16, frozen: bool = True) -> tuple[Part, Part]:
    encoder = Part("encoder", Layer(batch, seq, 64, 256, 4), 2, frozen=frozen)
    return encoder, Part("lm", Layer(batch, seq, 128, 512, 4), 2, input_grad=not frozen)


def test_together_rows_are_the_layout_planners_and_the_pick_is_the_cheapest():
    encoder, lm = _parts()
    placement = propose_placement(encoder, lm, 4, HW)
    together = {(c.encoder, c.rest): c.seconds for c in placement.table if not c.encoder_ranks}
    layouts = propose_layouts([encoder, lm], 4, HW)
    assert together == {(r[0]["encoder"], r[0]["lm"]): r[1] for r in layouts.table}  # 2×2 and 1×1×4, each pair
    apart = [(c.encoder_ranks, c.encoder, c.rest) for c in placement.table if c.encoder_ranks]
    assert apart == [(2, (1, 2), (1, 2))]  # 1 + 3: 1×1×3 cannot split a micro-batch of 4
    assert placement.best is min(placement.table, key=lambda c: c.seconds)
    assert placement.table[0] is placement.best and placement.encoder_ranks == placement.best.encoder_ranks
    assert "apart: encoder on 2 ranks as 1×1×2, rest on 2 as 1×1×2" in placement.explain()


@pytest.mark.parametrize("frozen", [True, False])
def test_apart_is_torchs_1f1b_replayed_with_each_sets_part(frozen):
    """Free links: the frozen encoder's forwards (e a micro-batch) then, on the LM's ranks, 1F1B's
    F B F B (m each, a third forward): e + 2m when e ≤ m. Trained, the encoder's backward follows the
    LM's: e/3 (F0) + m (F1, B1) + 2e/3 (B0) for the first micro-batch, then the second's."""
    free = replace(HW, bandwidth=float("inf"), latency=0.0)
    encoder, lm = _parts(frozen=frozen)
    encoder = replace(encoder, layers=1)
    [c] = [c for c in propose_placement(encoder, lm, 4, free).table if c.encoder_ranks]
    e, m = (part_time(replace(p, layer=replace(p.layer, batch=4)), 1, 2, free) for p in (encoder, lm))
    assert e <= m
    # trained: F0(0) F0(1) on the encoder's ranks, F1(0) B1(0) F1(1) B1(1) on the LM's, B0(0) after B1(0)
    # and B0(1) after B1(1): the LM's ranks finish at e/3 + 2m, then B0(1) takes 2e/3
    assert c.seconds == pytest.approx(e + 2 * m if frozen else e / 3 + 2 * m + 2 * e / 3, rel=1e-12)
    if frozen:  # with links: the features cross once a micro-batch, forward only (the first's delays the LM)
        [c] = [c for c in propose_placement(encoder, lm, 4, HW).table if c.encoder_ranks]
        e, m = (part_time(replace(p, layer=replace(p.layer, batch=4)), 1, 2, HW) for p in (encoder, lm))
        sent = 4 * 16 * 64 / 2 * 4 / HW.bandwidth + HW.latency  # a micro-batch's features, a rank's half
        assert c.seconds == pytest.approx(e + sent + 2 * m, rel=1e-12)


def test_a_memory_cap_picks_what_fits_and_the_least_memory_when_nothing_does():
    encoder, lm = _parts(frozen=False)
    free = propose_placement(encoder, lm, 4, HW)
    cap = sorted(c.memory for c in free.table)[1]  # the two smallest fit
    capped = propose_placement(encoder, lm, 4, HW, memory_cap=cap)
    assert capped.best.fits and capped.best.memory <= cap
    assert capped.best.seconds == min(c.seconds for c in capped.table if c.memory <= cap)
    assert all(c.fits == (c.memory <= cap) for c in capped.table)
    none = propose_placement(encoder, lm, 4, HW, memory_cap=1.0)
    assert not none.best.fits and none.best.memory == min(c.memory for c in none.table)


def test_apart_offers_the_rest_no_q_that_does_not_split_the_features_it_receives():
    """The features crossing the sets are [mb, P, encoder hidden], split by the rest's q: an encoder
    of hidden 45 leaves the rest 1×1×4, not 2×2 (which rank_set_stage refuses)."""
    encoder = Part("encoder", Layer(8, 5, 45, 90, 5), 2, frozen=True)
    lm = Part("lm", Layer(8, 16, 64, 128, 4), 2, input_grad=True)
    placement = propose_placement(encoder, lm, 5, HW, microbatches=2)
    apart = [c for c in placement.table if c.encoder_ranks]
    assert apart and all(c.rest[0] == 1 for c in apart), [c.describe(5) for c in apart]
    assert any(c.rest == (2, 1) for c in propose_placement(*_parts(), 5, HW, microbatches=2).table)


def test_no_placement_splits_the_batch_is_refused():
    encoder, lm = _parts(batch=3)
    with pytest.raises(ValueError, match="splits the batch 3"):
        propose_placement(encoder, lm, 4, HW)
    with pytest.raises(ValueError, match="world 4 and microbatches 0 must be at least 1"):
        propose_placement(*_parts(), 4, HW, microbatches=0)
    with pytest.raises(ValueError, match="differ"):
        propose_placement(encoder, replace(lm, layer=replace(lm.layer, batch=4)), 4, HW)


def test_one_d_layouts_price_megatrons_split_and_the_gathers_around_it():
    """``propose_layouts(one_d=True)``: the mesh pairs as before, and each part in 1D priced by the
    planner's 1D layer (frozen prefix: its two forward all-reduces only), its input all-gathered in
    (the model's input too, a block of the mesh beside it) and its output's gradient all-gathered out."""
    from optimus2d.cost.planner import DTENSOR, ONE_D, activation_elements, layer_comm, layout_memory, layout_time

    encoder, lm = _parts()  # the encoder frozen, a prefix: no backward
    meshes = {tuple(r[0].values()): r[1] for r in propose_layouts([encoder, lm], 4, HW).table}
    rows = {tuple(r[0].values()): r for r in propose_layouts([encoder, lm], 4, HW, one_d=True).table}
    assert len(rows) == 9 and all(rows[k][1] == pytest.approx(v, rel=1e-12) for k, v in meshes.items())
    # the MLP's all-reduces are DTensor's, the attention's (torch's nn.MultiheadAttention) the mesh's
    assert layer_comm(encoder.layer, "1d", 4, dx=False, dw=False) == [
        (DTENSOR + "all_reduce", 4, 128 * 64, 1),
        ("all_reduce", 4, 128 * 64, 1),
    ]
    assert layer_comm(lm.layer, "1d", 4, dx=True, dw=True) == [
        (DTENSOR + "all_reduce", 4, 2 * 128 * 128, 2),
        ("all_reduce", 4, 2 * 128 * 128, 2),
    ]
    assert {k for k, *_ in layer_comm(lm.layer, "1d", 4, dtensor_attention=True)} == {DTENSOR + "all_reduce"}

    def crossing(elements):
        return elements * 3 / 4 * 4 / HW.bandwidth + HW.latency  # all but a rank's quarter, fp32

    both = layout_time(encoder, ONE_D, 4, HW) + layout_time(lm, ONE_D, 4, HW)
    # the input gathered into the encoder, the features into the LM (nothing back: the encoder is
    # frozen), the LM's output gradient out of it
    want = both + crossing(128 * 64) + crossing(128 * 64) + crossing(128 * 128)
    assert rows[ONE_D, ONE_D][1] == pytest.approx(want, rel=1e-12)
    mixed = layout_time(encoder, (2, 1), 4, HW) + layout_time(lm, ONE_D, 4, HW)
    assert rows[(2, 1), ONE_D][1] == pytest.approx(mixed + crossing(128 * 64) + crossing(128 * 128), rel=1e-12)
    assert rows[ONE_D, (2, 1)][1] == pytest.approx(
        layout_time(encoder, ONE_D, 4, HW) + layout_time(lm, (2, 1), 4, HW) + crossing(128 * 64), rel=1e-12
    )
    assert layout_memory(encoder, ONE_D, 4, HW) == encoder.params / 4 * 4  # frozen prefix: weights only
    lm_bytes = lm.params / 4 * 16 + activation_elements(lm.layer, "1d", 4) * 2 * 4
    assert layout_memory(lm, ONE_D, 4, HW) == pytest.approx(lm_bytes, rel=1e-12)
    placement = propose_placement(encoder, lm, 4, HW, one_d=True)
    together = {(c.encoder, c.rest): c.seconds for c in placement.table if not c.encoder_ranks}
    assert together == {k: r[1] for k, r in rows.items()}
    assert any("encoder 1d, rest 1d" in line for line in placement.explain().splitlines())
    heads5 = replace(lm, layer=replace(lm.layer, heads=5))  # 5 heads on 4 ranks: no 1D split offered
    assert all(c.rest != ONE_D for c in propose_placement(encoder, heads5, 4, HW, one_d=True).table)


def test_dtensors_collectives_are_priced_on_torchs_link():
    """A 1D layout's DTensor collectives travel over torch's process group (gloo on CPU), the mesh's
    over its transport (MPI): each priced on its own link (``Hardware.torch_link``); without one,
    on the mesh's. The meshes' layouts send nothing through DTensor: their price is unchanged."""
    from dataclasses import replace as with_

    from optimus2d.cost.planner import (
        DTENSOR,
        ONE_D,
        Layer,
        Part,
        comm_time,
        layer_comm,
        layout_time,
        mlp_comm,
        step_time,
    )

    slow = with_(HW, torch_link=(HW.bandwidth / 4, HW.latency * 3))
    same = with_(HW, torch_link=(HW.bandwidth, HW.latency))
    mlp = mlp_comm(512, 128, 512, "1d", 4, input_grad=True)
    assert [k for k, *_ in mlp] == [DTENSOR + "all_reduce"]
    moved = 2 * 512 * 128 * 4 * (2 * 3 / 4)  # bytes: an all-reduce of [512, 128] each way, fp32, ring
    assert comm_time(mlp, HW) == pytest.approx(moved / HW.bandwidth + 2 * HW.latency * 2, rel=1e-12)
    assert comm_time(mlp, slow) == pytest.approx(moved / (HW.bandwidth / 4) + 2 * 3 * HW.latency * 2, rel=1e-12)
    assert comm_time(mlp, same) == comm_time(mlp, HW)
    layer = Layer(4, 128, 128, 512, heads=4)
    for scheme, p in (("2d", 4), ("2.5d:2", 8), ("2d", 9)):
        assert step_time(layer, scheme, p, slow) == step_time(layer, scheme, p, HW)
    ours, theirs = (step_time(layer, "1d", 4, slow, dtensor_attention=d)["comm"] for d in (False, True))
    assert step_time(layer, "1d", 4, HW)["comm"] < ours < theirs
    mesh_part = comm_time([c for c in layer_comm(layer, "1d", 4) if not c[0].startswith(DTENSOR)], HW)
    assert ours == pytest.approx(mesh_part + comm_time(layer_comm(layer, "1d", 4)[:1], slow), rel=1e-12)
    torchs, hfs = Part("lm", layer, 2), Part("lm", layer, 2, dtensor_attention=True)  # a part's layers likewise
    assert layout_time(torchs, ONE_D, 4, slow) < layout_time(hfs, ONE_D, 4, slow)
    assert layout_time(torchs, ONE_D, 4, HW) == layout_time(hfs, ONE_D, 4, HW)  # one link: the same price
    assert layout_time(torchs, (2, 1), 4, slow) == layout_time(hfs, (2, 1), 4, slow)


def test_the_meshs_all_reduces_are_priced_at_their_own_bandwidth_where_measured():
    """``Hardware.reduce_bandwidth``: the mesh's all-reduces (a replicated module's weight gradients)
    at the rate an all-reduce was measured at; moves, and DTensor's collectives (torch's link), not."""
    from dataclasses import replace as with_

    from optimus2d.cost.planner import DTENSOR, Layer, comm_time, step_time

    slow = with_(HW, reduce_bandwidth=HW.bandwidth / 3)
    reduce, gather = [("all_reduce", 4, 1000, 1)], [("all_gather", 4, 1000, 1), ("reduce_scatter", 4, 1000, 1)]
    assert comm_time(reduce, slow) == pytest.approx(1000 * 4 * 1.5 / (HW.bandwidth / 3) + HW.latency * 2, rel=1e-12)
    assert comm_time(gather, slow) == comm_time(gather, HW)
    assert comm_time([(DTENSOR + "all_reduce", 4, 1000, 1)], slow) == comm_time(
        [(DTENSOR + "all_reduce", 4, 1000, 1)], HW
    )
    layer = Layer(4, 128, 128, 512, heads=4)  # replicated and trained (1×1×4): its gradients all-reduced
    assert step_time(layer, "2.5d:4", 4, slow)["total"] > step_time(layer, "2.5d:4", 4, HW)["total"]
    assert step_time(layer, "2.5d:4", 4, slow, dw=False) == step_time(layer, "2.5d:4", 4, HW, dw=False)  # frozen


def test_one_micro_batch_offers_together_only():
    """Apart is a pipeline of 2 stages under torch's 1F1B, which refuses fewer micro-batches than
    stages: with one, only the together rows are offered (torch raised from inside the pricing)."""
    encoder, lm = _parts()
    placement = propose_placement(encoder, lm, 4, HW, microbatches=1)
    assert placement.table and all(c.encoder_ranks == 0 for c in placement.table)
