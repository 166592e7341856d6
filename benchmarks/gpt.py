"""A GPT trained on next-token loss: transformers' ``GPT2LMHeadModel`` (tied head) or
``LlamaForCausalLM`` (RMSNorm, rotary, SwiGLU), optimus2d against torch on one rank, and for
LLaMA against DTensor 1D under the model's own tensor-parallel plan (``base_model_tp_plan``).

    mpiexec -n 4 python -m benchmarks gpt                  # GPT-2: 4 layers, h=256, 8 heads, vocab 1024, 8 × 128
    mpiexec -n 4 python -m benchmarks gpt --model llama    # the same sizes, ffn 4h, with a 1D peer

``optimus2d.parallelize`` converts the model; its loss is ``optimus2d.cross_entropy`` on the
sharded logits. GPT-2's ``Conv1D`` layers have no DTensor plan (``ColwiseParallel`` takes
``nn.Linear`` only and transformers ships none for GPT-2), hence LLaMA for the 1D comparison; its
1D peer keeps the embedding, final norm and head replicated, as that plan does. Reported as for
``mlp``, with tokens/s of a whole training step's fwd+bwd.

The row "…, plain blocks" is the same conversion with its last pass left out, the blocks plain
tensors as before parameters became DTensors (``convert/dtensor_params.py``): what that pass costs,
in the same run. There is no public switch for it, so this row alone reaches inside the library.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import optimus2d
from benchmarks import compare
from benchmarks.compare import Peer
from optimus2d.convert import parallelizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    compare.add_run_arguments(parser)


def _plain_blocks(serial, mesh: optimus2d.Mesh):
    """``parallelize`` without its last pass: the blocks stay plain tensors (see the docstring)."""
    real = parallelizer.distribute_parameters
    parallelizer.distribute_parameters = lambda model, *_: model
    try:
        return optimus2d.parallelize(copy.deepcopy(serial), mesh)
    finally:
        parallelizer.distribute_parameters = real


def _serial_loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _model(args: argparse.Namespace):
    import transformers

    if args.model == "llama":
        config = transformers.LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            max_position_embeddings=args.seq,
            attn_implementation="sdpa",
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.seq,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def step_flops(args: argparse.Namespace) -> float:
    """Matmul flops of a training step's fwd+bwd: every layer (``Layer.flops``, with LLaMA's third
    feed-forward matrix, the gate), then the head over the vocabulary; attention counted whole,
    as MFU figures count it, though a causal kernel skips half."""
    from optimus2d.cost.planner import Layer

    rows, h = args.batch * args.seq, args.hidden
    gate = 6.0 * rows * h * 4 * h if args.model == "llama" else 0.0
    return args.layers * (Layer(args.batch, args.seq, h, 4 * h).flops + gate) + 6.0 * rows * h * args.vocab


def _dtensor_1d(serial, ids: torch.Tensor) -> Peer:
    """The model under its own tensor-parallel plan on a 1D mesh of every rank (the full batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in serial.config.base_model_tp_plan.items()}
    model = copy.deepcopy(serial)
    parallelize_module(model.model, init_device_mesh(ids.device.type, (dist.get_world_size(),)), plan)
    return Peer("DTensor 1D", model, lambda: _serial_loss(model, ids), lambda loss: loss.backward(), lambda x: x)


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    p, device = world.size, mesh.device
    torch.manual_seed(0)
    dtype = compare.dtype(args)
    serial = _model(args).to(device, dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    with torch.no_grad():
        reference = _serial_loss(serial, ids)

    name = f"optimus2d {'2D' if mesh.depth == 1 else '2.5D'}"
    parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    ids_local = optimus2d.scatter_batch(ids, mesh)

    def loss_of(model):
        logits = model(input_ids=ids_local, use_cache=False).logits
        return optimus2d.cross_entropy(logits[:, :-1], ids_local[:, 1:], mesh)

    parallel_loss = functools.partial(loss_of, parallel)
    twin = copy.deepcopy(serial)
    group = [Peer(name, parallel, parallel_loss, lambda loss: loss.backward(), lambda loss: loss)]
    if p > 1:
        plain = _plain_blocks(serial, mesh)
        plain_loss = functools.partial(loss_of, plain)
        group.append(Peer(f"{name}, plain blocks", plain, plain_loss, lambda loss: loss.backward(), lambda loss: loss))
    if p > 1:  # the planner's pick: LLaMA's decoder stack whole in 1D, or each MLP laid out alone; GPT-2's stay
        auto_plan = optimus2d.Auto(tokens=args.batch * args.seq, seq=args.seq, memory=args.cap_mib * 2**20)
        timed = dataclasses.replace(auto_plan, measure=lambda model: loss_of(model).backward(), top=4)
        for label, asked in (("optimus2d auto", auto_plan), ("optimus2d auto, measured", timed)):
            choice, plan = optimus2d.convert.choose_plan(serial, mesh, asked)
            auto = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=plan)
            group.append(Peer(label, auto, functools.partial(loss_of, auto), lambda loss: loss.backward(),
                              lambda loss: loss, extra={"layouts": choice.layouts}))  # fmt: skip
    if args.model == "llama" and p > 1:
        group.append(_dtensor_1d(serial, ids))
    group.append(
        Peer("torch, 1 rank", twin, lambda: _serial_loss(twin, ids), lambda loss: loss.backward(), lambda x: x, True)
    )
    compare.check(group, reference, tol=1e-5 if dtype == torch.float32 else None)
    with optimus2d.count_comm() as counter:
        parallel_loss().backward()
    parallel.zero_grad(set_to_none=True)
    tokens = args.batch * args.seq
    what = f"{'LLaMA' if args.model == 'llama' else 'GPT-2'} {args.layers}×{args.hidden}, vocab {args.vocab}"
    what += "" if dtype == torch.float32 else f", {args.dtype}"
    compare.time_rounds(group, args.rounds, device, what)
    results = compare.summarize(group, tokens, args.batch, args.cap_mib, step_flops(args))
    results[0]["elements_measured"] = counter.numel
    _auto_largest_batch(results, serial, mesh, args)
    serial_act = results[-1]["activation_bytes"]  # measured by rank 0, which reports
    if world.rank == 0:
        compare.print_table(compare.title(what + ", loss fwd+bwd", args, mesh), results, serial_act, p)
        print(f"elements sent by rank 0 per training step: {counter.numel:,}")
        rows = {r["peer"]: r for r in results}
        if "optimus2d auto" in rows and "DTensor 1D" in rows:
            ratio = rows["optimus2d auto"]["train_ms"] / rows["DTensor 1D"]["train_ms"]
            largest = rows["optimus2d auto"]["largest_batch"]
            timed = rows.get("optimus2d auto, measured")
            if timed:
                chosen = ", ".join(f"{k}: {v}" for k, v in timed["layouts"].items())
                ratio_timed = timed["train_ms"] / rows["DTensor 1D"]["train_ms"]
                print(f"optimus2d auto, measured ({chosen}): fwd+bwd {ratio_timed:.3f} × DTensor 1D's")
            picked = ", ".join(f"{k}: {v}" for k, v in rows["optimus2d auto"]["layouts"].items())
            inferred = " (inferred: the layout it picks when asked for it)" if rows["optimus2d auto"].get(
                "largest_batch_inferred") else ""  # fmt: skip
            print(f"optimus2d auto ({picked}): fwd+bwd {ratio:.3f} × DTensor 1D's; largest batch {largest}{inferred} "
                  f"(optimus2d 2D: {results[0]['largest_batch']})")  # fmt: skip
    return compare.result(args, mesh, serial_act, results)


def _auto_largest_batch(results: list[dict], serial: nn.Module, mesh: optimus2d.Mesh, args) -> None:
    """The auto row's largest batch: the planner re-plans for each batch, so asked for the 2D layout's
    largest batch within the cap it holds that batch where it then leaves every module on the mesh
    (the 2D row's layout, measured here). Collective."""
    rows = {r["peer"]: r for r in results}
    if "optimus2d auto" not in rows:
        return
    sizes = [results[0]["largest_batch"]]
    dist.broadcast_object_list(sizes, src=0)  # rank 0's figures (the report's): every rank plans alike
    here, b = f"{mesh.q}×{mesh.q}×{mesh.depth}", sizes[0]
    auto = optimus2d.Auto(tokens=max(b, 1) * args.seq, seq=args.seq, memory=args.cap_mib * 2**20)
    choice, _ = optimus2d.convert.choose_plan(serial, mesh, auto)
    held = b if b > 0 and all(layout == here for layout in choice.layouts.values()) else 0
    rows["optimus2d auto"]["largest_batch_inferred"] = held > rows["optimus2d auto"]["largest_batch"]
    rows["optimus2d auto"]["largest_batch"] = max(held, rows["optimus2d auto"]["largest_batch"])
