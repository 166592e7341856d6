"""The cost model's element counts equal what count_comm measures, on every mesh."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optimus2d import count_comm, scatter
from optimus2d.cost import linear_2d_algorithm
from optimus2d.cost.memory import saved_activation_bytes
from optimus2d.cost.planner import (
    Hardware,
    Layer,
    activation_elements,
    efficiency,
    isoefficiency_hidden,
    layer_comm,
    step_time,
    transformer_layer_elements,
)
from optimus2d.layers import TransformerBlock2D


@pytest.mark.mpi
def test_transformer_layer_elements_match_the_counter(mesh):
    h, heads, s = 12, 6, 5
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(h, heads, 4 * h, dropout=0.0, batch_first=True, norm_first=True)
    block = TransformerBlock2D.from_serial(serial, mesh)
    x = scatter(torch.randn(b, s, h), mesh).requires_grad_()
    with count_comm() as counter:
        block(x, is_causal=True).square().sum().backward()
    layer = Layer(b, s, h, 4 * h)
    assert counter.numel == transformer_layer_elements(layer, mesh.q, mesh.depth, on_diagonal=mesh.i == mesh.j)


@pytest.mark.mpi
def test_activation_elements_are_what_the_block_and_torch_save(mesh):
    h, heads, s = 24, 6, 5
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(
        h, heads, 4 * h, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    block = TransformerBlock2D.from_serial(serial, mesh)
    x = torch.randn(b, s, h, requires_grad=True)
    layer = Layer(b, s, h, 4 * h, heads)
    scheme = "2d" if mesh.depth == 1 else f"2.5d:{mesh.depth}"
    ours = saved_activation_bytes(block, scatter(x, mesh).detach().clone().requires_grad_())
    # off the diagonal a weight-stationary out-projection keeps the block it received from rank
    # (k, j, i) besides its own input, which SDPA keeps as its output anyway: h/q more a row
    stationary = linear_2d_algorithm(b * s, h, h, mesh.q, mesh.depth) == "stationary"
    extra = b * s // (mesh.depth * mesh.q) * h // mesh.q if stationary and mesh.i != mesh.j else 0
    assert ours == 4 * (round(activation_elements(layer, scheme, mesh.size)) + extra)
    assert saved_activation_bytes(serial, x) == 4 * round(activation_elements(layer, "1d", 1))


def test_projection_orders_layouts_as_the_formulas_say():
    hw = Hardware(flops=300e12, bandwidth=50e9, latency=5e-6)
    layer = Layer(batch=64, seq=2048, hidden=8192, ffn=4 * 8192)
    # 1D's per-rank volume does not shrink with p; 2D's shrinks as 1/q
    one_d = [sum(e for _, _, e, _ in layer_comm(layer, "1d", p)) for p in (16, 64, 256)]
    two_d = [sum(e for _, _, e, _ in layer_comm(layer, "2d", p)) for p in (16, 64, 256)]
    assert one_d[0] == one_d[1] == one_d[2]
    assert two_d[0] > two_d[1] > two_d[2]
    assert step_time(layer, "2d", 256, hw)["total"] < step_time(layer, "1d", 256, hw)["total"]
    assert 0 < efficiency(layer, "2.5d:4", 256, hw) <= 1
    # 2D needs a slower-growing problem than 1D to hold its efficiency
    h_1d = isoefficiency_hidden("1d", 256, hw, 0.5, 2048, 256)
    h_2d = isoefficiency_hidden("2d", 256, hw, 0.5, 2048, 256)
    assert h_2d is not None and (h_1d is None or h_2d < h_1d)
    with pytest.raises(ValueError, match="2D needs p = q²"):
        layer_comm(layer, "2d", 8)


@pytest.mark.parametrize("q,depth", [(2, 1), (3, 1), (2, 2)])
@pytest.mark.parametrize("batch", [1, 64], ids=["stationary", "summa"])
def test_time_model_prices_the_elements_the_cost_formulas_count(q, depth, batch):
    """plan.mlp_comm (what the time model prices) moves exactly mlp_2d_elements (what count_comm checks)."""
    from optimus2d.cost import linear_2d_algorithm, mlp_2d_elements
    from optimus2d.cost.planner import mlp_comm

    rows, h, f = batch * 36, 72, 288
    scheme = "2d" if depth == 1 else f"2.5d:{depth}"
    priced = sum(e for _, _, e, _ in mlp_comm(rows, h, f, scheme, depth * q * q))
    assert priced == mlp_2d_elements(rows, h, f, q, depth, input_grad=False)
    expected = "stationary" if batch == 1 else "summa"
    assert linear_2d_algorithm(rows, h, f, q, depth) == expected


def test_calibrated_model_predicts_from_measured_rates():
    """compute + comm with the calibrated Hardware; more latency or less bandwidth never speeds it up."""
    from optimus2d.cost.planner import comm_time, mlp_comm, mlp_flops

    hw = Hardware(flops=30e9, bandwidth=1e9, latency=1e-3, bytes_per_element=4)
    comm = mlp_comm(1024, 1024, 4096, "2d", 4)
    base = comm_time(comm, hw)
    assert comm_time(comm, Hardware(30e9, 0.5e9, 1e-3, 4)) > base
    assert comm_time(comm, Hardware(30e9, 1e9, 2e-3, 4)) > base
    assert mlp_flops(1024, 1024, 4096) == 2.0 * 1024 * 1024 * 4096 * 5


def test_a_sync_stage_costs_more_after_more_work_where_ranks_share_cores():
    """``latency_work``: the latency was measured after that much work; a stage after w seconds
    costs latency·√(w / latency_work). Without it (devices of their own) a stage costs latency."""
    from optimus2d.cost.planner import comm_time, mlp_comm

    fixed = Hardware(flops=30e9, bandwidth=1e9, latency=1e-3, bytes_per_element=4)
    shared = Hardware(flops=30e9, bandwidth=1e9, latency=1e-3, bytes_per_element=4, latency_work=0.01)
    assert shared.stage_latency(0.01) == fixed.stage_latency(0.04) == 1e-3
    assert abs(shared.stage_latency(0.04) - 2e-3) < 1e-15 and shared.stage_latency(0.0) == 1e-3
    comm = mlp_comm(1024, 1024, 4096, "2d", 4)
    stages = sum(m for *_, m in comm)
    latency_terms = sum(m * math.log2(max(n, 2)) for _, n, _, m in comm) * 1e-3
    assert comm_time(comm, shared, compute=0.01 * stages) == pytest.approx(comm_time(comm, fixed, compute=1.0))
    longer = comm_time(comm, shared, compute=0.04 * stages) - comm_time(comm, fixed)
    assert abs(longer - latency_terms) < 1e-9  # each stage twice the latency


@pytest.mark.mpi
@pytest.mark.parametrize("dx,dw", [(True, True), (True, False), (False, False)], ids=["trained", "frozen", "prefix"])
def test_frozen_layer_comm_matches_the_counter(mesh, dx, dw):
    """``layer_comm(dx=, dw=)`` (what ``propose_layouts`` prices for frozen modules) moves what a
    frozen block sends, with and without an input that needs a gradient, off the diagonal."""
    h, heads, s = 12, 6, 5
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(h, heads, 4 * h, dropout=0.0, batch_first=True, norm_first=True)
    serial.requires_grad_(dw)
    block = TransformerBlock2D.from_serial(serial, mesh)
    x = scatter(torch.randn(b, s, h), mesh).detach().requires_grad_(dx)
    with count_comm() as counter:
        y = block(x, is_causal=True)
        if dx or dw:
            y.square().sum().backward()
    if mesh.size == 1 or mesh.i == mesh.j:
        return
    scheme = "2d" if mesh.depth == 1 else f"2.5d:{mesh.depth}"
    priced = sum(e for _, _, e, _ in layer_comm(Layer(b, s, h, 4 * h), scheme, mesh.size, dx=dx, dw=dw))
    assert counter.numel == priced, counter.summary()


@pytest.mark.mpi
@pytest.mark.parametrize(
    "frozen,input_grad", [(False, False), (False, True), (True, True), (True, False)], ids=["trained", "trained-dx",
                                                                                          "frozen-dx", "frozen"]
)  # fmt: skip
def test_plan_auto_prices_an_mlp_as_it_sends_and_keeps(mesh, frozen, input_grad):
    """What ``plan="auto"`` prices for an MLP block (``cost.auto.predict``) against what it does,
    converted by ``parallelize``: the elements it sends (off the diagonal; a frozen block sends no
    weight gradients, nor their all-reduces: it priced a trained block's backward, 2.4× what a
    frozen forward sends) and, on a 2D mesh, the bytes backward keeps (its linears apart: fc1's
    input, the activation's input and output; frozen, the activation's input alone: it priced
    h + f for the first and the whole for the second), in the model's dtype."""
    from optimus2d import parallelize
    from optimus2d.cost.auto import Block, predict
    from optimus2d.cost.planner import mlp_comm

    h, f, b, s = 8 * mesh.q, 32 * mesh.q, 2 * mesh.depth * mesh.q, 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))).double()
    model.requires_grad_(not frozen)
    par = parallelize(model, mesh)
    x = scatter(torch.randn(b, s, h, dtype=torch.float64), mesh).detach().requires_grad_(input_grad)
    backward = input_grad or not frozen
    kept = saved_activation_bytes(par[0], x) if backward else 0
    with count_comm() as counter:
        y = par[0](x)
        if backward:
            y.square().sum().backward()
    layout, p = f"{mesh.q}×{mesh.q}×{mesh.depth}", mesh.size
    hw = Hardware(flops=1e9, bandwidth=1e9, latency=1e-5, bytes_per_element=8)  # float64
    _, memory = predict(Block("0", "mlp", b * s, h, f, frozen=frozen, input_grad=input_grad), layout, p, hw)
    weights = 2 * h * f / (mesh.q * mesh.q) * 8 * (1 if frozen else 4)
    if mesh.depth == 1:
        assert memory - weights == kept
    if p > 1 and mesh.i != mesh.j:
        scheme = "2d" if mesh.depth == 1 else f"2.5d:{mesh.depth}"
        priced = mlp_comm(b * s, h, f, scheme, p, input_grad=input_grad, dw=not frozen)
        assert counter.numel == sum(e for _, _, e, _ in priced), counter.summary()
