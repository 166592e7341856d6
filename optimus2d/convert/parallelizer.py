"""parallelize(): a serial torch model → the same model on the mesh, weights and all.

Every submodule is replaced by its 2D twin (``from_serial``) through a registry of converters;
element-wise modules stay as they are; a module that holds parameters (or a leaf that is not
element-wise) and has no converter is refused with its path in the model, never silently left
serial. Like torch's ``parallelize_module``, the conversion happens in place.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from optimus2d.comm.agreement import check_same_tensors
from optimus2d.comm.dtensor import DIM_NAMES
from optimus2d.comm.mesh import Mesh, as_mesh
from optimus2d.context.parallel import ContextParallel
from optimus2d.convert import auto as auto_plan
from optimus2d.convert import layouts
from optimus2d.convert.auto import Auto
from optimus2d.convert.dtensor_params import distribute_parameters
from optimus2d.convert.instance_forward import SetAside, refusals, set_aside_hub_kernels
from optimus2d.convert.meta_init import has_meta, record_init
from optimus2d.convert.registry import (
    _LIBRARIES,
    ELEMENTWISE,
    Converter,
    converter_for,
    register_library,
    register_recogniser,
)
from optimus2d.convert.settings import agree_settings
from optimus2d.convert.tied import guard_optimizers, guard_outside, held_outside, tied_embeddings
from optimus2d.convert.walk import _current, _rehearse, _Walk, convert_children, keep, register_converter
from optimus2d.convert.whole_io import WholeIO, io_refusal
from optimus2d.cost.auto import Choice
from optimus2d.layers.base import ShardedModule
from optimus2d.megatron.region import Megatron

# the registry's API, as converters have always imported it from here
__all__ = [
    "ELEMENTWISE",
    "Converter",
    "choose_plan",
    "convert_children",
    "converter_for",
    "keep",
    "keep_modes",
    "parallelize",
    "register_converter",
    "register_library",
    "register_recogniser",
]


def parallelize(
    module: nn.Module,
    mesh: Mesh,
    *,
    plan: Mapping[str, Mesh | ContextParallel | Megatron] | str | Auto | None = None,
    check: bool | None = None,
    io: str | Mapping[str, str] = "blocks",
) -> nn.Module:
    """The model on ``mesh``, converted in place from the serial ``module`` and returned.

    The result takes ``optimus2d.scatter``-ed activations (and ``scatter_batch``-ed ids) and gives
    this rank's blocks; with ``io="whole"`` it takes every tensor whole, the same on every rank, and
    gives its outputs whole (``convert/whole_io.py``: a model that is one 1D region then sends what
    torch's ``parallelize_module`` sends); ``io={name: "batch" | "activation" | "whole"}`` is "whole" with
    those arguments declared (a floating ``[b, s]`` value a token, say, which its shape cannot tell
    from an activation ``[b, h]``). ``serial_state_dict`` of it has ``module``'s keys and
    values. A module used twice is converted once; an ``nn.Linear`` sharing an ``nn.Embedding``'s
    weight (a tied head) becomes a ``TiedHead2D`` on the same Parameter. The whole model is checked
    before anything is changed: ``TypeError`` names the first submodule that cannot be converted, or
    a parameter shared in a way that cannot be kept. Every rank must hold the same serial weights
    (as torch's ``distribute_tensor`` assumes): their checksums are compared over the mesh and the
    weights that differ are named in a ``ValueError`` on every rank (``check=False``, or a mesh
    built with ``check="off"``, skips this one all-gather). Every module is judged by its class's
    forward: a hub kernel ``kernels`` put on an instance (transformers ≥ 5.25's ``from_pretrained``
    on a GPU) is set aside first (and put back if the model is refused), any other forward assigned
    to an instance, anywhere in the model, is refused (``convert/instance_forward.py``).

    ``mesh`` (and a plan's meshes) may be torch's ``DeviceMesh`` with dims named "depth", "row" and
    "col" (``Mesh.from_device_mesh``; any other dims are data-parallel replicas).

    ``plan``: module path (exact, or a glob) → a ``Mesh`` over the same ranks, on which that module
    and everything inside it is converted and runs; tensors crossing its boundary move between the
    meshes' layouts by ``redistribute`` (``optimus2d/layouts.py``). A key naming no module is refused.
    A ``context.ContextParallel(mesh, ...)`` value converts the module on its mesh and runs it with
    its sequence split over the mesh's depth axis (context parallelism; ``context/parallel.py``).
    A ``megatron.Megatron(mesh)`` value runs the module with Megatron's 1D tensor parallelism over
    the mesh's ranks, split by torch's ``parallelize_module`` (``megatron/region.py``).
    ``plan="auto"`` (or ``convert.auto.Auto(tokens=, memory=, explain=)``): each MLP of the model on
    the layout of least predicted step time on this machine (``convert/auto.py``; collective).
    """
    whole = mesh if isinstance(mesh, DeviceMesh) and tuple(mesh.mesh_dim_names or ()) != DIM_NAMES else None
    mesh = as_mesh(mesh, "parallelize's mesh")  # a torch DeviceMesh: its Mesh (collective, every rank alike)
    # every module on its class's forward, the one judged; put back if the model is refused (instance_forward.py)
    aside = set_aside_hub_kernels(module) if _current.get() is None else SetAside()
    try:
        plan, walk, records = _checked(module, mesh, plan, check, io, whole)
    except BaseException:
        aside.put_back()
        raise
    modes = {path: m.training for path, m in module.named_modules()} if _current.get() is None else None
    token = _current.set(walk)
    try:
        out = walk.convert(module, "")
    finally:
        _current.reset(token)
    if modes is not None:
        keep_modes(out, modes)
    guard_outside(walk.outside, module, mesh)  # modules outside it that held its serial parameters
    if _current.get() is None:
        for _, (register, finish) in sorted(_LIBRARIES.items()):
            if register is None and finish is not None:  # a library whose modules were met
                finish(out, mesh)
        distribute_parameters(out, mesh, whole)  # every parameter a DTensor: torch's tools see serial tensors
        guard_optimizers(walk.outside, module, out, mesh)  # optimizers built before: they hold serial tensors
        if io != "blocks":  # whole tensors in and out (its 1D regions' boundaries keep their whole outputs)
            hooks = WholeIO(mesh, [mesh, *walk.plan.values()], io if isinstance(io, Mapping) else None)
            hooks.install(out)
            for boundary in walk.boundaries.values():
                if isinstance(boundary, layouts.WholeBoundary):
                    boundary.io = hooks
        if walk.boundaries and not isinstance(out, ShardedModule):  # what is moved when read leaves moved
            out.register_forward_hook(layouts.moved_whole)
    if records is not None:
        out._optimus2d_init = records
    return out


def _checked(
    module: nn.Module, mesh: Mesh, plan, check: bool | None, io: str, whole
) -> tuple[dict, _Walk, dict | None]:
    """``parallelize``'s checks, before anything changes: (the plan, its walk, the init records of a
    model on meta). Raises the refusal, the same on every rank."""
    if isinstance(plan, (str, Auto)) and io_refusal(io) is None:  # "auto": the plan of least predicted cost
        plan = choose_plan(module, mesh, plan, io=io)[1]  # (collective over the mesh)
    if isinstance(plan, Mapping):
        plan = {key: as_mesh(value) if isinstance(value, DeviceMesh) else value for key, value in plan.items()}
    # Checked on this rank (no communication), then agreed with every rank before anything is sent:
    # the plan (its keys and meshes) and any refusal, so a plan or a model that differs on one rank
    # is one error on every rank, not a rank left waiting for the others (layouts.agree_plan)
    error, walk = None, None
    try:
        if (refused := io_refusal(io)) is not None:
            raise refused
        outside = held_outside(module) if _current.get() is None else []  # before Tied holds the parameters
        walk = _Walk(mesh, {}, tied_embeddings(module), plan=layouts.check_plan(plan, mesh))
        walk.outside = outside
        if whole is not None:
            _one_mesh_with_replicas(plan, mesh)
        walk.contexts = layouts.context_plan(plan)
        walk.megatron = layouts.megatron_plan(plan)
        walk.check(module, "")
        if _current.get() is None:  # a forward set on an instance wherever it is, inside converted modules too
            walk.refused += [r for r in refusals(module) if r not in walk.refused]
        walk.check_region_aliases(module)
        walk.aliased = layouts.mesh_aliases(module, walk.plan, mesh, regions=walk.megatron)
        walk.raise_refused()
        if _current.get() is None:
            _rehearse(module, mesh, walk)
    except (TypeError, ValueError) as err:
        error = err
    if _current.get() is None:  # a converter's own parallelize() of a part: the whole was agreed
        layouts.agree_plan(mesh, plan, error, check, io)
    if error is not None:
        raise error
    # Built on meta: note now how the serial model initialises each tensor (materialize replays it)
    records = record_init(module) if _current.get() is None and has_meta(module) else None
    if _current.get() is None:  # a converter's own parallelize() of a part: the whole was checked
        named = [*module.named_parameters(remove_duplicate=True), *module.named_buffers(remove_duplicate=True)]
        # blocks of a part converted already differ by rank: only the serial tensors must agree
        tensors = [(name, t) for name, t in named if getattr(t, "_optimus2d_mesh", None) is None]
        check_same_tensors(mesh, "parallelize: the serial weights", tensors, check)
        agree_settings(mesh, module, check)  # and what each module is set to: one rank's nhead, eps, activation
    return plan, walk, records


def _one_mesh_with_replicas(plan, mesh: Mesh) -> None:
    """Given a DeviceMesh with data-parallel dims, every parameter becomes a DTensor on all of it:
    a module planned onto another mesh could not be, so such a plan is refused (before anything)."""
    on = {key: value if isinstance(value, Mesh) else value.mesh for key, value in (plan or {}).items()}
    others = sorted(key for key, value in on.items() if value is not mesh or isinstance(plan[key], Megatron))
    if others:
        raise ValueError(
            f"parallelize: given a DeviceMesh with data-parallel dims, every parameter becomes a DTensor on it, but "
            f"the plan puts {', '.join(map(repr, others))} on another mesh than {mesh}; give parallelize the mesh of "
            f"one replica (Mesh.from_device_mesh(dm['depth', 'row', 'col'])) to keep plain blocks per replica"
        )


def keep_modes(model: nn.Module, modes: dict[str, bool]) -> None:
    """Give every module of the converted ``model`` the train/eval mode of the serial module at its
    path, or of its nearest ancestor that had one (a module a converter made): a model converted in
    eval mode stays in eval mode (no dropout), as ``copy.deepcopy`` would keep it."""
    for path, m in model.named_modules():
        at = path
        while at not in modes and at:
            at = at.rpartition(".")[0]
        m.training = modes.get(at, m.training)


def choose_plan(model: nn.Module, mesh: Mesh, auto: Auto | str = "auto", *, io: str = "blocks") -> tuple[Choice, dict]:
    """``plan="auto"``'s (choice with its table, ``plan=``) for ``model`` on ``mesh``, nothing converted
    (``convert.auto.choose_plan``; the copies ``Auto(measure=)`` times are converted by ``parallelize``
    with ``io=``, so its step takes what the model will)."""
    return auto_plan.choose_plan(model, mesh, auto, convert=functools.partial(parallelize, io=io), io=io)
