"""Agreement before a pipeline step: every rank runs the same step, and each stage's ranks are fed alike.

A pipeline whose ranks disagree hangs or computes a wrong model, silently: one rank running GPipe
while its peers run 1F1B waits for a message never sent; a different micro-batch count makes gloo
abort ("Received data size doesn't match"); a data-parallel copy fed fewer samples than it declared
waits out the timeout; copies fed 6 and 2 samples average their gradients as if the shares were
equal. So at the start of each ``step()``/``eval()`` of a torch schedule, before the inputs are
split and before anything is sent, every rank of the pipeline (every stage mesh of every copy: the
world) takes part in one all-gather of 11 words (``comm/agreement.py``'s signature, then six more):

* the step, the same on every rank: the schedule's class, ``n_microbatches``, ``scale_grads``,
  training or eval, the number of torch stages (else "the ranks disagree", naming each rank's);
* what each stage mesh is fed, the same on each rank of that stage mesh in every copy: its torch
  stages with their declared micro-batch blocks, and the step's inputs (the first stage's batch
  block, keyword inputs, the last stage's target block), by dtype and shape. A first stage whose
  block is not ``n_microbatches`` of its declared ``microbatch_shape`` refuses the step itself;
  so does a rank that passes micro-batches it split itself (torch ≥ 2.15's ``arg_mbs``,
  ``kwarg_mbs``, ``target_mbs``) that are not a list of ``n_microbatches`` tuples (dicts), that
  are not the declared block, or that come beside a whole batch: torch checks these only once its
  step is under way, on that rank alone, while the others wait. (Copies of a stage mesh feed alike:
  one fed the whole batch beside another fed the same split by the caller is refused too.) On torch
  ≥ 2.15 the step's ``finalize_gradients`` is part of the step (an FSDP stage without it would skip
  the reduce its peers wait in). Stage meshes of different shapes (``stage_meshes``, ``rank_sets``)
  re-split each micro-batch as the serial ``x.chunk(n)[m]``: a first stage's input or a last stage's
  target not made by ``scatter_microbatches`` (with n) on a mesh of more than one batch block is
  refused, as it would pair other samples.

Otherwise every rank raises the same ``ValueError`` before the step sends anything, naming the
ranks and what each has (a second all-gather, of each rank's text). In the same all-gather each
boundary between torch stages is checked: its sender's declared output and its receiver's declared
input both with a gradient (``output_grad``, ``input_grad``) or both without (else the one waits for
a gradient the other never sends); and the last stage's target holds ``n`` of its declared output
blocks along the batch. The stage (``LaneStage``) runs
it from ``clear_runtime_states``, the first thing torch's ``step`` asks of every stage, and reads
the step's arguments from that call's frame; at ``check="off"`` (the stage mesh's level) it is
skipped. ``copies_sum``: a count summed over the copies, agreed the same way (the loss helpers').
"""

from __future__ import annotations

import sys
import zlib

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _PipelineSchedule

from optimus2d.comm import agreement

__all__ = ["agree_step", "calling_schedule", "copies_sum"]

_SPLIT = ("arg_mbs", "kwarg_mbs", "target_mbs")  # torch ≥ 2.15: micro-batches the caller split


def calling_schedule(stage) -> tuple[_PipelineSchedule | None, dict]:
    """The torch schedule whose ``step`` (or ``eval``) called into ``stage``, and that call's locals
    (``args``, ``kwargs``, ``target``); ``(None, {})`` when no schedule of ``stage`` is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, _PipelineSchedule) and any(s is stage for s in _stages(owner)):
            return owner, frame.f_locals
        frame = frame.f_back
    return None, {}


def _stages(schedule: _PipelineSchedule) -> list:
    return list(getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)])


def agree_step(stage, pipe) -> None:
    """At the start of a torch schedule's step: every rank of ``pipe`` agrees on the step and each
    stage mesh's inputs (the module docstring), or every rank raises the same ``ValueError``.
    Collective over the world; run once per step, by the first of the rank's stages."""
    schedule, step = calling_schedule(stage)
    if schedule is None or _stages(schedule)[0] is not stage or not _shared(pipe):
        return
    n = schedule._n_microbatches
    stages = sorted(_stages(schedule), key=lambda s: s.stage_index)
    training = "step" if schedule._has_backward else "eval (forward only)"
    what = (
        f"{type(schedule).__name__}(n_microbatches={n}, scale_grads={schedule.scale_grads}) {training} "
        f"over {stage.num_stages} torch stages"
    )
    args, kwargs, target = step.get("args", ()), step.get("kwargs") or {}, step.get("target")
    split = {name: step[name] for name in _SPLIT if step.get(name) is not None}
    if "finalize_gradients" in step:  # torch ≥ 2.15: FSDP stages reduce at the end of this call or not
        final = step["finalize_gradients"]
        what += f", finalize_gradients={final if isinstance(final, bool) else type(final).__name__}"
    fed = _fed(stages, args, kwargs, target, split)
    error = (
        _split_refusal(stages, split, (args, kwargs, target), n)
        or _refusal(stages, args, n, schedule)
        or _target_refusal(stages, target, n, schedule)
        or _order_refusal(stages, (args, kwargs, target), n, pipe)
    )
    extra = (zlib.crc32(str(pipe.stage).encode()), zlib.crc32(fed.encode()), *_gradients_declared(stages))
    words = agreement.signature("pipeline step", what, (), error) + list(extra)
    timeout = pipe.mesh.timeout
    gather = lambda t: agreement.gather_world(t, timeout)  # noqa: E731
    table = gather(torch.tensor(words, dtype=torch.int64))
    world = tuple(range(dist.get_world_size()))
    agreement.verdict(table[:, :5], gather, world, "pipeline step", what, error, None)
    _neighbours_agree(table[:, 7:].tolist())
    groups: dict[int, set[int]] = {}
    for key, crc in table[:, 5:7].tolist():
        groups.setdefault(key, set()).add(crc)
    if all(len(crcs) == 1 for crcs in groups.values()):
        return
    texts = agreement.exchange_texts(gather, f"stage mesh {pipe.stage}: {fed}")
    _raise_unlike(texts, table, pipe)


def _gradients_declared(stages: list) -> tuple[int, int, int, int]:
    """Four bit masks over the boundaries b (torch stage b → b + 1, b < 63): those whose sender this
    rank holds, and whether it declared a gradient back there (``output_grad``); those whose receiver
    it holds, and whether that declared one (``input_grad``)."""
    sends = sends_grad = takes = takes_grad = 0
    for s in stages:
        if hasattr(s, "_handshake"):  # rank sets' stages agree their boundaries with their neighbours
            continue
        declared_in, declared_out = getattr(s, "declared", (None, None))
        if isinstance(declared_out, torch.Tensor) and not s.is_last and s.stage_index < 63:
            sends |= 1 << s.stage_index
            sends_grad |= int(declared_out.requires_grad) << s.stage_index
        if isinstance(declared_in, torch.Tensor) and not s.is_first and s.stage_index <= 63:
            takes |= 1 << (s.stage_index - 1)
            takes_grad |= int(declared_in.requires_grad) << (s.stage_index - 1)
    return sends, sends_grad, takes, takes_grad


def _neighbours_agree(rows: list[list[int]]) -> None:
    """Refuse, on every rank alike (the same gathered table), a boundary whose sender declares a
    gradient back (``output_grad``) and whose receiver does not (``input_grad``), or the reverse: the
    sender would wait for a gradient never sent, or the receiver send one never received."""
    for b in range(63):
        sent = {(row[1] >> b) & 1 for row in rows if (row[0] >> b) & 1}
        taken = {(row[3] >> b) & 1 for row in rows if (row[2] >> b) & 1}
        if len(sent | taken) > 1:
            say = {1: "with a gradient", 0: "without a gradient"}
            raise ValueError(
                f"pipeline step: torch stage {b} declares its output {' and '.join(say[g] for g in sorted(sent))} "
                f"(output_grad), torch stage {b + 1} its input {' and '.join(say[g] for g in sorted(taken))} "
                f"(input_grad): the one would wait for a gradient the other never sends. Declare them alike "
                f"(a frozen first stage: output_grad=False beside the next stage's input_grad=False)"
            )


def _target_refusal(stages: list, target, n: int, schedule) -> ValueError | None:
    """Why this rank refuses the step: its last stage's target is not ``n`` micro-batches of the
    output block it declared (``output_shape``) along the batch, so torch would split it into
    micro-batches of other samples (or fail on this rank alone). None if it is (or cannot be judged)."""
    last = stages[-1]
    if not last.is_last or not isinstance(target, torch.Tensor) or target.dim() < 1:
        return None
    declared = getattr(last, "declared", (None, None))[1]
    if not isinstance(declared, torch.Tensor) or declared.dim() < 1:
        return None
    if target.shape[0] == n * declared.shape[0]:
        return None
    return ValueError(
        f"pipeline step: rank {dist.get_rank()} feeds torch stage {last.stage_index} a target "
        f"{agreement.describe(target)}, but {n} micro-batches of the output block it declared, "
        f"{agreement.describe(declared)} (output_shape), hold {n * declared.shape[0]} along the batch: "
        f"feed the target block of the same samples as the batch (scatter_batch or scatter_microbatches)"
    )


def _shared(pipe) -> bool:
    """Whether the step has peers to agree with: a pipeline of more than one stage mesh, checked."""
    return pipe.stages * pipe.dp > 1 and pipe.mesh.check != "off" and dist.is_initialized()


def _fed(stages: list, args, kwargs: dict, target, split: dict) -> str:
    """This rank's torch stages with their declared blocks, and what the step feeds them: the whole
    batch, or the micro-batches the caller split (``split``: torch ≥ 2.15's ``arg_mbs``,
    ``kwarg_mbs``, ``target_mbs``), each where torch reads it (the first stage's inputs, the last's
    target, keyword inputs everywhere)."""
    parts = []
    for s in stages:
        declared_in, declared_out = (agreement.describe(t) for t in getattr(s, "declared", (None, None)))
        parts.append(f"torch stage {s.stage_index} ({declared_in} → {declared_out} a micro-batch)")
    fed = []
    if stages[0].is_first and (args or "arg_mbs" not in split):
        fed.append(f"batch {_describe(args)}")
    if kwargs:
        fed.append(", ".join(f"{k}={agreement.describe(v)}" for k, v in kwargs.items()))
    if stages[-1].is_last and (target is not None or "target_mbs" not in split):
        fed.append(f"target {agreement.describe(target)}")
    read = {"arg_mbs": stages[0].is_first, "kwarg_mbs": True, "target_mbs": stages[-1].is_last}
    fed += [f"{name} split by the caller into {_describe_mbs(mbs)}" for name, mbs in split.items() if read[name]]
    return ", ".join(parts) + (f" fed {'; '.join(fed)}" if fed else "")


def _describe_mbs(mbs) -> str:
    """``"4 micro-batches, each (float64[1, 3, 8])"``, or each listed where they differ."""
    if not isinstance(mbs, list):
        return type(mbs).__name__
    each = [_describe_mb(m) for m in mbs]
    if each and all(e == each[0] for e in each):
        return f"{len(each)} micro-batches, each {each[0]}"
    return f"{len(each)} micro-batches: " + ", ".join(each)


def _describe_mb(mb) -> str:
    if isinstance(mb, tuple):
        return f"({_describe(mb)})"
    if isinstance(mb, dict):
        return "{" + agreement.describe_call((), mb) + "}"
    return agreement.describe(mb)


def _split_refusal(stages: list, split: dict, whole: tuple, n: int) -> Exception | None:
    """Why this rank refuses micro-batches the caller split (torch ≥ 2.15's ``step(arg_mbs=...,
    kwarg_mbs=..., target_mbs=...)``): torch itself checks them only after the step began, on the
    rank that has them, while its peers go on and wait. None where nothing was split, or it fits."""
    if not split:
        return None
    me = dist.get_rank()
    args, kwargs, target = whole
    given = [what for what, v in (("positional inputs", args), ("keyword inputs", kwargs)) if v]
    given += ["a target"] if target is not None else []
    if given:
        return ValueError(
            f"pipeline step: rank {me} passes {' and '.join(given)} of the whole batch beside micro-batches split "
            f"by the caller ({', '.join(split)}): pass either the whole batch or its micro-batches"
        )
    for name, mbs in split.items():
        if not isinstance(mbs, list):
            return TypeError(f"pipeline step: rank {me} passes {name} as a {type(mbs).__name__}: give a list")
        if len(mbs) != n:
            return ValueError(
                f"pipeline step: rank {me} passes {len(mbs)} micro-batches in {name}, but the schedule runs {n} "
                f"(n_microbatches)"
            )
        kind = {"arg_mbs": tuple, "kwarg_mbs": dict}.get(name)
        bad = next((i for i, m in enumerate(mbs) if kind is not None and not isinstance(m, kind)), None)
        if bad is not None:
            return TypeError(
                f"pipeline step: rank {me} passes {name}[{bad}] as a {type(mbs[bad]).__name__}: give each micro-batch "
                f"as a {kind.__name__}"
            )
    declared = getattr(stages[0], "declared", (None,))[0]
    if not stages[0].is_first or not isinstance(declared, torch.Tensor):
        return None
    for i, mb in enumerate(split.get("arg_mbs", ())):
        if len(mb) == 1 and isinstance(mb[0], torch.Tensor) and mb[0].shape != declared.shape:
            return ValueError(
                f"pipeline step: rank {me} feeds torch stage {stages[0].stage_index} micro-batch {i} (arg_mbs) "
                f"{agreement.describe(mb[0])}, but declared {agreement.describe(declared)} (microbatch_shape): "
                f"split each data-parallel copy's share into micro-batches of the declared block"
            )
    return None


def _describe(args) -> str:
    if isinstance(args, (tuple, list)):
        return ", ".join(agreement.describe(a) for a in args) if args else "nothing"
    return agreement.describe(args)


def _refusal(stages: list, args, n: int, schedule) -> ValueError | None:
    """Why this rank refuses the step: its first stage's batch block is not ``n`` micro-batches of the
    block it declared (``microbatch_shape``), so torch would split it into micro-batches of another
    size, which the next stage cannot receive. None if it is (or cannot be judged)."""
    first = stages[0]
    if not first.is_first or schedule._args_chunk_spec is not None or not isinstance(args, (tuple, list)):
        return None
    declared = getattr(first, "declared", (None,))[0]
    batch = args[0] if len(args) == 1 else None
    if not isinstance(batch, torch.Tensor) or not isinstance(declared, torch.Tensor) or declared.dim() < 1:
        return None
    want = [n * declared.shape[0], *declared.shape[1:]]
    if list(batch.shape) == want:
        return None
    me = dist.get_rank()
    return ValueError(
        f"pipeline step: rank {me} feeds torch stage {first.stage_index} a batch block {agreement.describe(batch)}, "
        f"but {n} micro-batches of the block it declared, {agreement.describe(declared)} (microbatch_shape), "
        f"make {want}: feed each data-parallel copy its equal share of the batch (a batch that does not split "
        f"evenly over the copies and micro-batches is refused), or declare the micro-batch it is fed"
    )


def _order_refusal(stages: list, whole: tuple, n: int, pipe) -> ValueError | None:
    """Why this rank refuses the step: its stage mesh is one of stages of different shapes, whose
    boundaries re-split each micro-batch as the serial ``x.chunk(n)[m]``, but its first stage's
    inputs or its last stage's target are not in that order (not made by ``scatter_microbatches``:
    ``scatter``'s micro-batch m is the m-th slice of every batch block, other samples, silently).
    A mesh of one batch block (d·q = 1) holds each micro-batch in order whatever made it."""
    meshes = getattr(pipe, "meshes", ())
    mesh = pipe.mesh
    if n == 1 or len({(m.q, m.depth) for m in meshes}) < 2 or mesh.depth * mesh.q == 1:
        return None
    args, kwargs, target = whole
    fed = []
    if stages[0].is_first:
        fed += [(f"input {i}", a) for i, a in enumerate(args if isinstance(args, (tuple, list)) else (args,))]
        fed += [(f"input {k}=", v) for k, v in (kwargs or {}).items()]
    if stages[-1].is_last and target is not None:
        fed.append(("target", target))
    for name, t in fed:
        if isinstance(t, torch.Tensor) and t.dim() and getattr(t, "_optimus2d_microbatches", None) != n:
            shapes = [f"Mesh(q={m.q}, depth={m.depth})" for m in meshes]
            return ValueError(
                f"pipeline step: rank {dist.get_rank()} feeds its stage ({mesh}) {name} {agreement.describe(t)} "
                f"not made by scatter_microbatches(x, mesh, n={n}): the stages have different shapes "
                f"({', '.join(shapes)}), so each boundary re-splits a micro-batch as the serial x.chunk({n})[m], "
                f"and a block made by scatter or scatter_batch would pair other samples"
            )
    return None


def _raise_unlike(texts: list[str], table: torch.Tensor, pipe) -> None:
    """Raise, on every rank alike, that the ranks of a stage mesh (over its copies) are fed unlike."""
    me = dist.get_rank()
    by_key: dict[int, dict[str, list[int]]] = {}
    for rank, (key, _) in enumerate(table[:, 5:7].tolist()):
        by_key.setdefault(key, {}).setdefault(texts[rank], []).append(rank)
    unlike = next(found for found in by_key.values() if len(found) > 1)
    parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {t}" for t, rs in unlike.items())
    copies = f" in every one of the {pipe.dp} data-parallel copies" if pipe.dp > 1 else ""
    raise ValueError(
        f"pipeline step: the ranks of a stage mesh{copies} must run the same torch stages on inputs of the same "
        f"shapes, and do not: this rank ({me}) has {texts[me]}; {parts}. Give each copy an equal share of the batch "
        f"(a batch that does not split evenly over the copies is refused)"
    )


def copies_sum(mesh, copies: tuple, what: str, description: str, value: int, error: BaseException | None = None) -> int:
    """``value`` summed over the data-parallel copies of stage mesh ``mesh`` (``copies``: its
    ``(dp, dp_group, dp_ranks)``, this rank's place in each copy), the copies first agreeing on
    ``description`` (one all-gather of 6 words; a disagreement, or one copy's ``error``, raises on
    every rank of the group). Collective over ``dp_group``."""
    dp, group, ranks = copies
    if group is None:
        if error is not None:
            raise error
        return value
    words = [*agreement.signature(what, description, (), error), int(value)]
    gather = lambda t: agreement.gather_group(t, group, mesh, f"{what} over the copies")  # noqa: E731
    table = gather(torch.tensor(words, dtype=torch.int64))
    where = f"{what} over the {dp} data-parallel copies"
    agreement.verdict(table[:, :5], gather, ranks, where, description, error, mesh)
    return int(table[:, 5].sum())
