"""A pipeline whose ranks disagree is caught on every rank before its step sends anything
(``pipeline/agreement.py``); one whose data-parallel copies hold unequal numbers of targets trains
exactly with the loss helpers (``pipeline/models/llama.py``).

Each refusal makes one rank (or one data-parallel copy) differ and asserts that every rank raises the
same kind of ``ValueError``, naming the ranks and what each has, within ``helpers.FAST_S`` (the suite's
collective timeout is 120 s: the error came from the agreement, not a wait running out). 2 stages
× dp 2 × one rank on 4 ranks, × 1×1×2 on 8; the schedule and micro-batch cases also on 2 stages of
1×1×2 (4 ranks) or 2×2 (8). Over MPI and over gloo (``OPTIMUS2D_TRANSPORT=torch``).
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import as_serial, assert_close, raises_fast, stage_pipe, torch_rms_norms
from torch import nn
from torch.distributed.pipelining.schedules import _PipelineSchedule

import optimus2d
from optimus2d.pipeline import SCHEDULES, mesh_sum, pipeline_stage
from optimus2d.pipeline.models.llama import causal_lm_loss, causal_lm_targets, llama_stages

pytestmark = pytest.mark.mpi
takes_split = pytest.mark.skipif(
    "arg_mbs" not in inspect.signature(_PipelineSchedule.step).parameters,
    reason="torch's step takes micro-batches the caller split from 2.15 on",
)

COPIES = {4: (1, 1), 8: (1, 2)}  # world → (q, depth) of each stage mesh of 2 stages × 2 copies
PLAIN = {4: (1, 2), 8: (2, 1)}  # world → (q, depth) of each of 2 stage meshes, no copies
S, H, LAYERS = 3, 8, 2


def _refused(match: str, fn) -> str:
    return raises_fast(ValueError, match, fn)


def _pipe(world, dp: int):
    shapes = COPIES if dp > 1 else PLAIN
    if world.size not in shapes:
        pytest.skip(f"runs on {' or '.join(map(str, shapes))} ranks")
    return stage_pipe(2, *shapes[world.size], dp=dp)


def _unit(pipe) -> int:
    """The batch rows one micro-batch needs per split of the mesh (depth·q)."""
    return pipe.mesh.depth * pipe.mesh.q


def _serial() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(H, H) for _ in range(LAYERS)]).double()


def _step(pipe, name: str, n: int, rows: int, fed: int | None = None, split=None, run: str = "step"):
    """One step of this rank's stage of ``_serial()`` under schedule ``name``: micro-batches of ``rows //
    n`` samples declared, ``fed`` samples (default ``rows``) of this copy's batch fed; the stage's chunk.
    ``split(x_block, target_block)``: the step's keyword arguments instead (micro-batches the caller split);
    ``run="eval"``: the schedule's ``eval`` (forward only) with them."""
    cls, _ = SCHEDULES[name]
    chunk = optimus2d.parallelize(copy.deepcopy(_serial()[pipe.stage : pipe.stage + 1]), pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=(rows // n, S, H))
    schedule = cls(stage, n_microbatches=n, loss_fn=lambda y, t: mesh_sum(y * t, pipe.mesh), scale_grads=False)
    torch.manual_seed(1 + pipe.dp_rank)
    x, probe = torch.randn(fed or rows, S, H, dtype=torch.float64), torch.randn(rows, S, H, dtype=torch.float64)
    x, probe = optimus2d.scatter(x, pipe.mesh), optimus2d.scatter(probe, pipe.mesh)
    if split is not None:
        getattr(schedule, run)(**split(x, probe), **({} if pipe.stage == 0 else {"losses": []}))
    elif pipe.stage == 0:
        schedule.step(x)
    else:
        schedule.step(target=probe, losses=[])
    return chunk


def test_copies_fed_unequal_shares_are_refused(world):
    """Row a: copies given 6 and 2 samples (each declaring its own micro-batch) would average their
    gradients as if the shares were equal; refused, naming both copies' batches."""
    pipe = _pipe(world, dp=2)
    u = _unit(pipe)
    rows = 6 * u if pipe.dp_rank == 0 else 2 * u
    message = _refused(r"pipeline step: the ranks of a stage mesh in every one of the 2 data-parallel copies",
                           lambda: _step(pipe, "1F1B", 2, rows))  # fmt: skip
    copy0 = ", ".join(map(str, pipe.stage_ranks(0, 0)))
    assert f"this rank ({world.rank}) has stage mesh {pipe.stage}: torch stage {pipe.stage}" in message
    assert f"rank{'s' if u > 1 else ''} {copy0}: stage mesh 0: torch stage 0 (float64[3, {S}, {H}]" in message
    assert f"fed batch float64[6, {S}, {H}]" in message and f"fed batch float64[2, {S}, {H}]" in message
    assert "Give each copy an equal share of the batch" in message


@pytest.mark.parametrize("dp", [1, 2])
def test_a_rank_on_another_schedule_is_refused(world, dp):
    """Row c: the last rank runs GPipe, its peers 1F1B (4 micro-batches: the first stage would wait for
    a gradient the last sends only after its fourth forward, which waits for the first stage)."""
    pipe = _pipe(world, dp)
    name = "GPipe" if world.rank == world.size - 1 else "1F1B"
    message = raises_fast(
        ValueError, r"pipeline step: the ranks disagree", lambda: _step(pipe, name, 4, 4 * _unit(pipe))
    )
    others = ", ".join(map(str, range(world.size - 1)))
    assert f"this rank ({world.rank}) has Schedule{name}(n_microbatches=4, scale_grads=False) step" in message
    assert f"ranks {others}: Schedule1F1B(n_microbatches=4" in message
    assert f"rank {world.size - 1}: ScheduleGPipe(n_microbatches=4" in message


@pytest.mark.parametrize("dp", [1, 2])
def test_a_rank_with_another_microbatch_count_is_refused(world, dp):
    """Row d: the last rank splits its batch into 2 micro-batches, its peers into 4 (gloo would abort)."""
    pipe = _pipe(world, dp)
    n = 2 if world.rank == world.size - 1 else 4
    message = raises_fast(
        ValueError, r"pipeline step: the ranks disagree", lambda: _step(pipe, "1F1B", n, 4 * _unit(pipe))
    )
    assert f"this rank ({world.rank}) has Schedule1F1B(n_microbatches={n}," in message
    assert f"rank {world.size - 1}: Schedule1F1B(n_microbatches=2," in message
    assert "Schedule1F1B(n_microbatches=4," in message


def test_a_copy_fed_fewer_samples_than_declared_is_refused(world):
    """Row e: copy 1 feeds its first stage 3 micro-batches' samples where it declared 4 (its peers would
    wait for the fourth): refused by those ranks, and so by every rank, with the numbers."""
    pipe = _pipe(world, dp=2)
    u = _unit(pipe)
    short = pipe.stage == 0 and pipe.dp_rank == 1
    fed = 3 * u if short else None
    message = _refused(r"rank \d+ refused it", lambda: _step(pipe, "1F1B", 4, 4 * u, fed))
    for rank in pipe.stage_ranks(0, 1):
        assert (
            f"rank {rank} refused it: ValueError: pipeline step: rank {rank} feeds torch stage 0 a batch block "
            f"float64[3, {S}, {H}], but 4 micro-batches of the block it declared, float64[1, {S}, {H}] "
            f"(microbatch_shape), make [4, {S}, {H}]"
        ) in message


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-first", "trained"])
def test_neighbours_declaring_the_gradient_unlike_are_refused(world, frozen):
    """A first stage left at ``output_grad=True`` (frozen or not) beside a next stage declaring
    ``input_grad=False``: the first would wait for a gradient never sent (its peers ran on, and it
    hung). Refused on every rank before the step sends anything."""
    pipe = _pipe(world, dp=1)
    chunk = optimus2d.parallelize(copy.deepcopy(_serial()[pipe.stage : pipe.stage + 1]), pipe.mesh)
    if pipe.stage == 0 and frozen:
        chunk.requires_grad_(False)
    declared = {} if pipe.stage == 0 else {"input_grad": False}
    stage = pipeline_stage(chunk, pipe, microbatch_shape=(_unit(pipe), S, H), **declared)
    cls, _ = SCHEDULES["1F1B"]
    schedule = cls(stage, n_microbatches=2, loss_fn=lambda y, t: mesh_sum(y * t, pipe.mesh), scale_grads=False)
    x = optimus2d.scatter(torch.randn(2 * _unit(pipe), S, H, dtype=torch.float64), pipe.mesh)
    run = (lambda: schedule.step(x)) if pipe.stage == 0 else (lambda: schedule.step(target=x, losses=[]))
    message = _refused(r"torch stage 0 declares its output with a gradient \(output_grad\), torch stage 1", run)
    assert "its input without a gradient (input_grad)" in message


def test_a_target_other_than_the_declared_output_blocks_is_refused(world):
    """The last stage fed a target of half the samples: torch split it into micro-batches of other
    rows and the loss broadcast silently (a quarter: torch's error on the last stage alone, the first
    waiting). Refused on every rank, with the numbers."""
    pipe = _pipe(world, dp=1)
    u = _unit(pipe)
    chunk = optimus2d.parallelize(copy.deepcopy(_serial()[pipe.stage : pipe.stage + 1]), pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=(2 * u, S, H))
    cls, _ = SCHEDULES["1F1B"]
    schedule = cls(stage, n_microbatches=2, loss_fn=lambda y, t: mesh_sum(y * t, pipe.mesh), scale_grads=False)
    x = optimus2d.scatter(torch.randn(4 * u, S, H, dtype=torch.float64), pipe.mesh)
    half = optimus2d.scatter(torch.randn(2 * u, S, H, dtype=torch.float64), pipe.mesh)
    run = (lambda: schedule.step(x)) if pipe.stage == 0 else (lambda: schedule.step(target=half, losses=[]))
    message = _refused(r"rank \d+ refused it", run)
    assert (
        f"a target float64[2, {S}, {H // pipe.mesh.q}], but 2 micro-batches of the output block it declared" in message
    )


def _as_split(pipe, n: int, change=None):
    """``split`` for ``_step``: this rank's blocks in ``n`` micro-batches (``arg_mbs`` on the first stage,
    ``target_mbs`` on the last), passed through ``change(keywords)`` on the ranks it is given for."""

    def split(x, t):
        kw = (
            {"arg_mbs": [(c,) for c in x.tensor_split(n)]}
            if pipe.stage == 0
            else {"target_mbs": list(t.tensor_split(n))}
        )
        return change(kw) if change is not None else kw

    return split


@takes_split
@pytest.mark.parametrize("dp", [1, 2])
def test_micro_batches_split_by_the_caller_train_as_the_whole_batch(world, dp):
    """torch ≥ 2.15's ``step(arg_mbs=..., target_mbs=...)``: micro-batches the caller split pass the
    agreement and give the serial ``nn.Sequential``'s gradients (averaged over the copies' batches, as
    the copies average theirs), the very ones the whole batch gives."""
    pipe = _pipe(world, dp)
    rows = 4 * _unit(pipe)
    whole = _step(pipe, "1F1B", 4, rows)
    split = _step(pipe, "1F1B", 4, rows, split=_as_split(pipe, 4))
    for (name, a), (_, b) in zip(whole.named_parameters(), split.named_parameters(), strict=True):
        assert_close(b.grad, a.grad, 0, f"grad {name}")
    serial = _serial()
    for copy_rank in range(pipe.dp):  # each copy's batch and probe, as _step draws them
        torch.manual_seed(1 + copy_rank)
        x, probe = torch.randn(rows, S, H, dtype=torch.float64), torch.randn(rows, S, H, dtype=torch.float64)
        ((serial(x) * probe).sum() / pipe.dp).backward()
    ref, grads = dict(serial.named_parameters()), as_serial(split)
    assert grads
    for key, g in grads.items():
        assert_close(g, ref[key].grad, 1e-10, f"grad {key}")


SPLIT_REFUSALS = {  # case: (how copy 1's ranks change the split keywords, what the refusal says)
    "count": (
        lambda kw: {k: v[:3] for k, v in kw.items()},
        r"passes 3 micro-batches in (arg|target)_mbs, but the schedule runs 4 \(n_microbatches\)",
    ),
    "block": (
        lambda kw: {k: [(torch.cat([c[0], c[0]]),) for c in v] if k == "arg_mbs" else v for k, v in kw.items()},
        r"feeds torch stage 0 micro-batch 0 \(arg_mbs\) float64\[2, 3, 8\], but declared float64\[1, 3, 8\]",
    ),
    "whole beside": (
        lambda kw: {**kw, "target": kw["target_mbs"][0]} if "target_mbs" in kw else {**kw, "mask": 1},
        r"passes (a target|keyword inputs) of the whole batch beside micro-batches split by the caller",
    ),
    "not a list": (
        lambda kw: {k: tuple(v) for k, v in kw.items()},
        r"passes (arg|target)_mbs as a tuple: give a list",
    ),
}


@takes_split
@pytest.mark.parametrize(("case", "run"), [*((case, "step") for case in SPLIT_REFUSALS), ("count", "eval")])
def test_micro_batches_split_by_the_caller_that_do_not_fit_are_refused(world, case, run):
    """Copy 1's ranks pass split micro-batches that torch refuses only once its step is under way, on
    those ranks alone, while the rest wait (its first stage's, and its last's for the target), or that
    are not the block its first stage declared: every rank refuses the step (and, once, ``eval``) before
    it sends anything, naming each of those ranks and why."""
    pipe = _pipe(world, dp=2)
    change, match = SPLIT_REFUSALS[case]
    odd = pipe.stage_ranks(0, 1) + (pipe.stage_ranks(1, 1) if case != "block" else ())
    split = _as_split(pipe, 4, change if world.rank in odd else None)
    message = raises_fast(
        (ValueError, TypeError), "pipeline step", lambda: _step(pipe, "1F1B", 4, 4 * _unit(pipe), split=split, run=run)
    )
    assert re.search(match, message), message
    for rank in odd:
        assert f"rank {rank} refused it" in message, message


@takes_split
def test_a_rank_that_keeps_its_gradients_unfinalized_is_refused(world):
    """torch ≥ 2.15's ``step(finalize_gradients=False)`` on the last rank alone (an FSDP stage would
    skip the reduce its peers wait in): the ranks disagree, named with their values."""
    pipe = _pipe(world, dp=2)
    last = world.rank == world.size - 1
    split = _as_split(pipe, 4, (lambda kw: {**kw, "finalize_gradients": False}) if last else None)
    message = raises_fast(
        ValueError, "pipeline step: the ranks disagree", lambda: _step(pipe, "1F1B", 4, 4 * _unit(pipe), split=split)
    )
    assert (
        f"rank {world.size - 1}: Schedule1F1B(n_microbatches=4, scale_grads=False) step over 2 torch stages, "
        "finalize_gradients=False" in message
    )
    assert "finalize_gradients=True" in message


# ---- row b: the loss helpers over data-parallel copies --------------------------------------------
V, HL, SEQ, N = 96, 48, 8, 2  # vocabulary, hidden, sequence, micro-batches


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=HL, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config).double()
    torch_rms_norms(lm, HL, "LlamaRMSNorm")  # HF's computes in float32: nn.RMSNorm keeps serial exact
    return lm


def _batch(pipe):
    """The whole batch's ids and labels, 2·depth·q rows per copy: copy 0's labels keep 2 targets a
    row (4 of 14 on 4 ranks, the rest -100: padding), copy 1's all 7 (14)."""
    rows = 2 * _unit(pipe)
    torch.manual_seed(2)
    ids = torch.randint(0, V, (pipe.dp * rows, SEQ))
    labels = ids.clone()
    labels[:rows, 3:] = -100  # targets are labels 1.. of a row: copy 0 keeps labels 1 and 2
    return ids, labels, rows


@pytest.mark.parametrize(("name", "given"), [("1F1B", "pipe"), ("GPipe", "mesh")])
def test_copies_with_unequal_targets_match_the_serial_model(world, name, given):
    """Row b: ``causal_lm_targets(copy_labels, pipe)`` (or ``pipe.mesh``) counts the whole batch's
    targets (18 on 4 ranks: 4 in one copy, 14 in the other), ``causal_lm_loss`` scales each copy's loss
    by dp: the copies' mean loss and every gradient are the serial model's on the whole batch (before:
    every gradient off, up to 117%; with the whole count given, exactly half). One agreement exchange
    per step, counted apart."""
    pipe = _pipe(world, dp=2)
    where = pipe if given == "pipe" else pipe.mesh
    ids, labels, rows = _batch(pipe)
    mine = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)  # this copy's share
    serial = _llama()
    chunk = optimus2d.parallelize(llama_stages(serial, 2)[pipe.stage], pipe.mesh)
    first, mb = pipe.stage == 0, rows // N
    stage = pipeline_stage(
        chunk, pipe, microbatch_shape=(mb, SEQ) if first else (mb, SEQ, HL),
        output_shape=(mb, SEQ, HL) if first else (mb, SEQ, V), token_ids=first,
    )  # fmt: skip
    target, count = causal_lm_targets(labels[mine], where)
    assert count == int((labels[:, 1:] != -100).sum())  # 4 + 14 on 4 ranks
    cls, _ = SCHEDULES[name]
    schedule = cls(stage, n_microbatches=N, loss_fn=causal_lm_loss(where, count), scale_grads=False)
    losses: list[torch.Tensor] = []
    with optimus2d.count_comm() as counted:
        if first:
            schedule.step(optimus2d.scatter_batch(ids[mine], pipe.mesh))
        else:
            schedule.step(target=target, losses=losses)
    assert [c.axis for c in counted.checks].count("pipeline step") == 1
    grads = as_serial(chunk)

    logits = serial(input_ids=ids, use_cache=False).logits
    loss_ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss_ref.backward()
    if not first:  # each copy's loss is dp × its part of the whole batch's: their mean is the serial loss
        total = torch.stack(losses).sum()
        torch.distributed.all_reduce(total, group=pipe.dp_group)
        assert_close(total / pipe.dp, loss_ref.detach(), 1e-10, "loss")
    ref = dict(serial.named_parameters())
    assert grads
    for key, g in grads.items():
        assert_close(g, ref[key].grad, 1e-10, f"grad {key}")


def test_copies_given_labels_of_other_shapes_are_refused(world):
    """The loss helper's count over the copies agrees on their labels first: 6 and 2 rows refused."""
    pipe = _pipe(world, dp=2)
    u = _unit(pipe)
    labels = torch.zeros(6 * u if pipe.dp_rank == 0 else 2 * u, SEQ, dtype=torch.long)
    message = _refused(r"causal_lm_targets over the 2 data-parallel copies: the ranks disagree",
                           lambda: causal_lm_targets(labels, pipe))  # fmt: skip
    assert f"int64[{6 * u}, {SEQ}]" in message and f"int64[{2 * u}, {SEQ}]" in message


def test_a_copy_whose_labels_its_mesh_refuses_is_refused_on_every_copy(world):
    """One copy's labels refused by its own split (3 micro-batches of 4 rows): the other copy waited
    in the count over the copies to the timeout; now the refusal is every copy's."""
    pipe = _pipe(world, dp=2)
    labels = torch.zeros(4 * _unit(pipe), SEQ, dtype=torch.long)
    n = 2 if pipe.dp_rank == 0 else 3
    _refused(r"causal_lm_targets over the 2 data-parallel copies: rank \d+ refused it: ValueError",
             lambda: causal_lm_targets(labels, pipe, microbatches=n))  # fmt: skip
