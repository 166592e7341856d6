"""Stages on rank sets of different sizes (``optimus2d.pipeline.rank_sets``): Hugging Face LLaVA with
its vision tower on its own ranks and the language model on the rest, under torch's schedules. The
loss of ``labels=``, every gradient and one AdamW step equal the serial model's, frozen tower and
trained; the features cross the sets as exactly each rank's block, and a frozen tower gets nothing
back; the same with the LLM's MLPs in 1D (``Megatron`` over the LLM's own ranks). Refusals (sets
that overlap, leave a rank out, do not fit their meshes, or differ between ranks) are the same
``ValueError`` on every rank.

Sets by world: 4 ranks: tower on 1, LLM on 3 (1×1×3); 8: 4 + 4 (1×1×4 → 2×2, and 2×2 → 1×1×4) and
2 + 6 (1×1×2 → 1×1×6); 9: 1 + 8 (1×1 → 2×2×2)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close
from test_pipeline_llava_mpi import ROWS, SEQ, TEXT, _batch, _grads, _llava
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import optimus2d
from optimus2d.megatron import Megatron, runs_split
from optimus2d.pipeline import gather_microbatches, pipeline_stage, rank_sets, scatter_microbatches
from optimus2d.pipeline.models.llama import causal_lm_loss, causal_lm_targets
from optimus2d.pipeline.models.llava import llava_stages

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

# world → [(tower ranks, (q, depth) of the tower's mesh, (q, depth) of the LLM's)]
SETS = {
    4: [(1, (1, 1), (1, 3))],
    8: [(4, (1, 4), (2, 1)), (2, (1, 2), (1, 6)), (4, (2, 1), (1, 4))],
    9: [(1, (1, 1), (2, 2))],
}
N = 2  # micro-batches
_pipes: dict = {}


def _pipe(world, tower: int, shapes):
    key = (world.size, tower, shapes)
    if key not in _pipes:  # collective: built once per layout, in the same order on every rank
        ranks = [range(tower), range(tower, world.size)]
        _pipes[key] = rank_sets(ranks, q=[s[0] for s in shapes], depth=[s[1] for s in shapes])
    return _pipes[key]


def _cases(world):
    if world.size not in SETS:
        pytest.skip(f"runs on {' or '.join(map(str, SETS))} ranks")
    return SETS[world.size]


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
def test_llava_with_its_tower_on_its_own_ranks_matches_serial(world, frozen):
    for tower, tower_shape, llm_shape in _cases(world):
        _check_llava(world, tower, (tower_shape, llm_shape), frozen)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
def test_the_llms_mlps_in_1d_inside_its_rank_set_match_serial(world, frozen):
    """1D inside a rank set: the LLM's MLPs split Megatron's way over the LLM's ranks (its mesh's own
    group), the rest of it on its mesh; the tower's stage as before."""
    for tower, tower_shape, llm_shape in _cases(world)[:1]:
        _check_llava(world, tower, (tower_shape, llm_shape), frozen, llm_1d=True)


def _check_llava(world, tower: int, shapes, frozen: bool, llm_1d: bool = False) -> None:
    pipe = _pipe(world, tower, shapes)
    blocks = [q * d for q, d in shapes]
    b = N * blocks[0] * blocks[1] // _gcd(*blocks)
    serial = _llava()
    serial.model.vision_tower.requires_grad_(not frozen)
    encoders, texts = llava_stages(serial, [3], 1)
    part = encoders[0] if pipe.stage == 0 else texts[0]
    plan = None
    if llm_1d and pipe.stage == 1:
        plan = {path: Megatron(pipe.mesh) for path, m in part.named_modules() if type(m).__name__ == "LlamaMLP"}
        assert len(plan) == TEXT["num_hidden_layers"], sorted(plan)
    chunk = optimus2d.parallelize(part, pipe.mesh, plan=plan)
    if plan:
        assert all(any(runs_split(m) for m in chunk.get_submodule(path).modules()) for path in plan)
    mb = b // N
    if pipe.stage == 0:
        shapes_here = dict(microbatch_shape=(mb, 3, 16, 16), input_layout="batch", output_shape=(mb, ROWS, 48))
    else:
        shapes_here = dict(microbatch_shape=(mb, ROWS, 48), output_shape=(mb, SEQ, TEXT["vocab_size"]))
    stage = pipeline_stage(
        chunk, pipe, dtype=torch.float32, input_grad=pipe.stage == 1 and not frozen,
        output_grad=pipe.stage == 1 or not frozen, **shapes_here,
    )  # fmt: skip

    ids, pixels, labels = _batch(b)
    target, count = causal_lm_targets(labels, pipe.mesh, microbatches=N)
    schedule = Schedule1F1B(stage, n_microbatches=N, loss_fn=causal_lm_loss(pipe.mesh, count), scale_grads=False)
    losses: list = []
    with optimus2d.count_comm() as sent:
        if pipe.stage == 0:
            schedule.step(scatter_microbatches(pixels, pipe.mesh, N, layout="batch"))
        else:
            ids_block = scatter_microbatches(ids, pipe.mesh, N, layout="batch")
            schedule.step(input_ids=ids_block, target=target, losses=losses)
    # the bridge carries each rank's block, once per micro-batch: the tower's features forward, and
    # their gradient back only when the tower trains (on torch 2.11 too: LaneStage)
    features = mb * ROWS * 48 // (blocks[pipe.stage] * shapes[pipe.stage][0])
    want = N * features if pipe.stage == 0 or not frozen else 0
    assert sum(r.numel for r in sent.records if r.axis == "bridge") == want

    grads = _grads(chunk, pipe.mesh)
    loss_ref = serial(input_ids=ids, pixel_values=pixels, labels=labels).loss
    loss_ref.backward()
    ref_grads = {k: q.grad for k, q in serial.named_parameters()}
    if pipe.stage == 1:
        assert_close(torch.stack(losses).sum(), loss_ref.detach(), 1e-5, "loss")
    largest = max(g.abs().max().item() for g in ref_grads.values() if g is not None)
    for key, g in grads.items():
        want = ref_grads[key]
        if want is None:  # the frozen tower: no gradient at all
            assert g is None, key
        elif want.abs().max() < 1e-6 * largest:  # zero but for rounding (attention's key bias)
            assert (g - want).abs().max() < 1e-6 * largest, key
        else:
            assert_close(g, want, 1e-5, f"stage {pipe.stage} grad {key}")
    eps = 1e-3 * largest
    for model in (serial, chunk):
        if trained := [q for q in model.parameters() if q.requires_grad]:
            torch.optim.AdamW(trained, lr=1e-2, eps=eps).step()
    ref_state = serial.state_dict()
    for key, value in optimus2d.serial_state_dict(chunk).items():
        assert_close(value, ref_state[key], 1e-5, f"stage {pipe.stage} AdamW {key}")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _gpipe_matches_serial(pipe, serial: torch.nn.ModuleList, n: int, shapes: list[tuple]) -> None:
    """Stage s of the chain ``serial`` on ``pipe`` under ScheduleGPipe, ``n`` micro-batches: the loss
    Σ out·w and every gradient of this rank's stage equal serial's. ``shapes``: each stage's
    (microbatch_shape, output_shape), global."""
    chunk = optimus2d.parallelize(copy.deepcopy(serial[pipe.stage]), pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=shapes[pipe.stage][0], output_shape=shapes[pipe.stage][1])
    first, last = shapes[0][0], shapes[-1][1]
    x, weight = torch.randn(n * first[0], *first[1:]), torch.randn(n * last[0], *last[1:])
    loss_fn = lambda out, w: optimus2d.pipeline.mesh_sum(out * w, pipe.mesh)  # noqa: E731
    schedule = ScheduleGPipe(stage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
    losses: list = []
    if pipe.stage == 0:
        schedule.step(scatter_microbatches(x, pipe.mesh, n))
    elif pipe.stage == pipe.stages - 1:
        schedule.step(target=scatter_microbatches(weight, pipe.mesh, n), losses=losses)
    else:
        schedule.step()
    out = x
    for module in serial:
        out = module(out)
    ref = (out * weight).sum()
    ref.backward()
    if pipe.stage == pipe.stages - 1:
        assert_close(torch.stack(losses).sum(), ref.detach(), 1e-5, "loss")
    grads = _grads(chunk, pipe.mesh)
    for key, q in serial[pipe.stage].named_parameters():
        assert_close(grads[key], q.grad, 1e-5, key)


def test_gpipe_on_rank_sets_matches_serial(world):
    """Under ScheduleGPipe: every forward first, so the tower's ranks run ahead."""
    tower, tower_shape, llm_shape = _cases(world)[0]
    pipe = _pipe(world, tower, (tower_shape, llm_shape))
    torch.manual_seed(3)
    h, mb = 12, 2 * tower_shape[1] * llm_shape[1] * tower_shape[0] * llm_shape[0]
    serial = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU()),
                                  torch.nn.Linear(2 * h, h)])  # fmt: skip
    _gpipe_matches_serial(pipe, serial, N, [((mb, 3, h), (mb, 3, 2 * h)), ((mb, 3, 2 * h), (mb, 3, h))])


@pytest.mark.parametrize("fed", ["input", "target"])
def test_blocks_not_in_serial_micro_batch_order_are_refused_on_every_rank(world, fed):
    """Sets of different shapes re-split each micro-batch as the serial ``x.chunk(n)[m]`` at their
    boundary: an input or target block made by ``scatter``/``scatter_batch`` (micro-batch m the m-th
    slice of every batch block: other samples; loss 2.6e-3 off, gradients 0.77) is refused before the
    step sends anything, on every rank; so is ``causal_lm_targets`` without ``microbatches=``."""
    tower, tower_shape, llm_shape = _cases(world)[0]
    q, depth = tower_shape if fed == "input" else llm_shape
    if depth * q == 1:
        pytest.skip("a set of one batch block holds each micro-batch in order whatever made it")
    pipe = _pipe(world, tower, (tower_shape, llm_shape))
    h, mb = 8, 2 * tower_shape[1] * llm_shape[1] * tower_shape[0] * llm_shape[0]
    torch.manual_seed(0)
    chunk = optimus2d.parallelize(torch.nn.Linear(h, h), pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=(mb, 3, h))
    loss_fn = lambda out, w: optimus2d.pipeline.mesh_sum(out * w, pipe.mesh)  # noqa: E731
    schedule = ScheduleGPipe(stage, n_microbatches=N, loss_fn=loss_fn, scale_grads=False)
    x = torch.randn(N * mb, 3, h)
    made = {"input": optimus2d.scatter if fed == "input" else scatter_microbatches}
    made["target"] = optimus2d.scatter if fed == "target" else scatter_microbatches
    block = lambda how: how(x, pipe.mesh) if how is optimus2d.scatter else how(x, pipe.mesh, N)  # noqa: E731
    with pytest.raises(ValueError, match=r"not made by scatter_microbatches\(x, mesh, n=2\)"):
        if pipe.stage == 0:
            schedule.step(block(made["input"]))
        else:
            schedule.step(target=block(made["target"]), losses=[])
    with pytest.raises(ValueError, match=r"causal_lm_targets: the stages have different shapes"):
        causal_lm_targets(torch.zeros(N * mb, 3, dtype=torch.long), pipe.mesh)


def test_an_eval_step_read_back_with_gather_microbatches_is_serials_output(world):
    """``schedule.eval()`` returns the last set's output with torch's micro-batches merged in the
    order ``scatter_microbatches`` made: ``gather`` alone gave the rows in that order (0.98 off the
    serial output); ``gather_microbatches`` puts them back."""
    tower, tower_shape, llm_shape = _cases(world)[0]
    pipe = _pipe(world, tower, (tower_shape, llm_shape))
    h, mb = 8, 2 * tower_shape[1] * llm_shape[1] * tower_shape[0] * llm_shape[0]
    torch.manual_seed(0)
    serial = torch.nn.ModuleList([torch.nn.Linear(h, h), torch.nn.Linear(h, h)])
    chunk = optimus2d.parallelize(copy.deepcopy(serial[pipe.stage]), pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=(mb, 3, h))
    schedule = ScheduleGPipe(stage, n_microbatches=N)
    x = torch.randn(N * mb, 3, h)
    with torch.no_grad():
        if pipe.stage == 0:
            schedule.eval(scatter_microbatches(x, pipe.mesh, N))
        else:
            out = schedule.eval()
            want = serial[1](serial[0](x))
            assert_close(gather_microbatches(out, pipe.mesh, N), want, 1e-5, "eval output")
            if pipe.mesh.depth * pipe.mesh.q > 1 and N > 1:
                assert (optimus2d.gather(out, pipe.mesh) - want).abs().max() > 1e-3  # gather alone: other order


def test_a_shape_a_set_does_not_divide_is_refused_with_its_numbers(world):
    """Before any message: the batch of a micro-batch must split over both meshes of a boundary."""
    tower, tower_shape, llm_shape = _cases(world)[0]
    pipe = _pipe(world, tower, (tower_shape, llm_shape))
    chunk = optimus2d.parallelize(torch.nn.Linear(8, 8), pipe.mesh)
    odd = (
        tower_shape[0] ** 2 * tower_shape[1] * llm_shape[0] ** 2 * llm_shape[1] + 1
    )  # the LLM's d·q does not divide it
    # the tower's ranks refuse their output (what they send), the LLM's their input
    with pytest.raises(
        ValueError, match=rf"(microbatch|output)_shape=\[{odd}, 3, 8\] must be \[b, ...\] with b divisible"
    ):
        pipeline_stage(chunk, pipe, microbatch_shape=(odd, 3, 8))


@pytest.mark.parametrize(
    "ranks, q, depth, match",
    [
        (lambda w: [range(w), range(1)], 1, 1, "overlap: rank 0 is in sets 0 and 1"),
        (lambda w: [range(1), range(2, w)], 1, 1, "rank 1 in none"),
        (lambda w: [range(1), range(1, w + 1)], 1, 1, "not a rank of the world"),
        (lambda w: [range(1), range(1, w)], 1, 2, "needs depth·q² = 2"),
        (lambda w: [range(w)], 1, 1, "two or more sets"),
    ],
    ids=["overlap", "not-covering", "outside", "shape", "one-set"],
)
def test_rank_sets_refused_on_every_rank(world, ranks, q, depth, match):
    if world.size < 4:
        pytest.skip("needs 4 or more ranks")
    with pytest.raises(ValueError, match=match):
        rank_sets(ranks(world.size), q=q, depth=depth)


def test_rank_sets_that_differ_between_ranks_are_refused_on_every_rank(world):
    if world.size < 4:
        pytest.skip("needs 4 or more ranks")
    split = 1 if world.rank == 0 else 2  # rank 0 asks for another split than its peers
    with pytest.raises(ValueError, match="rank_sets"):
        rank_sets([range(split), range(split, world.size)], q=1, depth=[split, world.size - split])


def test_neighbours_that_declare_different_activations_are_refused_on_every_rank(world):
    """Stage 1 declares 4 tokens where stage 0 sends 3 (and, on torch 2.13, a gradient stage 0 does not
    expect): every rank raises the same ValueError at the step's first exchange, before any activation."""
    tower, tower_shape, llm_shape = _cases(world)[0]
    pipe = _pipe(world, tower, (tower_shape, llm_shape))
    mb = 2 * tower_shape[1] * llm_shape[1] * tower_shape[0] * llm_shape[0]
    chunk = optimus2d.parallelize(torch.nn.Linear(8, 8), pipe.mesh)
    for seq, grads in ((4, True), (3, False)):
        declared = (mb, 3 if pipe.stage == 0 else seq, 8)
        stage = pipeline_stage(chunk, pipe, microbatch_shape=declared, output_grad=grads or pipe.stage == 1)
        loss_fn = lambda out, w: optimus2d.pipeline.mesh_sum(out * w, pipe.mesh)  # noqa: E731
        schedule = ScheduleGPipe(stage, n_microbatches=N, loss_fn=loss_fn, scale_grads=False)
        x = torch.randn(N * mb, declared[1], 8)
        with pytest.raises(ValueError, match="Neighbouring stages must declare the same activation"):
            if pipe.stage == 0:
                schedule.step(scatter_microbatches(x, pipe.mesh, N))
            else:
                schedule.step(target=scatter_microbatches(x, pipe.mesh, N), losses=[])


def test_neighbours_that_declare_different_dtypes_are_refused_on_every_rank(world):
    """bf16 sent to a stage that declared fp16 (the same bytes: read as other numbers, silently; fp32 to
    fp64 aborted gloo): every rank raises the same ValueError at the step's first exchange."""
    tower, tower_shape, llm_shape = _cases(world)[0]
    pipe = _pipe(world, tower, (tower_shape, llm_shape))
    mb = 2 * tower_shape[1] * llm_shape[1] * tower_shape[0] * llm_shape[0]
    dtype = torch.bfloat16 if pipe.stage == 0 else torch.float16
    torch.manual_seed(0)
    chunk = optimus2d.parallelize(torch.nn.Linear(8, 8).to(dtype), pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=(mb, 3, 8))
    loss_fn = lambda out, w: optimus2d.pipeline.mesh_sum(out * w, pipe.mesh)  # noqa: E731
    schedule = ScheduleGPipe(stage, n_microbatches=N, loss_fn=loss_fn, scale_grads=False)
    x = torch.randn(N * mb, 3, 8, dtype=dtype)
    with pytest.raises(ValueError, match=r"dtype bfloat16 here, float16 there|dtype float16 here, bfloat16 there"):
        if pipe.stage == 0:
            schedule.step(scatter_microbatches(x, pipe.mesh, N))
        else:
            schedule.step(target=scatter_microbatches(x, pipe.mesh, N), losses=[])


def test_a_chunk_whose_output_is_not_the_declared_block_is_refused():
    """Packed would send a part of a larger block, silently: it refuses, naming both shapes."""
    from optimus2d.pipeline.rank_sets import Packed

    packed = Packed(torch.nn.Identity(), (2, 3), [(slice(0, 2), slice(0, 3))])
    assert packed(torch.ones(2, 3)).shape == (6,)
    with pytest.raises(ValueError, match=r"output block is \[2, 4\], but its output_shape declares the block \[2, 3\]"):
        packed(torch.ones(2, 4))


def test_a_rank_set_stage_without_its_declared_ends_is_refused():
    """torch would infer undeclared shapes by messages over the lanes, which ranks of a smaller set
    share: the stage refuses before it touches a group."""
    from optimus2d.pipeline.rank_sets import RankSetStage

    meta = torch.empty(2, 8, device="meta")
    for given in ({"input_args": meta}, {"output_args": meta}, {}):
        with pytest.raises(ValueError, match="RankSetStage: give input_args and output_args"):
            RankSetStage(torch.nn.Identity(), 0, 2, "cpu", bridge=None, incoming=[], outgoing=[], **given)


def test_a_chain_of_three_rank_sets_matches_serial(world):
    """Sets of 1, 1 and 2 ranks on 4 ranks (1×1, 1×1, 1×1×2) under GPipe."""
    if world.size != 4:
        pytest.skip("runs on 4 ranks")
    if "chain" not in _pipes:
        _pipes["chain"] = rank_sets([[0], [1], [2, 3]], q=1, depth=(1, 1, 2))
    h, mb = 8, 2
    torch.manual_seed(4)
    serial = torch.nn.ModuleList([torch.nn.Linear(h, h), torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh()),
                                  torch.nn.Linear(h, h)])  # fmt: skip
    _gpipe_matches_serial(_pipes["chain"], serial, 3, [((mb, 3, h), (mb, 3, h))] * 3)
