"""``Megatron(mesh)``: a ``parallelize`` plan value that runs one module with Megatron's 1D tensor
parallelism over the mesh's ranks, on torch's own ``parallelize_module``.

``parallelize(model, mesh, plan={"model.vision_tower": Megatron(mesh)})`` leaves the named module's
classes as they are and hands torch a plan (``megatron/plans.py``): the linears of known attention
and MLP modules split by column (``ColwiseParallel``: ``[out/p, in]``, bias ``[out/p]``) then by row
(``RowwiseParallel``: ``[out, in/p]``, one all-reduce of the output forward, none backward), on a
1D ``DeviceMesh`` over the mesh's "mesh" process group (``DeviceMesh.from_group``: no new group).
torch's ``nn.MultiheadAttention``, whose packed q/k/v projection torch cannot split, becomes a
``megatron.attention.SplitMultiheadAttention`` (its heads split over the ranks, one all-reduce
forward). Everything else inside (norms, embeddings, rotary tables, the convolution of a patch
embedding) runs whole on every rank on the whole activation. So inside the module each rank holds the whole
activation and the gradient of every whole tensor is the same on every rank.

At its boundary (``convert/layouts.py``'s ``WholeBoundary``) a block of the caller's mesh becomes the
whole tensor (``comm.whole.to_whole``: all-gather forward, nothing backward) and the module's
outputs become blocks of the caller's mesh again (``from_whole``: nothing forward, all-gather of
the gradient backward). A frozen module's input needs no gradient: nothing is sent backward.

Parameters: a split linear's weight and bias are torch's DTensors (``Shard``/``Replicate`` on the 1D
DeviceMesh); the others stay plain tensors, and ``parallelize`` makes them ``Replicate`` DTensors
on the model mesh's DeviceMesh like every replicated parameter: their gradient is already the
whole one on every rank. Data-parallel replicas of the 1D module (TP × DP) are not built here.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from optimus2d.comm.dtensor import own_part
from optimus2d.comm.mesh import Mesh, as_mesh
from optimus2d.layers.block import nested_padding
from optimus2d.megatron import attention
from optimus2d.megatron.plans import COLWISE, tensor_parallel_plan

REGION = "_optimus2d_megatron"  # a module's __dict__ key: the Megatron plan value it runs under
SPLIT = "_optimus2d_megatron_split"  # a linear's __dict__ key: split by parallelize_module


class Megatron:
    """A plan value: the module runs with 1D tensor parallelism over all ``mesh.size`` ranks of
    ``mesh`` (a ``Mesh`` over the model's ranks; its shape does not matter, only its ranks)."""

    def __init__(self, mesh: Mesh | DeviceMesh) -> None:
        if not isinstance(mesh, (Mesh, DeviceMesh)):
            raise TypeError(f"Megatron(mesh): expected an optimus2d Mesh or a DeviceMesh, got {type(mesh).__name__}")
        self.mesh = as_mesh(mesh, "Megatron's mesh")
        self._device_mesh: DeviceMesh | None = None

    def __repr__(self) -> str:
        return f"Megatron(ranks={list(self.mesh.ranks)})"

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 1D DeviceMesh ("tp") over the mesh's ranks, on the mesh's own process group."""
        if self._device_mesh is None:
            group = self.mesh.group("mesh")
            self._device_mesh = DeviceMesh.from_group(group, self.mesh.device.type, mesh_dim_names=("tp",))
        return self._device_mesh

    def refusals(self, module: nn.Module, path: str) -> list[str]:
        """Why ``module`` (at ``path``) cannot run split over the ranks: one line per offender."""
        return tensor_parallel_plan(module, path, self.mesh.size)[1]

    def apply(self, module: nn.Module, path: str) -> nn.Module:
        """``module`` split in place by ``parallelize_module`` (nothing sent: every rank holds the
        serial weights and keeps its own shard, ``src_data_rank=None``)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        roles, refused = tensor_parallel_plan(module, path, self.mesh.size)
        if refused:
            raise ValueError("parallelize: 1D tensor parallelism refuses:\n  " + "\n  ".join(refused))
        if attention.splits(module):  # the region is one nn.MultiheadAttention: split by heads itself
            module = attention.SplitMultiheadAttention.from_serial(module, self.mesh)
        else:
            attention.split_attention(module, self.mesh)
        for sub in module.modules():
            if type(sub) is nn.TransformerEncoder:  # its nested-tensor path, run dense
                sub.__class__ = DenseNestedEncoder
        module.__dict__[REGION] = self
        _guard(module, path)
        if self.mesh.size == 1 or not roles:
            return module
        styles = {name: ColwiseParallel() if role == COLWISE else RowwiseParallel() for name, role in roles.items()}
        parallelize_module(module, self.device_mesh, styles, src_data_rank=None)
        for name in roles:
            linear = module.get_submodule(name)
            linear.__dict__[SPLIT] = self
            linear.register_load_state_dict_pre_hook(_own_part_of_serial)
        return module


class DenseNestedEncoder(nn.TransformerEncoder):
    """torch's ``nn.TransformerEncoder`` inside a 1D region. Where torch's runs its layers on a nested
    tensor (in eval, without grad, given a padding mask: ``layers.block.nested_padding``; torch sees
    no DTensor parameter, which dispatch alone handles), the split attention cannot take one: the
    layers run on the dense tensor, each sample's padding "past its first n tokens", and the
    output is zero past them before the norm, as torch's nested tensor returns it padded. Elsewhere
    torch's own forward."""

    def forward(
        self,
        src: torch.Tensor,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> torch.Tensor:
        kwargs = {"src_mask": mask, "src_key_padding_mask": src_key_padding_mask}
        past = nested_padding(self.layers[0], src, kwargs, self.mask_check) if self.use_nested_tensor else None
        if past is None:
            return super().forward(src, mask, src_key_padding_mask, is_causal)
        layer_kwargs = {"src_key_padding_mask": past}  # torch's fast path on a nested tensor ignores is_causal
        output = src
        for layer in self.layers:
            output = layer(output, **layer_kwargs)
        output = output.masked_fill(past[..., None], 0.0)
        return self.norm(output) if self.norm is not None else output


class _Inside:
    """How many calls of a 1D region's forward are running (its modules run only inside one)."""

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        self.depth -= 1


def _guard(region: nn.Module, path: str) -> None:
    """Refuse, when it happens, a module of the region called by a forward outside the region (LLaVA
    calls its language model's ``embed_tokens`` itself): its inputs there are blocks of the caller's
    mesh, not the whole tensors the region runs on, and a replicated module would not know. A
    recomputation in backward (activation checkpointing) runs inside no forward: allowed."""
    inside = _Inside()
    region.register_forward_pre_hook(inside.enter, prepend=True)
    region.register_forward_hook(inside.leave, always_call=True)
    for rel, sub in region.named_modules():
        if rel:
            sub.register_forward_pre_hook(functools.partial(_check_inside, inside, f"{path}.{rel}", path))


def _check_inside(inside: _Inside, where: str, region: str, module: nn.Module, args: tuple) -> None:
    if inside.depth == 0 and torch._C._current_graph_task_id() == -1:
        raise ValueError(
            f"parallelize: {where} ({type(module).__name__}) is inside the 1D region {region} but is called from "
            f"outside it (by another module's forward): there its inputs are blocks of the caller's mesh, not the "
            f"whole tensors it runs on. Plan a module that holds what calls it (for LLaVA: 'model', not "
            f"'model.language_model', whose embed_tokens LLaVA calls itself)"
        )


def _own_part_of_serial(module: nn.Module, state: dict, prefix: str, *_) -> None:
    """``load_state_dict`` of a split linear given the serial tensor (as every optimus2d module takes
    it): this rank's part of it, as a DTensor of the parameter's placements (nothing sent)."""
    for name, t in module._parameters.items():
        value = state.get(prefix + name)
        if isinstance(t, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) == tuple(t.shape):
                state[prefix + name] = DTensor.from_local(
                    own_part(t, value), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
                )


def runs_split(module: nn.Module) -> bool:
    """Whether ``module`` is a linear that 1D tensor parallelism split (its parameters are torch's
    DTensors and its forward takes whole tensors: nothing else must shadow them)."""
    return SPLIT in module.__dict__
