"""The layouts ``python -m benchmarks long`` trains a LLaMA-shaped decoder with a long sequence in:
three on the same p ranks, with the same model (transformers' ``LlamaForCausalLM``
from a small random ``LlamaConfig``, fp32, causal) and the same global batch (p samples by default):

* "2D + CP": ``Mesh(q, depth=c)``, q²·c = p (q: ``--q``, default the smallest q > 1 whose square
  divides p; c = 1 is 2D alone), the model through ``optimus2d.parallelize(model, mesh,
  plan={"model": context.ContextParallel(mesh)})``, ids and labels through ``optimus2d.scatter_batch``,
  the loss from ``labels=``;
* "CP alone": the same on ``Mesh(1, depth=p)`` (attention "auto": the all-gather of K/V, as the cost
  model picks with no memory bound), and "CP alone, ring" (K/V passed round the depth ring; ``--no-ring``
  leaves it out);
* "DTensor 1D + SP": torch's tensor parallelism on a 1D ``DeviceMesh`` of the p ranks, torchtitan's
  LLaMA plan on transformers' modules (``parallelize_module``): the embedding row-parallel into
  sequence shards; per layer the norms ``SequenceParallel``, q/k/v and gate/up column-parallel
  behind a ``PrepareModuleInput`` that gathers the sequence, o and down row-parallel back into
  sequence shards; the final norm ``SequenceParallel``; the head column-parallel, logits split over
  the vocabulary, the loss ``F.cross_entropy`` under ``loss_parallel`` (HF's ``labels=`` cannot take
  DTensor logits); position ids given (the body would number the sequence shard alone); attention
  is HF's SDPA with ``is_causal`` (no mask tensor).
The losses of each one's first two steps (weights drawn with std 0.3, so that they depend on the attention)
must agree to 1e-5.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import optimus2d
from optimus2d import context


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (a LLaMA decoder, three layouts)")
    group.add_argument("--skip-train", action="store_true", help="the balance table only")
    group.add_argument("--no-ring", action="store_true", help="leave out CP alone with ring attention")
    group.add_argument("--layers", type=int, default=2)
    group.add_argument("--hidden", type=int, default=128)
    group.add_argument("--heads", type=int, default=8)
    group.add_argument("--ffn", type=int, default=None, help="default 3 × hidden")
    group.add_argument("--vocab", type=int, default=1024)
    group.add_argument("--train-batch", type=int, default=None, help="global; default the number of ranks")
    group.add_argument("--train-seq", type=int, default=2048, help="the sequence of the timed step")
    group.add_argument("--rounds", type=int, default=3)
    group.add_argument("--q", type=int, default=None, help="2D + CP's q (default the smallest q > 1, q² | p)")
    group.add_argument("--memory-cap-mb", type=float, default=160.0, help="per rank, MiB")
    group.add_argument("--start-seq", type=int, default=512)
    group.add_argument("--max-seq", type=int, default=16384)
    group.add_argument("--bisect", type=int, default=3, help="halvings after doubling")


@dataclass
class Layout:
    name: str
    mesh: str
    c: int  # context-parallel ranks (the sequence split in attention); 1 for DTensor
    model: nn.Module
    loss: Callable[[], torch.Tensor]  # the step's loss at the current sequence (ranks' mean)
    inputs: Callable[[torch.Tensor], None]  # the full ids [b, s] → this layout's inputs
    fixed: Callable[[int], int]  # bytes kept between steps beside the parameters and moments
    optimizer: torch.optim.Optimizer | None = None
    times: list[float] = field(default_factory=list)

    def step(self) -> float:
        loss = self.loss()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())

    def kept(self, s: int) -> int:
        """Bytes live between steps: parameters, AdamW's moments, the layout's own (a cached mask)."""
        state = [t for kept in self.optimizer.state.values() for t in kept.values() if isinstance(t, torch.Tensor)]
        return sum(_local(t).nbytes for t in [*self.model.parameters(), *state]) + self.fixed(s)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _llama(args: argparse.Namespace):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn or 3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.max_seq, tie_word_embeddings=False, attn_implementation="sdpa",
        initializer_range=0.3,  # not 0.02: at 0.02 the first loss is ln(vocab) whatever the attention does
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _optimus(name: str, serial: nn.Module, mesh: optimus2d.Mesh, attention: str = "auto") -> Layout:
    spec = context.ContextParallel(mesh, attention=attention)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": spec})
    held: dict[str, torch.Tensor] = {}

    def inputs(ids: torch.Tensor) -> None:
        # ContextParallel caches (assignment, bool[s, s] mask) per length in a private dict: drop the
        # lengths searched before, which no later step uses (if it is renamed, nothing is dropped)
        for s in [s for s in getattr(spec, "_splits", {}) if s != ids.shape[1]]:
            spec._splits.pop(s)
        spec.split(ids.shape[1])
        held["ids"] = optimus2d.scatter_batch(ids, mesh)
        held["labels"] = optimus2d.scatter_batch(ids.clone(), mesh)

    def loss() -> torch.Tensor:
        return model(input_ids=held["ids"], labels=held["labels"]).loss

    kept = lambda s: spec.split(s)[1].nbytes  # noqa: E731
    return Layout(name, f"Mesh({mesh.q}, depth={mesh.depth})", mesh.depth, model, loss, inputs, kept)


def _dtensor(serial: nn.Module, p: int, device: torch.device) -> Layout:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    model, mesh = copy.deepcopy(serial), init_device_mesh(device.type, (p,))
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    top = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, top)
    held: dict[str, torch.Tensor] = {}

    def inputs(ids: torch.Tensor) -> None:
        held["ids"], held["positions"] = ids, torch.arange(ids.shape[1], device=ids.device)[None]
        held["targets"] = F.pad(ids[:, 1:], (0, 1), value=-100)

    def loss() -> torch.Tensor:
        hidden = model.model(input_ids=held["ids"], position_ids=held["positions"]).last_hidden_state
        logits = model.lm_head(hidden)
        with loss_parallel():
            out = F.cross_entropy(logits.flatten(0, 1), held["targets"].flatten(), ignore_index=-100)
        return _ParallelLoss(out, loss_parallel)

    return Layout("DTensor 1D + SP", f"DeviceMesh(({p},))", 1, model, loss, inputs, lambda s: 0)


class _ParallelLoss:
    """A loss whose backward must run under ``loss_parallel`` too."""

    def __init__(self, loss: torch.Tensor, context_manager) -> None:
        self.value, self._cm = loss, context_manager

    def backward(self) -> None:
        with self._cm():
            self.value.backward()

    def full_tensor(self) -> torch.Tensor:
        return self.value.full_tensor()


def layouts(args: argparse.Namespace, p: int, device: torch.device) -> list[Layout]:
    """The three layouts, each with its own copy of the same model and an AdamW; DTensor's last."""
    serial = _llama(args).to(device)
    q = args.q or next((q for q in range(2, math.isqrt(p) + 1) if p % (q * q) == 0), None)
    found = []
    if q is not None and q > 1:
        c = p // (q * q)
        found.append(_optimus("2D + CP" if c > 1 else "2D (c = 1)", serial, optimus2d.Mesh(q, depth=c)))
    alone = optimus2d.Mesh(1, depth=p)
    found.append(_optimus("CP alone", serial, alone))  # "auto" with no memory given: the all-gather
    if not args.no_ring:  # K/V passed round the ring: more bytes, a block at a time in memory
        found.append(_optimus("CP alone, ring", serial, alone, attention="ring"))
    found.append(_dtensor(serial, p, device))
    for layout in found:
        layout.optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-4)
    return found


def divisor(p: int, found: list[Layout]) -> int:
    """What a sequence length must be a multiple of, for every layout: 2c (head–tail) and p (SP)."""
    return math.lcm(p, *(2 * layout.c for layout in found))


def ids_of(batch: int, s: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(s)  # the same on every rank
    return torch.randint(0, vocab, (batch, s), generator=generator).to(device)
