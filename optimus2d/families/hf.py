"""Converters for model families from other libraries, registered when a model from them is met.

Hugging Face ``transformers`` LLaMA (``LlamaForCausalLM``): its attention, MLP and decoder layers
are compositions of ``nn.Linear`` and element-wise code that reshape with ``-1`` heads, so once
their ``nn.Linear`` children are ``Linear2D`` they run on the local heads as they are; this module
adds what ``parallelize`` cannot infer: ``LlamaRMSNorm`` → ``RMSNorm2D``, the rotary embedding
(a replicated table of cos/sin per position, kept as it is) and the library's element-wise
activation modules.

GPT-2 (``GPT2LMHeadModel``): ``Conv1D`` (weights stored [in, out]) → ``TransposedLinear2D``; the
attention's fused ``c_attn`` is split per q/k/v part and its ``split_size`` set to the local width,
so its ``.split(self.split_size)`` yields this rank's heads; the tied ``lm_head`` becomes a
``TiedHead2D`` (in ``parallelize``).
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding
from optimus2d.convert.blockwise import forward_problems
from optimus2d.convert.forward_reader import draw_per_shard
from optimus2d.convert.parallelizer import Converter, keep, register_converter, register_recogniser
from optimus2d.families.vision import sum_grad_over_replicas
from optimus2d.layers import Embedding2D, Linear2D
from optimus2d.layers.base import replace_by_block
from optimus2d.layers.dropout import Dropout2D
from optimus2d.layers.linear import TransposedLinear2D

_HF_ELEMENTWISE = (
    "SiLUActivation",
    "GELUActivation",
    "NewGELUActivation",
    "FastGELUActivation",
    "QuickGELUActivation",
    "GELUTanh",
    "PytorchGELUTanh",
    "AccurateGELUActivation",
    "MishActivation",
    "LinearActivation",
    "ReLUSquaredActivation",
)


def local_heads(attn: nn.Module, name: str, mesh: Mesh) -> int:
    """The heads of ``attn`` one rank holds (its attribute ``name`` counts them all), or a refusal."""
    heads = getattr(attn, name)
    if heads % mesh.q:
        raise ValueError(f"parallelize: {type(attn).__name__} {name}={heads} is not divisible by q={mesh.q} ({mesh})")
    return heads // mesh.q


def keep_drawing_per_shard(p: str) -> Callable[[nn.Module, Mesh], nn.Module]:
    """A converter: ``keep``, for a forward that calls ``F.dropout`` itself with the probability in
    the attribute ``p``: its masks drawn per shard, and nothing drawn while that is 0 (a missing
    attribute: drawn, as it may be used)."""

    def convert(module: nn.Module, mesh: Mesh) -> nn.Module:
        keep(module, mesh)
        draw_per_shard(module, mesh, lambda m: getattr(m, p, 1.0) != 0)
        return module

    return convert


def _gpt2_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    if isinstance(attn.c_attn, TransposedLinear2D):  # converted already
        return attn
    if getattr(attn, "is_cross_attention", False) or hasattr(attn, "q_attn"):
        raise TypeError("parallelize: GPT-2 cross-attention (q_attn) is not supported")
    e = attn.embed_dim
    if attn.num_heads % mesh.q:
        raise ValueError(f"parallelize: GPT-2 num_heads={attn.num_heads} is not divisible by q={mesh.q} ({mesh})")
    attn.c_attn = TransposedLinear2D.from_serial(attn.c_attn, mesh, parts=(e, e, e))
    attn.c_proj = TransposedLinear2D.from_serial(attn.c_proj, mesh)
    attn.attn_dropout = Dropout2D(attn.attn_dropout.p, mesh=mesh)
    attn.resid_dropout = Dropout2D(attn.resid_dropout.p, mesh=mesh)
    attn.split_size = e // mesh.q  # forward splits the fused output by this: local q, k, v
    # its forward hands attn_dropout.p to the attention kernel (F.dropout, SDPA's dropout_p), not
    # calling the module: without shard_rng every rank drew the same mask for its own heads
    draw_per_shard(attn, mesh, lambda a: a.attn_dropout.p > 0)
    return attn


class ScaledEmbedding2D(Embedding2D):
    """``Embedding2D`` times a constant ``embed_scale`` (Gemma's and BART's scaled word embeddings)."""

    embed_scale: float = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale


def _scaled_embedding(module: nn.Module) -> Converter | None:
    """An ``nn.Embedding`` whose forward is ``super().forward(ids) * self.embed_scale`` (perhaps
    ``.to(dtype)``), the scale a number or a 0-d buffer that is not saved."""
    if not isinstance(module, nn.Embedding) or type(module).forward is nn.Embedding.forward:
        return None
    scale = getattr(module, "embed_scale", None)
    saved = isinstance(scale, torch.Tensor) and "embed_scale" not in module._non_persistent_buffers_set
    if not isinstance(scale, (float, int, torch.Tensor)) or saved or (isinstance(scale, torch.Tensor) and scale.dim()):
        return None
    if isinstance(scale, torch.Tensor) and scale.is_meta:  # built on meta: the number it is built from
        scalar = getattr(module, "scalar_embed_scale", None)  # (Gemma's), in the buffer's dtype
        if not isinstance(scalar, (float, int)):
            return None
        scale = torch.tensor(scalar, dtype=scale.dtype)
    body = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward))).body[0].body
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return None
    code = ast.unparse(body[0].value)
    if code not in (f"super().forward({body[0].value.left.args[0].id if _is_super_call(body[0].value) else ''}) * {s}"
                    for s in ("self.embed_scale", "self.embed_scale.to(self.weight.dtype)")):  # fmt: skip
        return None

    def convert(embedding: nn.Module, mesh: Mesh) -> nn.Module:
        out = Embedding2D.from_serial(embedding, mesh)
        out.__class__ = ScaledEmbedding2D
        out.embed_scale = float(scale)
        return out

    return convert


def _is_super_call(expr: ast.AST) -> bool:
    left = getattr(expr, "left", None)
    return (
        isinstance(expr, ast.BinOp)
        and isinstance(left, ast.Call)
        and ast.unparse(left.func) == "super().forward"
        and len(left.args) == 1
        and isinstance(left.args[0], ast.Name)
    )


def _fused_gate_up_mlp(module: nn.Module) -> Converter | None:
    """An MLP whose ``gate_up_proj`` output is ``chunk(2, dim=-1)``-ed into gate and up (Phi-3, GLM):
    split per part, the local output is [gate block | up block], so the chunk gives local halves."""
    fused, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if (
        not isinstance(fused, nn.Linear)
        or not isinstance(down, nn.Linear)
        or fused.out_features != 2 * down.in_features
    ):
        return None
    problems = forward_problems(module)
    if len(problems) != 1 or ".chunk(2, dim=-1)" not in problems[0]:
        return None

    def convert(mlp: nn.Module, mesh: Mesh) -> nn.Module:
        half = mlp.down_proj.in_features
        mlp.gate_up_proj = Linear2D.from_serial(mlp.gate_up_proj, mesh, parts=(half, half))
        return keep(mlp, mesh)

    return convert


def _fused_qkv_attention(module: nn.Module) -> Converter | None:
    """An attention whose ``qkv_proj`` output is sliced at ``config.num_attention_heads · head_dim``
    and ``num_key_value_heads · head_dim`` (Phi-3): split per part, and the instance given its own
    config and counts of local heads, its slices are the local q, k and v."""
    fused, config, head_dim = (
        getattr(module, "qkv_proj", None),
        getattr(module, "config", None),
        getattr(module, "head_dim", None),
    )
    if not isinstance(fused, nn.Linear) or config is None or not isinstance(head_dim, int):
        return None
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(module, "num_key_value_heads", None)
    if (
        not isinstance(heads, int)
        or not isinstance(kv_heads, int)
        or fused.out_features != (heads + 2 * kv_heads) * head_dim
    ):
        return None
    source = inspect.getsource(type(module).forward)
    if (
        "self.config.num_attention_heads * self.head_dim" not in source
        or "self.num_key_value_heads * self.head_dim" not in source
    ):
        return None
    if any("slices the last dim (qkv[" not in p for p in forward_problems(module)):
        return None

    def convert(attn: nn.Module, mesh: Mesh) -> nn.Module:
        counts = (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
        odd = [f"{name}={n}" for name, n in counts if n % mesh.q]
        if odd:  # each rank's block of the fused projection must hold whole heads of each part
            raise ValueError(f"its fused qkv_proj has {', '.join(odd)}, not divisible by q={mesh.q} ({mesh})")
        attn.qkv_proj = Linear2D.from_serial(
            attn.qkv_proj, mesh, parts=(heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        )
        attn.config = copy.copy(attn.config)  # this instance's own: the model's config keeps the global counts
        attn.config.num_attention_heads, attn.config.num_key_value_heads = heads // mesh.q, kv_heads // mesh.q
        attn.num_key_value_heads = kv_heads // mesh.q
        return keep(attn, mesh)

    return convert


def _per_head_parameters(module: nn.Module) -> Converter | None:
    """An attention holding, besides its children, only 1-D parameters of one entry per attention
    head (GraniteSWA's and GPT-OSS's learned sinks), whose forward the reader passes: each rank
    keeps the entries of its own heads (block j of the heads, as the projections' output block j
    holds them), their gradients summed over col and depth, where the batch is split."""
    config, own = getattr(module, "config", None), dict(module.named_parameters(recurse=False))
    heads = getattr(config, "num_attention_heads", None)
    if not own or list(module.buffers(recurse=False)) or not isinstance(heads, int):
        return None
    if not isinstance(getattr(module, "head_dim", None), int) or any(p.shape != (heads,) for p in own.values()):
        return None
    if forward_problems(module):
        return None

    def convert(attn: nn.Module, mesh: Mesh) -> nn.Module:
        if heads % mesh.q:
            raise ValueError(
                f"parallelize: {type(attn).__name__} has num_attention_heads={heads}, one {' and '.join(own)} "
                f"entry per head, not divisible by q={mesh.q} ({mesh})"
            )
        for name in own:
            sum_grad_over_replicas(replace_by_block(attn, name, Sharding((("row",),), (heads,)), mesh), mesh)
        return keep(attn, mesh)

    return convert


def register() -> None:
    """Register the Hugging Face converters (needs ``transformers``)."""

    activations = importlib.import_module("transformers.activations")
    for name in _HF_ELEMENTWISE:
        if hasattr(activations, name):
            register_converter(getattr(activations, name), keep=True)
    pytorch_utils = importlib.import_module("transformers.pytorch_utils")
    register_converter(pytorch_utils.Conv1D, TransposedLinear2D.from_serial)
    gpt2 = importlib.import_module("transformers.models.gpt2.modeling_gpt2")
    register_converter(gpt2.GPT2Attention, _gpt2_attention)
    for cls in (gpt2.GPT2Block, gpt2.GPT2Model):  # read: residuals, norms, the view back to [b, s, local h]
        register_converter(cls, keep=True)
    register_recogniser(_scaled_embedding)
    register_recogniser(_fused_gate_up_mlp)
    register_recogniser(_fused_qkv_attention)
    register_recogniser(_per_head_parameters)
