"""Peers from other libraries, built only where they are installed (``scripts/setup_peers.sh``).

All take the serial MLP ``nn.Sequential(nn.Linear(h, f), act, nn.Linear(f, h))``, copy its
weights, and run on every rank of the default process group, which must already exist
(``optimus2d.init()``). Each returns None, having imported nothing else and changed nothing,
when its library cannot be imported.

* ``megatron_1d``: megatron-core's ``ColumnParallelLinear`` → act → ``RowParallelLinear`` over all
  p ranks (1D: every rank holds the whole activation ``[b, s, h]``, and ``[b, s, f/p]`` inside).
* ``colossal_2d``: Colossal-AI's legacy ``Linear2D`` → act → ``Linear2D`` on a q×q mesh, q² = p:
  rank (i, j) holds the activation block ``[b/q, s, h/q]``.
* ``colossal_2p5d``: Colossal-AI's legacy ``Linear2p5D`` → act → ``Linear2p5D`` on depth q×q
  meshes, depth·q² = p: rank (i, j, k) holds the block ``[b/q, s, h/q]``, the same on every k.

Colossal-AI's context is a process-wide singleton: one process can build its 2D or its 2.5D
peer (any number of times), not both."""

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


_COLOSSAL_MODES = {"2d": "PARALLEL_2D_ROW", "2.5d": "PARALLEL_2P5D_XZ"}  # the last group each mode makes


def _colossal_context(mode: str, q: int, depth: int = 1) -> type:
    """Colossal-AI's legacy global context (a singleton) for ``mode`` "2d" or "2.5d" on the EXISTING world.

    ``colossalai.legacy.launch`` would call ``init_process_group`` itself (with a
    ``tcp://[host]:port`` address that needs host "::1" on Python 3.11); instead this registers
    the default group as its GLOBAL mode, as ``init_global_dist`` does after that call, and lets
    ``init_parallel_groups`` make its data/model/tensor subgroups and the mode's own (2D row and
    column; 2.5D row, column, depth and column×depth) with ``new_group`` (collective: every rank
    calls this). A context already made for the same mode, q, depth and world is reused; one made
    otherwise is a RuntimeError (the singleton, its groups and ``tensor_parallel_env`` cannot be
    rebuilt for another mode in the same process). Returns Colossal-AI's ``ParallelMode``.
    """
    from colossalai.legacy.context import ParallelMode
    from colossalai.legacy.core import global_context as gpc
    from colossalai.legacy.global_variables import tensor_parallel_env as env

    p = dist.get_world_size()
    want = (mode, q, depth, p)
    if gpc.is_initialized(ParallelMode.GLOBAL):
        dims = (env.summa_dim, 1) if env.mode == "2d" else (env.tesseract_dim, env.tesseract_dep)
        have = (env.mode, *dims, gpc.get_world_size(ParallelMode.GLOBAL))
        if have != want or not gpc.is_initialized(getattr(ParallelMode, _COLOSSAL_MODES[mode])):
            raise RuntimeError(f"Colossal-AI's context is already set up as (mode, q, depth, p) = {have}, not {want}")
        return ParallelMode
    extra = {"depth": depth} if mode == "2.5d" else {}
    gpc.load_config({"parallel": {"tensor": {"mode": mode, "size": p, **extra}}})
    rank = dist.get_rank()
    cpu_group = None if dist.get_backend() == "gloo" else dist.new_group(list(range(p)), backend="gloo")
    gpc._register_dist(rank, p, dist.group.WORLD, cpu_group, list(range(p)), ParallelMode.GLOBAL)
    gpc.add_global_rank(ParallelMode.GLOBAL, rank)
    gpc.init_parallel_groups()
    return ParallelMode


def _colossal_sizes(serial: nn.Module, x: torch.Tensor, q: int, features: int) -> None:
    """ValueError unless the batch splits into q blocks and both feature sizes into ``features``."""
    first, _, _ = _mlp_parts(serial)
    if x.shape[0] % q or first.in_features % features or first.out_features % features:
        raise ValueError(f"Colossal-AI needs batch {x.shape[0]} % {q} == 0 and h, f % {features} == 0")


def _colossal_mlp(name: str, serial: nn.Module, x: torch.Tensor, grad: torch.Tensor, q: int, kind: tuple) -> Peer:
    """The Peer of ``colossal_2d`` and ``colossal_2p5d``: two SUMMA Linears on this rank's (i, j) block.

    ``kind`` = (layer class, its layers module, row mode, column mode, bias block ``(bias, i, j)``).
    i (batch and weight-in block) is the rank's index in the column group, j (feature and
    weight-out block) in the row group, as Colossal-AI's layers take them (``row_rank``, ``col_rank``).
    While the layers are made, their module's seed context is replaced by a null one: the
    constructors switch to the TENSOR seed, whose state Colossal-AI keeps only for CUDA
    (``torch.cuda.get_rng_state``) and registers only in ``launch``. The weights are made
    uninitialised (no RNG drawn), then filled from ``serial``.
    """
    from colossalai.legacy.communication import all_gather
    from colossalai.legacy.core import global_context as gpc

    layer_cls, layers, row, col, bias_block = kind
    first, act, second = _mlp_parts(serial)
    i, j = gpc.get_local_rank(col), gpc.get_local_rank(row)

    def no_init(*args, **kwargs) -> None:
        pass

    def build(serial_linear: nn.Linear) -> nn.Module:
        has_bias = serial_linear.bias is not None
        layer = layer_cls(
            serial_linear.in_features,
            serial_linear.out_features,
            bias=has_bias,
            dtype=serial_linear.weight.dtype,
            weight_initializer=no_init,
            bias_initializer=no_init,
        )
        with torch.no_grad():
            layer.weight.copy_(serial_linear.weight.t().chunk(q, 0)[i].chunk(q, 1)[j])
            if has_bias:
                layer.bias.copy_(bias_block(serial_linear.bias, i, j))
        return layer

    saved_seed = layers.seed
    layers.seed = lambda parallel_mode: contextlib.nullcontext()
    try:
        model = nn.Sequential(build(first), copy.deepcopy(act), build(second)).to(x.device)
    finally:
        layers.seed = saved_seed

    def block(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(q, 0)[i].chunk(q, -1)[j].contiguous()

    def full(out: torch.Tensor) -> torch.Tensor:
        rows = all_gather(out.detach(), -1, row)  # [b/q, s, h]
        return all_gather(rows, 0, col).contiguous()  # [b, s, h]

    x_local, grad_local = block(x.detach()), block(grad)
    return Peer(name, model, lambda: model(x_local), lambda out: out.backward(grad_local), full)


def colossal_2d(serial: nn.Module, x: torch.Tensor, grad: torch.Tensor, q: int) -> Peer | None:
    """Colossal-AI legacy 2D (SUMMA) tensor parallelism of ``serial`` on a q×q mesh (None if not installed).

    Global: x, grad, output ``[b, s, h]``; weights ``[f, h]`` and ``[h, f]``.
    Per rank (i, j), i its index in its 2D column group and j in its 2D row group (Colossal-AI's
    ``row_rank``/``col_rank``): x, grad and output blocks ``[b/q, s, h/q]`` (batch block i, feature
    block j); Linear2D keeps the weight transposed, ``[in/q, out/q]`` (in block i, out block j), and
    a bias block ``[out/q²]`` (block i of out block j).

    At run time this sets up Colossal-AI's global context on the existing default group (see
    ``_colossal_context``) and makes the layers with a null seed context (see ``_colossal_mlp``).
    """
    try:
        with _quiet():
            from colossalai.legacy.nn.layer.parallel_2d import Linear2D

            layers = importlib.import_module("colossalai.legacy.nn.layer.parallel_2d.layers")
    except ImportError:
        return None
    if q * q != dist.get_world_size():
        raise ValueError(f"a {q}×{q} mesh needs {q * q} ranks, not {dist.get_world_size()}")
    if q < 2:  # Matmul_ABT_2D waits on the reduce it starts only for q > 1 (None.wait())
        raise ValueError("Colossal-AI's Linear2D backward fails on a 1×1 mesh")
    _colossal_sizes(serial, x, q, q * q)  # Linear2D's bias block is [out/q²]
    mode = _colossal_context("2d", q)
    kind = (Linear2D, layers, mode.PARALLEL_2D_ROW, mode.PARALLEL_2D_COL, lambda b, i, j: b.chunk(q)[j].chunk(q)[i])
    return _colossal_mlp("Colossal-AI 2D", serial, x, grad, q, kind)


def colossal_2p5d(serial: nn.Module, x: torch.Tensor, grad: torch.Tensor, q: int, depth: int) -> Peer | None:
    """Colossal-AI legacy 2.5D (Tesseract) parallelism of ``serial`` on depth q×q meshes (None if not installed).

    Global: x, grad, output ``[b, s, h]``; weights ``[f, h]`` and ``[h, f]``; depth·q² = p ranks.
    Per rank (i, j, k), i its index in its 2.5D column group, j in its row group and k in its depth
    group (global rank j + q·i + q²·k): x, grad and output blocks ``[b/q, s, h/q]`` (batch block i,
    feature block j), the same on every k, as Colossal-AI splits them (``split_batch_2p5d`` and its
    own tests split the batch over the column group only); Linear2p5D keeps the weight transposed,
    ``[in/q, out/q]`` (in block i, out block j), and a bias block ``[out/q]`` (block j), which only
    i = 0 uses (it broadcasts it down the column) and whose gradient only i = 0 gets (zeros elsewhere).
    So the d layers of the mesh compute the same thing: Colossal-AI splits no work over depth, and
    never reduces gradients over its depth group, which it makes (with column×depth) but never uses.

    At run time this sets up Colossal-AI's global context in mode "2.5d" on the existing default
    group (see ``_colossal_context``) and makes the layers with a null seed context (see
    ``_colossal_mlp``).
    """
    try:
        with _quiet():
            from colossalai.legacy.nn.layer.parallel_2p5d import Linear2p5D

            layers = importlib.import_module("colossalai.legacy.nn.layer.parallel_2p5d.layers")
    except ImportError:
        return None
    if depth < 1 or depth * q * q != dist.get_world_size():
        raise ValueError(f"depth {depth} × a {q}×{q} mesh is not the {dist.get_world_size()} ranks")
    if q < 2:  # Matmul_ATB_2p5D waits on every reduce slot, the second unused for q = 1 (None.wait())
        raise ValueError("Colossal-AI's Linear2p5D backward fails on 1×1 meshes")
    _colossal_sizes(serial, x, q, q)
    mode = _colossal_context("2.5d", q, depth)
    kind = (Linear2p5D, layers, mode.PARALLEL_2P5D_ROW, mode.PARALLEL_2P5D_COL, lambda b, i, j: b.chunk(q)[j])
    return _colossal_mlp(f"Colossal-AI 2.5D (depth {depth})", serial, x, grad, q, kind)
