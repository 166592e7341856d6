"""``parallelize(model, mesh, plan="auto")``: the planner's pick applied, and exact against serial.

A model of two MLPs around a norm: the planner lays each MLP out as 1D, on the model's mesh or on
another mesh shape over the same ranks; whatever it picks, the output, the input gradient and one
AdamW step equal the serial model's on every mesh of the world. A given ``Hardware`` makes the
picks deterministic (few tokens: 1D; many: a mesh shape); this machine's is measured once, the
same on every rank, and cached."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import meshes_of
from helpers import FAST_S, assert_close, check_against_serial, raises_fast
from torch import nn

import optimus2d
from optimus2d import Mesh
from optimus2d.comm import primitives
from optimus2d.comm.watch import PeerFailedError
from optimus2d.convert import Auto, choose_plan
from optimus2d.convert.auto import _plan
from optimus2d.cost import calibration
from optimus2d.cost.planner import Hardware
from optimus2d.megatron import runs_split

pytestmark = pytest.mark.mpi
HW = Hardware(flops=50e9, bandwidth=2e9, latency=50e-6, bytes_per_element=4)


class TwoMLPs(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp1 = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)
        self.mlp2 = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp2(self.norm(self.mlp1(x)))


def _layout_of(module: nn.Module, mesh: Mesh) -> str:
    """The layout ``parallelize`` gave an MLP: "1d", or its mesh's "q×q×d"."""
    if any(runs_split(m) for m in module.modules()):
        return "1d"
    used = next(m.mesh for m in module.modules() if isinstance(getattr(m, "mesh", None), Mesh))
    return f"{used.q}×{used.q}×{used.depth}"


def test_auto_applies_its_pick_and_is_exact_on_every_mesh(world):
    torch.manual_seed(1)
    x = torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64)
    for mesh in meshes_of(world):
        picked = set()
        for tokens in (16, 1 << 22):
            torch.manual_seed(0)
            serial = TwoMLPs(6 * world.size).double()  # fresh: check_against_serial steps it
            auto = Auto(tokens=tokens, hardware=HW)
            choice, _ = choose_plan(serial, mesh, auto)
            parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=auto)
            for path in ("mlp1", "mlp2"):
                assert _layout_of(getattr(parallel, path), mesh) == choice.layouts[path], (path, choice.layouts)
            check_against_serial(serial, parallel, x, mesh, tol=1e-9, optimizer=torch.optim.AdamW)
            picked |= set(choice.layouts.values())
        if world.size > 1:  # few tokens: 1D; many: a mesh shape
            assert "1d" in picked and picked - {"1d"}, picked


def test_auto_refuses_what_it_cannot_read_on_every_rank(world):
    """Each on a fresh mesh: a mesh whose ranks refused together is not to be used again."""
    model = TwoMLPs(6 * world.size)
    with pytest.raises(TypeError, match="'auto' or an Auto"):
        optimus2d.parallelize(model, Mesh(1, world.size), plan="fastest")
    with pytest.raises(ValueError, match="positive number of rows"):  # one rank's bad request: every rank's
        optimus2d.parallelize(model, Mesh(1, world.size), plan=Auto(tokens=0 if world.rank == 0 else 64))
    with pytest.raises(ValueError, match=r"seq=65\) must be a sequence length within tokens=64"):
        optimus2d.parallelize(model, Mesh(1, world.size), plan=Auto(tokens=64, seq=65, hardware=HW))
    if world.size > 1:  # ranks that ask for different plans: all refuse, before any mesh is built
        with pytest.raises(ValueError, match="plan='auto'"):
            optimus2d.parallelize(model, Mesh(1, world.size), plan=Auto(tokens=64 + world.rank, hardware=HW))


def test_a_model_that_is_one_mlp_alone_is_warned_of_and_stays_on_its_mesh(world, capsys):
    """No plan key names the model itself: its table says so (it printed an empty row, "picked"), and a
    warning says how to have the layout chosen; wrapped, the MLP is a block like any other."""
    mesh = Mesh(1, world.size)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    with pytest.warns(UserWarning, match=r"the model itself \(Sequential\) is the only MLP"):
        optimus2d.parallelize(copy.deepcopy(mlp), mesh, plan=Auto(tokens=64, hardware=HW, explain=True))
    if world.rank == 0:
        assert "(no MLP or transformer layer below the model" in capsys.readouterr().out
    choice, _ = choose_plan(nn.Sequential(mlp), mesh, Auto(tokens=64, hardware=HW))
    assert set(choice.layouts) == {"0"}


def test_the_calibration_is_the_same_on_every_rank_and_cached(world, tmp_path, monkeypatch):
    mesh = meshes_of(world)[0]
    monkeypatch.setenv("OPTIMUS2D_CACHE", str(tmp_path))  # rank 0's is the one read and written
    measured = calibration.hardware(mesh, refresh=True)
    assert measured.flops > 0 and measured.bandwidth > 0 and measured.latency >= 0
    torch_bandwidth, torch_latency = measured.torch_link  # torch's own group (DTensor's), measured too
    assert torch_bandwidth > 0 and torch_latency >= 0
    if mesh.transport == "torch" or mesh.size == 1:  # the mesh's collectives are torch's: one link
        assert measured.torch_link == (measured.bandwidth, measured.latency)
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measured)
        assert all(h == measured for h in everyone)
    if mesh.ranks.index(mesh.rank) == 0:
        assert (tmp_path / "hardware.json").is_file()
    monkeypatch.setattr(calibration, "_measure", lambda mesh: pytest.fail("measured again"))
    assert calibration.hardware(mesh) == measured  # from rank 0's cache, on every rank


def test_auto_times_the_best_predicted_on_request_and_picks_the_fastest_measured(world, capsys):
    """``Auto(measure=step, top=3)``: the 3 best predicted and the model's own mesh converted on copies
    and timed; every rank gets the same times (the slowest rank's) and so the same pick; the model
    itself untouched; the plan exact."""
    mesh = meshes_of(world)[0]
    torch.manual_seed(1)
    x = torch.randn(2 * world.size, 3, 6 * world.size, dtype=torch.float64)
    torch.manual_seed(0)
    serial = TwoMLPs(6 * world.size).double()
    before = copy.deepcopy(serial.state_dict())
    runs = []

    def step(model):
        runs.append(model)
        model(optimus2d.scatter(x, mesh)).pow(2).sum().backward()

    auto = Auto(tokens=64, hardware=HW, measure=step, top=3, explain=True)
    choice, plan = choose_plan(serial, mesh, auto)
    best = list(range(min(3, sum(fits for *_, fits in choice.table))))
    here = f"{mesh.q}×{mesh.q}×{mesh.depth}"
    own = next(r for r, row in enumerate(choice.table) if set(row[0].values()) == {here})  # no plan at all
    assert sorted(choice.measured) == sorted({*best, own}) and all(t > 0 for t in choice.measured.values())
    assert len(runs) == 4 * len(choice.measured) and all(r is not serial for r in runs)  # a warm-up, 3 timed; copies
    assert choice.layouts == choice.table[min(choice.measured, key=choice.measured.get)][0]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (choice.layouts, choice.measured))
        assert all(e == everyone[0] for e in everyone)
    assert all(p.grad is None for p in serial.parameters())
    assert all(torch.equal(v, before[k]) for k, v in serial.state_dict().items())
    printed = capsys.readouterr().out
    assert ("measured ms" in printed and "<- picked" in printed) == (mesh.rank == mesh.ranks[0])
    parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=plan)
    for path in ("mlp1", "mlp2"):
        assert _layout_of(getattr(parallel, path), mesh) == choice.layouts[path]
    check_against_serial(serial, parallel, x, mesh, tol=1e-9, optimizer=torch.optim.AdamW)


def test_a_measure_that_cannot_run_is_refused_on_every_rank(world):
    """Each on a fresh mesh (a mesh whose ranks refused together is not used again)."""
    model = TwoMLPs(6 * world.size)
    with pytest.raises(TypeError, match=r"measure=\) takes step"):
        optimus2d.parallelize(model, Mesh(1, world.size), plan=Auto(hardware=HW, measure=5))
    with pytest.raises(ValueError, match="top=0"):
        optimus2d.parallelize(model, Mesh(1, world.size), plan=Auto(hardware=HW, measure=print, top=0))
    with torch.device("meta"):
        on_meta = TwoMLPs(6 * world.size)
    with pytest.raises(ValueError, match=r"on meta: \['mlp1\.0\.weight'"):
        optimus2d.parallelize(on_meta, Mesh(1, world.size), plan=Auto(hardware=HW, measure=print))


def test_a_measure_that_raises_on_one_rank_stops_every_rank_at_once(world):
    """The last rank's step raises before its first collective; its peers, waiting for it in one of
    the mesh's collectives, raise ``PeerFailedError`` naming it, well before the collective timeout
    (this test's own mesh: a failure is fatal to it)."""
    if world.size == 1:
        pytest.skip("one rank")
    mesh = Mesh(1, world.size)
    last = mesh.rank == mesh.ranks[-1]
    torch.manual_seed(0)
    model = TwoMLPs(6 * world.size)

    def step(trial):
        if last:
            raise ValueError("the batch is empty")
        primitives.all_reduce(torch.ones(1), mesh, "mesh")  # the last rank never joins
        trial(torch.zeros(1, 6 * world.size)).sum().backward()

    auto = Auto(tokens=64, hardware=HW, measure=step, top=1)
    if last:
        message = raises_fast(ValueError, "the batch is empty", lambda: choose_plan(model, mesh, auto))
    else:
        message = raises_fast(
            PeerFailedError,
            rf"rank {mesh.ranks[-1]}: ValueError: the batch is empty",
            lambda: choose_plan(model, mesh, auto),
        )
    assert mesh.timeout > 2 * FAST_S  # so that the error came from the report, not from a wait running out
    assert "the batch is empty" in message
    dist.barrier()


class Layers(nn.Module):
    """Two torch transformer layers (the first frozen) and an MLP head: the blocks ``plan="auto"`` lays out."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        make = lambda: nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)  # noqa: E731
        self.first, self.second = make(), make()
        self.first.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


def test_auto_lays_out_torch_transformer_layers_and_is_exact_on_every_mesh(world):
    torch.manual_seed(1)
    x = torch.randn(2 * world.size, 4, 6 * world.size, dtype=torch.float64)
    picked = set()
    for mesh in meshes_of(world):  # on 1×1×4, 3 heads: never offered the 2×2 grid (refused there)
        for tokens, memory in ((8, None), (1 << 22, None), (8, 1.0)):  # a cap none fits: the leanest
            torch.manual_seed(0)
            serial = Layers(6 * world.size, heads=3 * mesh.q).double()
            auto = Auto(tokens=tokens, seq=4, memory=memory, hardware=HW)
            choice, _ = choose_plan(serial, mesh, auto)
            picked |= {choice.layouts["first"], choice.layouts["second"]}
            assert set(choice.layouts) == {"first", "second", "head"}
            if (3 * mesh.q) % world.size:  # 1D (torch's layers split by heads) only where the ranks divide them
                assert all(layout != "1d" for path, layout in choice.layouts.items() if path != "head")
            parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=auto)
            for path in ("first", "second", "head"):
                assert _layout_of(getattr(parallel, path), mesh) == choice.layouts[path], (path, choice.layouts)
            check_against_serial(serial, parallel, x, mesh, tol=1e-9)  # SGD: AdamW steps a key bias by its rounding
    if world.size == 4:  # the layers on the batch-split mesh and on the 2×2 grid, each exact
        assert {"1×1×4", "2×2×1"} <= picked, picked


class Parts(nn.Module):
    """A frozen ``nn.TransformerEncoder`` and a trained stack of two MLPs: two parts ``plan="auto"`` lays
    out whole (in 1D too, and each of their blocks in 1D)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).requires_grad_(False)
        mlp = lambda: nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))  # noqa: E731
        self.mlps = nn.Sequential(mlp(), nn.LayerNorm(width), mlp())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlps(self.encoder(x))


def test_every_layout_of_the_parts_the_planner_offers_is_exact(world):
    """Each row of the table (a part whole on each mesh shape; the MLPs each in 1D) applied by the plan
    ``choose_plan`` would return for it, and ``plan=Auto`` itself: exact against serial on every mesh."""
    torch.manual_seed(1)
    x = torch.randn(2 * world.size, 4, 6 * world.size, dtype=torch.float64)
    for n, mesh in enumerate(meshes_of(world)):
        torch.manual_seed(0)
        serial = Parts(6 * world.size, heads=world.size if world.size > 1 else 6).double()
        auto = Auto(tokens=x.shape[0] * x.shape[1], seq=4, hardware=HW)
        choice, _ = choose_plan(serial, mesh, auto)
        assert set(choice.layouts) in ({"encoder", "mlps"}, {"encoder", "mlps.0", "mlps.2"})
        built = {f"{mesh.q}×{mesh.q}×{mesh.depth}": mesh}
        rows = [row[0] for row in choice.table]
        shapes = sum(world.size % (q * q) == 0 for q in range(1, world.size + 1))  # mesh shapes: each fits
        split = world.size > 1  # in 1D: a part whole, or each of its blocks (torch's layers split by heads)
        assert len(rows) == (shapes + 2 * split) ** 2
        if world.size >= 8:  # 8, 9 ranks (time; by hand, not in CI): on the grid only, each part's every layout once
            rows = _covering(rows) if n == 0 else []
        for layouts in rows:
            parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=_plan(layouts, mesh, built))
            for path, layout in layouts.items():
                assert _layout_of(parallel.get_submodule(path), mesh) == layout, (path, layouts)
            check_against_serial(copy.deepcopy(serial), parallel, x, mesh, tol=1e-9)  # SGD, as the layers' test
        parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=auto)
        check_against_serial(serial, parallel, x, mesh, tol=1e-9)


def _covering(rows: list[dict]) -> list[dict]:
    """The rows that bring a layout of a part (its paths' layouts) no row before them did."""
    seen, out = set(), []
    for layouts in rows:
        mine = {(part, tuple((k, v) for k, v in layouts.items() if k.split(".")[0] == part))
                for part in {k.split(".")[0] for k in layouts}}  # fmt: skip
        if mine - seen:
            seen |= mine
            out.append(layouts)
    return out


@pytest.mark.families
def _llama_config(transformers, p: int, **kwargs):
    """A LLaMA of one head a rank, its widths divided by the world's p ranks."""
    return transformers.LlamaConfig(
        vocab_size=72, hidden_size=4 * p, intermediate_size=8 * p, num_hidden_layers=2, num_attention_heads=p,
        num_key_value_heads=p, attn_implementation="eager", **kwargs,
    )  # fmt: skip


def test_a_llama_decoder_stack_is_a_region_run_whole_in_1d_or_left_on_the_mesh_exactly(world):
    """LLaMA's ``model`` (embedding, decoder layers, norm) is one region: the planner offers it whole in
    1D (its attention and MLPs split, the rest replicated) or on the mesh with each MLP laid out alone.
    The rows "model in 1D" and "every MLP in 1D", and ``plan=Auto``: loss, logits, gradient norm and
    one AdamW step as serial on every mesh."""
    transformers = pytest.importorskip("transformers")
    if world.size == 1:
        pytest.skip("1D needs two ranks or more")
    p = world.size
    config = _llama_config(transformers, p)
    torch.manual_seed(1)
    ids = torch.randint(0, 72, (2 * p, 6))
    for mesh in meshes_of(world):
        torch.manual_seed(0)
        serial = transformers.LlamaForCausalLM(config)  # fp32: its eager softmax rounds to fp32 anyway
        auto = Auto(tokens=ids.numel(), seq=ids.shape[1], hardware=HW)
        choice, _ = choose_plan(serial, mesh, auto)
        mlps = [f"model.layers.{n}.mlp" for n in range(2)]
        here = f"{mesh.q}×{mesh.q}×{mesh.depth}"
        rows = [row[0] for row in choice.table]
        assert {"model": "1d"} in rows and {"model": here, **dict.fromkeys(mlps, "1d")} in rows
        built = {here: mesh}
        for plan in (_plan({"model": "1d"}, mesh, built), _plan(dict.fromkeys(mlps, "1d"), mesh, built), auto):
            model = copy.deepcopy(serial)
            parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=plan)
            ref = model(input_ids=ids, labels=ids)
            ref.loss.backward()
            out = parallel(input_ids=optimus2d.scatter_batch(ids, mesh), labels=optimus2d.scatter_batch(ids, mesh))
            out.loss.backward()
            assert_close(optimus2d.gather(out.logits.detach(), mesh)[..., :72], ref.logits, 1e-5, "logits")
            assert_close(out.loss, ref.loss, 1e-5, "loss")
            norm_ref = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
            norm = optimus2d.clip_grad_norm_(list(parallel.parameters()), 1e9, mesh)
            assert_close(norm, norm_ref, 1e-5, "gradient norm")  # each shard once, each replicated tensor once
            eps = 1e-3 * max(p.grad.abs().max().item() for p in model.parameters())
            for m in (model, parallel):
                torch.optim.AdamW(m.parameters(), lr=1e-2, eps=eps).step()
            state = optimus2d.serial_state_dict(parallel)
            for key, value in model.state_dict().items():
                assert_close(state[key], value, 1e-5, key)


def test_a_tied_llama_is_not_offered_in_1d_whole_and_its_pick_is_exact(world):
    """A LLaMA whose head is its embedding (``tie_word_embeddings``): ``model`` in 1D would leave
    ``lm_head`` on the mesh with the table (``parallelize`` refuses it), so it is not offered; its MLPs
    are, and ``plan=Auto`` is exact (it picked ``{"model": "1d"}`` and was refused)."""
    transformers = pytest.importorskip("transformers")
    if world.size == 1:
        pytest.skip("1D needs two ranks or more")
    p = world.size
    config = _llama_config(transformers, p, tie_word_embeddings=True)
    torch.manual_seed(1)
    ids = torch.randint(0, 72, (2 * p, 6))
    for mesh in meshes_of(world):
        torch.manual_seed(0)
        serial = transformers.LlamaForCausalLM(config)
        auto = Auto(tokens=ids.numel(), seq=ids.shape[1], hardware=HW)
        choice, _ = choose_plan(serial, mesh, auto)
        assert all("model" not in row[0] for row in choice.table)
        assert any(layouts.get("model.layers.0.mlp") == "1d" for layouts, *_ in choice.table)
        model, parallel = copy.deepcopy(serial), optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=auto)
        ref = model(input_ids=ids, labels=ids)
        ref.loss.backward()
        out = parallel(input_ids=optimus2d.scatter_batch(ids, mesh), labels=optimus2d.scatter_batch(ids, mesh))
        out.loss.backward()
        assert_close(out.loss, ref.loss, 1e-5, "loss")
        for m in (model, parallel):
            torch.optim.SGD(m.parameters(), lr=0.5).step()
        state = optimus2d.serial_state_dict(parallel)
        for key, value in model.state_dict().items():
            assert_close(state[key], value, 1e-5, key)


class Pool(nn.Module):
    """The mean of each 4 consecutive tokens (over the sequence: correct on blocks as it is)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (-1, 4)).mean(dim=2)


optimus2d.convert.register_converter(Pool, keep=True)


class PooledMLPs(TwoMLPs):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.pool = Pool()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp2(self.norm(self.pool(self.mlp1(x))))


def test_an_example_prices_what_follows_a_pool_at_its_rows_and_the_pick_is_exact(world):
    """``Auto(example=)``: mlp2 after a pool priced at a quarter of mlp1's rows (the same choice as the
    planner's over blocks traced from the example, not over ``tokens``), applied and exact on every mesh."""
    from optimus2d.convert.auto import _blocks
    from optimus2d.cost.auto import choose

    for mesh in meshes_of(world):
        torch.manual_seed(0)
        serial = PooledMLPs(6 * world.size).double()
        x = torch.randn(4 * world.size, 16, 6 * world.size, dtype=torch.double)
        auto = Auto(tokens=x.shape[0] * 16, seq=16, hardware=HW, example=x)
        choice, _ = choose_plan(serial, mesh, auto)
        here = f"{mesh.q}×{mesh.q}×{mesh.depth}"
        traced = _blocks(serial, auto.tokens, mesh.size, 16, mesh.q, example=x)
        assert [b.rows for b in traced] == [x.shape[0] * 16, x.shape[0] * 4]
        assert choice.seconds == choose(traced, mesh.size, HW, layout=here).seconds
        plain = choose(_blocks(serial, auto.tokens, mesh.size, 16, mesh.q), mesh.size, HW, layout=here)
        assert choice.seconds < plain.seconds  # mlp2's quarter of the rows: less work than tokens= says
        parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=auto)
        check_against_serial(serial, parallel, x, mesh, tol=1e-9, optimizer=torch.optim.AdamW)


def test_an_example_the_ranks_disagree_on_or_meta_cannot_run_is_refused_on_every_rank(world):
    model = PooledMLPs(6 * world.size)
    x = torch.randn(world.size, 8, 6 * world.size)
    if world.size > 1:  # another shape on one rank: every rank refuses, before any mesh is built
        mine = x if world.rank else x[:, :4]
        with pytest.raises(ValueError, match="plan='auto'"):
            optimus2d.parallelize(model, Mesh(1, world.size), plan=Auto(hardware=HW, example=mine))

    class Selecting(PooledMLPs):  # reads a value: traced for real, its rows as the values say
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp2(self.mlp1(x)[: 1 + int(x[0, 0, 0].item() > 0)])

    if world.size > 1:  # the same shapes, other values on one rank: other rows priced, refused on every rank
        mine = x.clone()
        mine[0, 0, 0] = 1.0 if world.rank == 0 else -1.0
        with pytest.raises(ValueError, match=r"plan='auto'"):
            optimus2d.parallelize(Selecting(6 * world.size), Mesh(1, world.size), plan=Auto(hardware=HW, example=mine))
    with pytest.raises(TypeError, match=r"Auto\(example=\) is one step's inputs"):  # agreed: every rank
        optimus2d.parallelize(model, Mesh(1, world.size), plan=Auto(hardware=HW, example=5))

    class Counting(PooledMLPs):  # reads a value: not on meta; built on meta, not for real either
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp2(self.mlp1(x)[: int(x.abs().sum().item())])

    with torch.device("meta"):
        unreal = Counting(6 * world.size)
    with pytest.raises(ValueError, match=r"Auto\(example=\) runs the model once .* on the meta device RuntimeError"):
        optimus2d.parallelize(unreal, Mesh(1, world.size), plan=Auto(hardware=HW, example=x))
