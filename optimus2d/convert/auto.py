"""``parallelize(model, mesh, plan="auto")``: a layout for each MLP and layer of a model, chosen by cost.

The blocks are the model's MLPs that Megatron's 1D split knows (``megatron.split_of`` without
attention heads: an ``nn.Sequential`` Linear–element-wise–Linear, LLaMA's, CLIP's and SigLIP's
MLPs, LLaVA's projector) and its ``nn.TransformerEncoderLayer``s (priced as pre-norm layers over
sequences of ``Auto(seq=)``; in 1D where their heads and linears split), outermost first,
the model itself excepted (a 1D module needs a boundary around it; a model that is one block alone is
warned of and stays on its mesh). A module below the model made
of two or more blocks of one width, with no weights of its own but norms' (an ``nn.TransformerEncoder``),
is one part (``_parts``): laid out whole, one boundary in and out (``cost.auto``), in 1D too where
every block of it splits. A module hanging
from the model that holds attention Megatron splits (a LLaMA's ``model``) is a region (``_regions``):
whole in 1D, or on the mesh with its blocks laid out alone. Each may stay on the model's
mesh, move to another mesh shape over the same ranks (2×2, 1×1×4: its weights whole, the batch
split), or run in 1D (``megatron.Megatron``); the rest of the model stays on the mesh.
``cost.auto.choose`` prices every combination on this machine's ``Hardware``
(``cost.calibration.hardware``, measured once and cached) for ``tokens`` rows a step and keeps the
fastest whose bytes a rank fit ``memory``. A gated MLP (three linears) is priced as an MLP of the
same weights (f' = 3f/2).

``Auto(tokens=, memory=, explain=)`` says for what: ``plan="auto"`` is ``Auto()``, 8192 tokens a
step and no memory cap. ``explain=True`` prints the candidates (rank 0) before converting.
``Auto(measure=step, top=4)`` also times the ``top`` best predicted that fit, and the model's own
mesh for every block (no plan): each on a converted deep copy of the model, ``step(copy)`` (one
forward and backward, as the user trains) once to warm up and three times timed
(``calibration.time_step``: the slowest rank's median), and picks the fastest measured; the table
gains a "measured ms" column. A step that raises is reported on the failure channel
(``comm.watch``) of the meshes it runs on: peers waiting in those meshes' collectives raise
``PeerFailedError`` naming it within a fraction of a second, not at the collective timeout (a 1D
row's DTensor collectives wait on torch's process group: there, its timeout). Those meshes are
dead afterwards, as after any failed collective, even where every rank raised alike.
``choose_plan(model, mesh, auto)`` returns the ``Choice`` and the plan without converting.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn

from optimus2d.comm import watch
from optimus2d.comm.agreement import agree
from optimus2d.comm.mesh import Mesh
from optimus2d.convert.auto_example import describe, traced_rows
from optimus2d.convert.layouts import describe_io
from optimus2d.cost.auto import Block, Choice, choose
from optimus2d.cost.calibration import hardware, time_step
from optimus2d.cost.planner import Hardware
from optimus2d.megatron import Megatron, split_of, tensor_parallel_plan
from optimus2d.megatron.plans import COLWISE

__all__ = ["Auto", "choose_plan"]


@dataclass(frozen=True)
class Auto:
    """``plan=Auto(...)``: choose each MLP's layout for ``tokens`` rows a step (batch × sequence of the
    whole model, as it enters), within ``memory`` bytes a rank (None: no cap); ``explain``: print the
    table of candidates on rank 0 of the mesh; ``hardware``: the costs to price with (a cluster's,
    ``cost.planner.Hardware``; default this machine's, ``cost.calibration.hardware``); ``measure``:
    ``step(model)``, one forward and backward of a converted model, to time the ``top`` best predicted
    candidates with and pick the fastest measured (None: the best predicted, nothing run); ``seq``:
    the length of the sequences (``tokens`` = batch × ``seq``): the model's transformer layers attend
    over them, and a mesh shape is offered only where its depth·q splits the batch; ``example``: one
    step's inputs (a tensor, a tuple of positional arguments or a dict of keyword ones, global
    shapes): each block is priced at the rows and sequence it is called with in a forward of them on
    the meta device, or once for real where the forward reads a value (``convert/auto_example.py``: a
    VLM whose LM sees fewer tokens than its encoder), in place of ``tokens`` and ``seq``; a block that
    forward does not reach keeps those."""

    tokens: int = 8192
    memory: float | None = None
    explain: bool = False
    hardware: Hardware | None = None  # the costs to price with; None: this machine's, measured (cached)
    measure: Callable[[nn.Module], object] | None = None
    top: int = 4
    seq: int = 1  # the sequence length: a layer attends over it; tokens / seq, the batch a mesh splits
    example: object = field(default=None, compare=False, repr=False)  # one step's inputs: rows per block


def _divides(sizes: list[int], ranks: int, own: int, batch: int) -> tuple[int, ...]:
    """The grid sizes q (q² dividing ``ranks``) that divide every one of ``sizes`` and whose mesh splits
    ``batch`` (over depth·q = ranks / q), and ``own`` (the model's mesh's: a block that does not fit it
    is refused there, by ``parallelize``, as without a plan)."""
    fits = {
        q
        for q in range(1, math.isqrt(ranks) + 1)
        if ranks % (q * q) == 0 and all(n % q == 0 for n in sizes) and batch % (ranks // q) == 0
    }
    return tuple(sorted(fits | {own}))


def _blocks(
    model: nn.Module, tokens: int, ranks: int, seq: int = 1, own_q: int = 1, example: object = None
) -> list[Block]:
    """The model's MLP and transformer-layer blocks, outermost first, in ``named_modules``' order;
    each of ``tokens`` rows of ``seq``, or those it sees in a forward of ``example`` (``traced_rows``)."""
    blocks = _found(model, tokens, ranks, seq, own_q)
    if example is None:
        return blocks
    widths: dict[str, int] = {}

    def note(found: tuple[Block, ...]) -> None:  # a part, a region and a part inside a region: every depth
        for b in found:
            widths[b.path] = b.hidden
            note(b.inner)

    note(tuple(blocks))
    seen = traced_rows(model, example, widths)
    return _found(model, tokens, ranks, seq, own_q, seen)


def _is_block(module: nn.Module) -> bool:
    """Whether ``module`` is what ``_found`` takes as a block below the model (an MLP, a layer)."""
    if isinstance(module, nn.TransformerEncoderLayer):
        return True
    split = split_of(module)
    return split is not None and not split.heads(module) and not split.whole


def _entangled(model: nn.Module) -> Callable[[str], bool]:
    """``at(path)``: whether the module at ``path`` shares a parameter with the model outside it (a
    table tied to a head elsewhere, or the module itself held at a second path): moved off the model's
    mesh alone, its other holder would be on another (``parallelize`` refuses it), so it is not
    offered; it stays where the model's mesh puts it."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    def at(path: str) -> bool:
        module = model.get_submodule(path)
        return any(not n.startswith(f"{path}.") for p in module.parameters() for n in names.get(id(p), ()))

    return at


def _element_size(model: nn.Module) -> int:
    """Bytes of an element of the model's floating parameters (the largest where they differ; 4
    where it has none): what its weights, gradients, moments and activations take."""
    sizes = [p.element_size() for p in model.parameters() if p.is_floating_point()]
    return max(sizes, default=4)


def _rows_seen(blocks: list[Block]) -> str:
    """Each block's path, rows and sequence, at every depth: what the plan is priced at."""
    return ";".join(f"{b.path}:{b.rows}:{b.seq}[{_rows_seen(list(b.inner))}]" for b in blocks)


def _found(model: nn.Module, tokens: int, ranks: int, seq: int, own_q: int, seen: dict | None = None) -> list[Block]:
    """``_blocks``, each at ``seen``'s (rows, seq) for its path where it has one."""
    seen = seen or {}
    blocks, inside = [], []
    trained_before = any(p.requires_grad for p in model.parameters(recurse=False))  # the model's own (a token)
    entangled = _entangled(model)
    for path, module in model.named_modules():
        if path == "" or any(path.startswith(f"{outer}.") for outer in inside):
            continue
        if entangled(path):  # stays on the model's mesh (the blocks inside it may move)
            trained_before |= any(p.requires_grad for p in module.parameters(recurse=False))
            continue
        rows, length = seen.get(path, (tokens, seq))
        if isinstance(module, nn.TransformerEncoderLayer):
            frozen = not any(p.requires_grad for p in module.parameters())
            hidden, ffn, heads = module.linear1.in_features, module.linear1.out_features, module.self_attn.num_heads
            qs = _divides([hidden, ffn, heads], ranks, own_q, rows // length)
            splits = ranks > 1 and not tensor_parallel_plan(module, path, ranks)[1]  # its heads and linears
            blocks.append(Block(path, "layer", rows, hidden, ffn, heads=heads, seq=length, frozen=frozen,
                                input_grad=trained_before, splits_1d=splits, qs=qs))  # fmt: skip
            trained_before |= not frozen
            inside.append(path)
            continue
        split = split_of(module)
        if split is None or split.heads(module) or split.whole:  # an MLP alone (not torch's decoder layer)
            trained_before |= any(p.requires_grad for p in module.parameters(recurse=False))
            continue
        linears = [module._modules[name] for name in split.roles]
        hidden = next(lin.in_features for name, lin in zip(split.roles, linears, strict=True)
                      if split.roles[name] == COLWISE)  # fmt: skip
        weights = sum(lin.in_features * lin.out_features for lin in linears)
        sizes = [n for lin in linears for n in (lin.in_features, lin.out_features)]
        frozen = not any(p.requires_grad for p in module.parameters())
        _, refused = tensor_parallel_plan(module, path, ranks)
        blocks.append(
            Block(path, "mlp", rows, hidden, weights // (2 * hidden), frozen=frozen, input_grad=trained_before,
                  seq=length, splits_1d=not refused, qs=_divides(sizes, ranks, own_q, rows // length))
        )  # fmt: skip
        trained_before |= not frozen
        inside.append(path)
    return _regions(model, _parts(model, blocks), tokens, ranks, seq, own_q, seen)


def _edges(model: nn.Module, blocks: list[Block]) -> list[Block]:
    """``blocks`` with the model's whole input and output placed, for pricing: where the model holds
    no weights of its own, a block that is its first child takes its input (``whole_in``) and one
    that is its last child gives its output (``whole_out``), as a model calls its children in the
    order it holds them (a wrapper of one module: both). Only the predictions depend on it."""
    children = [name for name, _ in model.named_children()]
    if not children or any(True for _ in model.parameters(recurse=False)):
        return blocks

    def placed(b: Block, first: bool, last: bool) -> Block:  # a part's first block takes its input, ...
        inner = tuple(placed(x, first and n == 0, last and n == len(b.inner) - 1) for n, x in enumerate(b.inner))
        return replace(b, whole_in=first, whole_out=last, inner=inner if b.kind == "part" else b.inner)

    return [placed(b, b.path == children[0], b.path == children[-1]) for b in blocks]


def _top(model: nn.Module, path: str) -> bool:
    """Whether the module at ``path`` hangs from the model itself, through lists at most (a module
    deeper may be called by its parent from outside a region: LLaVA's ``embed_tokens``)."""
    parents = path.split(".")[:-1]
    return all(isinstance(model.get_submodule(".".join(parents[: n + 1])), (nn.ModuleList, nn.ModuleDict))
               for n in range(len(parents)))  # fmt: skip


def _regions(
    model: nn.Module, blocks: list[Block], tokens: int, ranks: int, seq: int, own_q: int, seen: dict
) -> list[Block]:
    """``blocks`` with those inside a region gathered into it (in its place): a module hanging from the
    model (``_top``) that runs, holds attention Megatron's 1D split knows (``split_of`` with heads)
    and splits in 1D over ``ranks`` without a refusal. It may run whole in 1D (a LLaMA's decoder
    stack, its embedding and norms replicated, as DTensor's 1D runs it), or stay on the mesh, its
    blocks laid out alone. Priced as its attention layers (the first's sizes, its MLP's width)."""
    regions: dict[str, Block] = {}
    seen_trained = False  # a module before the region trains: its input has a gradient
    entangled = _entangled(model)
    for path, module in model.named_modules():
        if path == "" or any(path.startswith(f"{o}.") or path == o for o in regions):
            continue
        attention = [m for m in module.modules() if (split := split_of(m)) is not None and split.heads(m)]
        runs = not isinstance(module, (nn.ModuleList, nn.ModuleDict)) and _top(model, path) and not entangled(path)
        if ranks > 1 and runs and attention and not tensor_parallel_plan(module, path, ranks)[1]:
            split = split_of(attention[0])
            first = next(n for n, role in split.roles.items() if role == COLWISE)
            hidden, heads = attention[0]._modules[first].in_features, next(iter(split.heads(attention[0]).values()))
            inner = tuple(b for b in blocks if b.path.startswith(f"{path}."))
            ffn = next((b.ffn for b in inner if b.kind == "mlp"), 4 * hidden)
            frozen = not any(p.requires_grad for p in module.parameters())
            rows, length = seen.get(path, (tokens, seq))
            region = Block(path, "region", rows, hidden, ffn, heads, length, frozen, seen_trained, True, (own_q,),
                           inner, layers=len(attention))  # fmt: skip
            weights = sum(p.numel() for p in module.parameters() if p.dim() > 1)
            regions[path] = replace(region, other=max(0, weights - region.params))
            continue
        seen_trained |= any(p.requires_grad for p in module.parameters(recurse=False))
    return _gathered(blocks, regions)


def _gathered(blocks: list[Block], groups: dict[str, Block]) -> list[Block]:
    """``blocks`` with each one inside a group (path → part or region) replaced by that group, in the
    place of its first block; a group with no block inside at the end."""
    out = []
    for block in blocks:
        group = next((g for path, g in groups.items() if block.path.startswith(f"{path}.")), block)
        if group not in out:
            out.append(group)
    return out + [g for g in groups.values() if g not in out]


def _parts(model: nn.Module, blocks: list[Block]) -> list[Block]:
    """``blocks`` with those of each part gathered into it (in the first one's place): a module below
    the model that runs (not a ``ModuleList``/``ModuleDict``), holding two or more blocks of one width
    and no weights of its own but 1-D ones (norms, not priced), outermost first."""
    parts: dict[str, Block] = {}
    entangled = _entangled(model)
    for path, module in model.named_modules():
        if (
            path == ""
            or isinstance(module, (nn.ModuleList, nn.ModuleDict))
            or any(path.startswith(f"{o}.") for o in parts)
            or entangled(path)
        ):
            continue
        inner = [b for b in blocks if b.path.startswith(f"{path}.")]
        if len(inner) < 2 or len({b.hidden for b in inner}) > 1:
            continue
        theirs = {id(p) for b in inner for p in model.get_submodule(b.path).parameters()}
        if any(p.dim() > 1 and id(p) not in theirs for p in module.parameters()):
            continue
        qs = set.intersection(*(set(b.qs) for b in inner))
        parts[path] = Block(path, "part", inner[0].rows, inner[0].hidden, 0, seq=inner[0].seq,
                            frozen=all(b.frozen for b in inner),
                            input_grad=inner[0].input_grad, splits_1d=all(b.splits_1d for b in inner),
                            qs=tuple(sorted(qs)), inner=tuple(inner))  # fmt: skip
    return _gathered(blocks, parts)


def choose_plan(
    model: nn.Module, mesh: Mesh, auto: Auto | str = "auto", *, convert: Callable | None = None, io: str = "blocks"
) -> tuple[Choice, dict]:
    """(the choice with its table, the ``plan=`` that applies it) for ``model`` on ``mesh``.
    Collective over the mesh (the calibration, or its cached value, agreed from rank 0; building the
    meshes the plan names). No model is changed. ``convert``: ``parallelize``, for the copies
    ``Auto(measure=)`` times (``optimus2d.convert.choose_plan`` passes it); ``io``: how the model
    takes its inputs and gives its outputs (``parallelize(io=)``; "whole": priced at its edges,
    ``_edges``)."""
    auto = Auto() if isinstance(auto, str) and auto == "auto" else auto
    error = None
    if not isinstance(auto, Auto):
        error = TypeError(f"parallelize: plan= is a mapping, 'auto' or an Auto(...), got {auto!r}")
    elif not isinstance(auto.tokens, int) or isinstance(auto.tokens, bool) or auto.tokens < 1:
        error = ValueError(f"parallelize: Auto(tokens={auto.tokens!r}) must be a positive number of rows a step")
    elif not isinstance(auto.seq, int) or isinstance(auto.seq, bool) or not 1 <= auto.seq <= auto.tokens:
        error = ValueError(f"parallelize: Auto(seq={auto.seq!r}) must be a sequence length within tokens={auto.tokens}")
    elif auto.measure is not None and convert is None:
        error = TypeError("choose_plan: Auto(measure=) converts copies: call optimus2d.convert.choose_plan")
    elif auto.measure is not None and not callable(auto.measure):
        error = TypeError(f"parallelize: Auto(measure=) takes step(model), a function; got {auto.measure!r}")
    elif not isinstance(auto.top, int) or isinstance(auto.top, bool) or auto.top < 1:
        error = ValueError(f"parallelize: Auto(top={auto.top!r}) must be a positive number of candidates to time")
    elif auto.measure is not None and (meta := [n for n, p in model.named_parameters() if p.is_meta]):
        error = ValueError(f"parallelize: Auto(measure=) runs the model, whose parameters are on meta: {meta[:4]}"
                           " (materialize or load them first, or leave measure out)")  # fmt: skip
    blocks = []
    if error is None:  # (no communication: a forward of example= on the meta device, where given)
        try:
            blocks = _blocks(model, auto.tokens, mesh.size, auto.seq, mesh.q, auto.example)
        except (TypeError, ValueError) as err:
            error = err
    # the same request on every rank of the mesh (or the same refusal), before anything is measured or built
    if error is None:  # (a function's repr differs between ranks)
        asked = repr(replace(auto, explain=False, measure=None if auto.measure is None else "step"))
    else:
        asked = repr(auto)
    example = getattr(auto, "example", None)  # its shapes, and the rows each block saw (a value read may
    if example is not None and error is None:  # make them differ between ranks of the same shapes)
        asked += f", example={describe(example)}, rows={_rows_seen(blocks)}"
    asked += describe_io(io)  # priced at the model's edges alike on every rank
    agree(mesh, "parallelize(plan='auto')", description=asked, error=error)
    if error is not None:  # a mesh of one rank, or checks off: raised here
        raise error
    here = f"{mesh.q}×{mesh.q}×{mesh.depth}"
    if not blocks and _is_block(model):
        warnings.warn(
            f"parallelize(plan='auto'): the model itself ({type(model).__name__}) is the only MLP or layer, and "
            f"the model stays on the mesh it is given ({here}): no plan key names it; to have its layout chosen, "
            f"parallelize a module that holds it (nn.Sequential(model))",
            stacklevel=3,
        )
    if io != "blocks":  # whole, or whole with its arguments declared
        blocks = _edges(model, blocks)
    costs = auto.hardware
    if costs is None:  # this machine's, measured in fp32: priced in the model's dtype
        costs = replace(hardware(mesh), bytes_per_element=_element_size(model))
    # on a mesh with replicas (pipeline stages, copies) the model's own mesh only: 1D is refused there,
    # and another mesh shape is built by every rank of the world while the others convert other modules
    only = {here} if len(mesh.replicas) > 1 else None
    choice = choose(blocks, mesh.size, costs, memory_cap=auto.memory, layout=here, only=only)
    built = {here: mesh}
    if auto.measure is not None:
        choice = _measured(model, mesh, auto, choice, built, convert)
    if auto.explain and mesh.rank == mesh.ranks[0]:
        where = f"Mesh(q={mesh.q}, depth={mesh.depth})"
        what = f"{auto.tokens} tokens a step" if auto.example is None else "the rows each block sees in example="
        print(f"plan='auto' on {where} for {what}:\n{choice.explain()}", flush=True)
    return choice, _plan(choice.layouts, mesh, built)


def _plan(layouts: dict, mesh: Mesh, built: dict) -> dict:
    """The ``plan=`` that puts each block in its layout; the meshes it names from ``built`` (layout →
    mesh), made there once: the same layouts on every rank, so built in the same order."""
    plan = {}
    for path, layout in layouts.items():
        if layout == "1d":
            plan[path] = Megatron(mesh)
        elif layout not in built:
            q, _, depth = (int(n) for n in layout.split("×"))
            built[layout] = plan[path] = Mesh(q, depth, ranks=mesh.ranks, transport=mesh.transport, check=mesh.check)
        elif built[layout] is not mesh:
            plan[path] = built[layout]
    return plan


def _measured(model: nn.Module, mesh: Mesh, auto: Auto, choice: Choice, built: dict, convert: Callable) -> Choice:
    """``choice`` with the ``auto.top`` best predicted rows that fit, and the row that leaves every block
    on the model's mesh (no plan at all: the measured pick is never slower than that, but for noise),
    timed on deep copies of ``model``, the fastest measured picked (every rank times the same rows
    and gets the slowest rank's times)."""
    fitting = [row for row, (*_, fits) in enumerate(choice.table) if fits]
    here = f"{mesh.q}×{mesh.q}×{mesh.depth}"
    rows = fitting[: auto.top]
    rows += [r for r in fitting if all(v == here for v in choice.table[r][0].values()) and r not in rows][:1]
    measured = {}
    for row in rows:
        trial = convert(copy.deepcopy(model), mesh, plan=_plan(choice.table[row][0], mesh, built))

        def step(trial=trial):
            auto.measure(trial)
            trial.zero_grad(set_to_none=True)

        try:
            measured[row] = time_step(step, mesh)
        except watch.PeerFailedError:  # a peer's failure, already told to every rank
            raise
        except BaseException as err:
            # the peers wait in this step's collectives, on its meshes: tell them now, not at the timeout
            watch.report(err, [mesh, *built.values()])
            if hasattr(err, "add_note"):  # Python 3.11 and later
                err.add_note(f"parallelize: raised by Auto(measure=)'s step on the row {row} {choice.table[row][0]}")
            raise
        del trial
    if not measured:  # no block to lay out, or none fits
        return choice
    layouts, seconds, memory, _ = choice.table[min(measured, key=measured.get)]
    return Choice(layouts, seconds, memory, choice.table, measured)
