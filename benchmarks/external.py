"""Peers from other libraries, built only where they are installed (``scripts/setup_peers.sh``).

Both take the serial MLP ``nn.Sequential(nn.Linear(h, f), act, nn.Linear(f, h))``, copy its
weights, and run on every rank of the default process group, which must already exist
(``optimus2d.init()``). Each returns None, having imported nothing else and changed nothing,
when its library cannot be imported.

* ``megatron_1d``: megatron-core's ``ColumnParallelLinear`` → act → ``RowParallelLinear`` over all
  p ranks (1D: every rank holds the whole activation ``[b, s, h]``, and ``[b, s, f/p]`` inside).
* ``colossal_2d``: Colossal-AI's legacy ``Linear2D`` → act → ``Linear2D`` on a q×q mesh, q² = p:
  rank (i, j) holds the activation block ``[b/q, s, h/q]``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.compare import Peer


@contextlib.contextmanager
def _quiet():
    """Both libraries warn at import about kernels that CPU runs do not use (Apex, TE, TensorNVMe)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.custom_fwd/bwd
        yield


def _mlp_parts(serial: nn.Module) -> tuple[nn.Linear, nn.Module, nn.Linear]:
    parts = list(serial.children()) if isinstance(serial, nn.Sequential) else []
    if len(parts) != 3 or not isinstance(parts[0], nn.Linear) or not isinstance(parts[2], nn.Linear):
        raise TypeError(f"expected nn.Sequential(nn.Linear, activation, nn.Linear), got {serial}")
    return parts[0], parts[1], parts[2]


class _MegatronMLP(nn.Sequential):
    """Column-parallel Linear → activation → row-parallel Linear, keys as the serial Sequential's.

    Megatron's layers return ``(output, bias)``; with ``skip_bias_add=False`` the bias is already
    added and the second item is None, so only the output goes on.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, act, fc2 = self
        return fc2(act(fc1(x)[0]))[0]


def megatron_1d(serial: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Peer | None:
    """megatron-core 1D tensor parallelism of ``serial`` over every rank (None if not installed).

    Global: x, grad, output ``[b, s, h]``; weights ``[f, h]`` and ``[h, f]``.
    Per rank r of p: x, grad and output whole ``[b, s, h]`` (replicated); first Linear's weight
    ``[f/p, h]`` and bias ``[f/p]`` (rows r·f/p ...), hidden ``[b, s, f/p]``; second Linear's
    weight ``[h, f/p]`` (columns r·f/p ...) and whole bias ``[h]``. The output is all-reduced.

    Megatron's own process-group state (``parallel_state``) is left uninitialised: both layers
    get the default group as ``tp_group``. Parameters are made on the CPU without initialisation
    (``use_cpu_initialization=True, perform_initialization=False``), so no RNG is consumed, then
    filled from ``serial`` and moved to x's device.
    """
    try:
        with _quiet():
            from megatron.core.model_parallel_config import ModelParallelConfig
            from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    except ImportError:
        return None
    first, act, second = _mlp_parts(serial)
    group = dist.group.WORLD
    p, r = dist.get_world_size(group), dist.get_rank(group)
    h, f = first.in_features, first.out_features
    config = ModelParallelConfig(
        tensor_model_parallel_size=p,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=first.weight.dtype,
    )
    common = {"config": config, "init_method": nn.init.zeros_, "tp_group": group}
    fc1 = ColumnParallelLinear(h, f, bias=first.bias is not None, gather_output=False, **common)
    fc2 = RowParallelLinear(f, h, bias=second.bias is not None, input_is_parallel=True, skip_bias_add=False, **common)
    with torch.no_grad():
        fc1.weight.copy_(first.weight.chunk(p, 0)[r])
        fc2.weight.copy_(second.weight.chunk(p, 1)[r])
        if first.bias is not None:
            fc1.bias.copy_(first.bias.chunk(p, 0)[r])
        if second.bias is not None:
            fc2.bias.copy_(second.bias)
    model = _MegatronMLP(fc1, copy.deepcopy(act), fc2).to(x.device)
    x_local = x.detach()
    return Peer(
        "megatron-core 1D",
        model,
        lambda: model(x_local),
        lambda out: out.backward(grad),
        lambda out: out,  # already whole on every rank
    )


def _colossal_context(q: int):
    """Colossal-AI's legacy global context (a singleton) with 2D groups on the EXISTING world.

    ``colossalai.legacy.launch`` would call ``init_process_group`` itself (with a
    ``tcp://[host]:port`` address that needs host "::1" on Python 3.11); instead this registers
    the default group as its GLOBAL mode, as ``init_global_dist`` does after that call, and lets
    ``init_parallel_groups`` make its data/model/tensor/2D-row/2D-column subgroups with
    ``new_group`` (collective: every rank calls this). A context already made for the same q is
    reused; one made otherwise is an error.
    """
    from colossalai.legacy.context import ParallelMode
    from colossalai.legacy.core import global_context as gpc
    from colossalai.legacy.global_variables import tensor_parallel_env as env

    p = dist.get_world_size()
    if gpc.is_initialized(ParallelMode.PARALLEL_2D_ROW):
        if env.summa_dim != q or gpc.get_world_size(ParallelMode.GLOBAL) != p:
            raise RuntimeError(f"Colossal-AI's context is already set up otherwise (summa_dim {env.summa_dim})")
        return gpc, ParallelMode
    if gpc.is_initialized(ParallelMode.GLOBAL):
        raise RuntimeError("Colossal-AI's context is already set up without 2D tensor parallelism")
    gpc.load_config({"parallel": {"tensor": {"mode": "2d", "size": p}}})
    rank = dist.get_rank()
    cpu_group = None if dist.get_backend() == "gloo" else dist.new_group(list(range(p)), backend="gloo")
    gpc._register_dist(rank, p, dist.group.WORLD, cpu_group, list(range(p)), ParallelMode.GLOBAL)
    gpc.add_global_rank(ParallelMode.GLOBAL, rank)
    gpc.init_parallel_groups()
    return gpc, ParallelMode


def colossal_2d(serial: nn.Module, x: torch.Tensor, grad: torch.Tensor, q: int) -> Peer | None:
    """Colossal-AI legacy 2D (SUMMA) tensor parallelism of ``serial`` on a q×q mesh (None if not installed).

    Global: x, grad, output ``[b, s, h]``; weights ``[f, h]`` and ``[h, f]``.
    Per rank (i, j), i its index in its 2D column group and j in its 2D row group (Colossal-AI's
    ``row_rank``/``col_rank``): x, grad and output blocks ``[b/q, s, h/q]`` (batch block i, feature
    block j); Linear2D keeps the weight transposed, ``[in/q, out/q]`` (in block i, out block j), and
    a bias block ``[out/q²]`` (block i of out block j).

    At run time this sets up Colossal-AI's global context on the existing default group (see
    ``_colossal_context``) and, while the layers are made, replaces their module's seed context by
    a null one: Linear2D's constructor switches to the TENSOR seed, whose state Colossal-AI keeps
    only for CUDA (``torch.cuda.get_rng_state``) and registers only in ``launch``. The weights are
    made uninitialised (no RNG drawn), then filled from ``serial``.
    """
    try:
        with _quiet():
            from colossalai.legacy.communication import all_gather
            from colossalai.legacy.nn.layer.parallel_2d import Linear2D

            layers_2d = importlib.import_module("colossalai.legacy.nn.layer.parallel_2d.layers")
    except ImportError:
        return None
    if q * q != dist.get_world_size():
        raise ValueError(f"a {q}×{q} mesh needs {q * q} ranks, not {dist.get_world_size()}")
    if q < 2:  # Matmul_ABT_2D waits on the reduce it starts only for q > 1 (None.wait())
        raise ValueError("Colossal-AI's Linear2D backward fails on a 1×1 mesh")
    first, act, second = _mlp_parts(serial)
    gpc, mode = _colossal_context(q)
    i, j = gpc.get_local_rank(mode.PARALLEL_2D_COL), gpc.get_local_rank(mode.PARALLEL_2D_ROW)

    def no_init(*args, **kwargs) -> None:
        pass

    def build(serial_linear: nn.Linear) -> nn.Module:
        layer = Linear2D(
            serial_linear.in_features,
            serial_linear.out_features,
            bias=serial_linear.bias is not None,
            dtype=serial_linear.weight.dtype,
            weight_initializer=no_init,
            bias_initializer=no_init,
        )
        with torch.no_grad():
            layer.weight.copy_(serial_linear.weight.t().chunk(q, 0)[i].chunk(q, 1)[j])
            if serial_linear.bias is not None:
                layer.bias.copy_(serial_linear.bias.chunk(q, 0)[j].chunk(q, 0)[i])
        return layer

    saved_seed = layers_2d.seed
    layers_2d.seed = lambda parallel_mode: contextlib.nullcontext()
    try:
        model = nn.Sequential(build(first), copy.deepcopy(act), build(second)).to(x.device)
    finally:
        layers_2d.seed = saved_seed

    def block(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(q, 0)[i].chunk(q, -1)[j].contiguous()

    def full(out: torch.Tensor) -> torch.Tensor:
        rows = all_gather(out.detach(), -1, mode.PARALLEL_2D_ROW)  # [b/q, s, h]
        return all_gather(rows, 0, mode.PARALLEL_2D_COL).contiguous()  # [b, s, h]

    x_local, grad_local = block(x.detach()), block(grad)
    return Peer(
        "Colossal-AI 2D",
        model,
        lambda: model(x_local),
        lambda out: out.backward(grad_local),
        full,
    )
