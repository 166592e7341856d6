"""Train a small character-level GPT on the 2D/2.5D mesh; ``--check`` trains its serial twin beside it.

    mpiexec -n 4 python examples/train_gpt.py --check          # 2×2 mesh, asserts equal loss curves
    torchrun --standalone --nproc_per_node 8 examples/train_gpt.py --depth 2
    mpiexec -n 8 python examples/train_gpt.py --check --stages 2   # 2 pipeline stages of 2×2, 1F1B
    mpiexec -n 8 python examples/train_gpt.py --check --stages 2 --dp 2 --depth 2 --microbatches 2

The model (nanoGPT-shaped: token and position embeddings, pre-norm blocks of causal
self-attention and MLP, a final LayerNorm and a head tied to the token embedding) is built from
torch.nn on every rank with the same seed, and its 2D twin takes its blocks. Both see the same
batches; every rank keeps its block ``[batch/(depth·q), seq, n_embd/q]`` of each activation.

``--stages N`` cuts the model into pipeline chunks, each on a mesh of world/N ranks
(``optimus2d.pipeline``), driven by torch's ``--schedule`` over ``--microbatches``: the first chunk
holds the embeddings, the last the final norm and the head, the blocks are shared out in order.
The tied head keeps its own copy of the token embedding on the last chunk; their gradients are
summed over the lane before each step, so both copies stay equal (Megatron's embedding group).
``--dp N`` runs N data-parallel copies of that pipeline (``stage_meshes(dp=N)``), each on its
share of the batch; each stage averages its gradients over the copies at its last backward.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining as pp

import optimus2d
from optimus2d.layers import Embedding2D, LayerNorm2D, TransformerBlock2D
from optimus2d.pipeline import SCHEDULES, StageMesh, pipeline_stage, stage_meshes


@dataclass
class Config:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    batch: int = 8
    steps: int = 20
    lr: float = 3e-3
    grad_clip: float = 1.0
    dropout: float = 0.0
    depth: int = 1
    stages: int = 1
    dp: int = 1
    schedule: str = "1F1B"
    microbatches: int = 4
    seed: int = 0
    check: bool = False
    data: str = str(Path(__file__).parent / "data" / "tiny.txt")


class SerialGPT(nn.Module):
    """The serial model, plain torch.nn."""

    def __init__(self, cfg: Config, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.n_embd, cfg.n_head, 4 * cfg.n_embd, cfg.dropout, "gelu", batch_first=True, norm_first=True
            )
            for _ in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        for emb in (self.wte, self.wpe):  # GPT-2's init: the tied head then starts near uniform
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(t, device=ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPT2D(nn.Module):
    """The same model on the mesh, or one pipeline chunk of it: the serial ``blocks`` (all by
    default), after the embeddings if ``first``, before the final norm and the head if ``last``.

    Whole: ids ``[b/(d·q), t]`` and targets → the loss, the same on every rank. A chunk: ids (first)
    or x ``[b/(d·q), t, n_embd/q]`` → x, or the logits ``[b/(d·q), t, ⌈vocab/q⌉]`` (last).
    The blocks keep their serial numbers as keys, so ``serial_state_dict`` gives serial's keys.
    """

    def __init__(
        self, serial: SerialGPT, mesh: optimus2d.Mesh, blocks: range | None = None, *, first=True, last=True
    ) -> None:
        super().__init__()
        self.mesh, self.first, self.last = mesh, first, last
        if first or last:  # the last chunk's own copy of the tied weight when the first is elsewhere
            self.wte = Embedding2D.from_serial(serial.wte, mesh)
        if first:
            self.wpe = Embedding2D.from_serial(serial.wpe, mesh)
        blocks = range(len(serial.blocks)) if blocks is None else blocks
        self.blocks = nn.ModuleDict({str(n): TransformerBlock2D.from_serial(serial.blocks[n], mesh) for n in blocks})
        if last:
            self.ln_f = LayerNorm2D.from_serial(serial.ln_f, mesh)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device).expand_as(x)
            x = self.wte(x) + self.wpe(positions)  # [b/(d·q), t, n_embd/q]
        for block in self.blocks.values():
            x = block(x, is_causal=True)
        if not self.last:
            return x
        logits = self.wte.attend(self.ln_f(x))  # [b/(d·q), t, ⌈vocab/q⌉]
        return logits if targets is None else optimus2d.cross_entropy(logits, targets, self.mesh)


def batches(text: torch.Tensor, cfg: Config, device: torch.device):
    """The same random windows on every rank (one generator, one seed)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    while True:
        starts = torch.randint(0, len(text) - cfg.block_size - 1, (cfg.batch,), generator=gen)
        window = torch.stack([text[s : s + cfg.block_size + 1] for s in starts.tolist()])
        yield window[:, :-1].to(device), window[:, 1:].to(device)


def train_step(model, optimizer, params, ids, targets, cfg, clip) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(ids, targets)
    loss.backward()
    clip(params, cfg.grad_clip)
    optimizer.step()
    return loss.item()


@dataclass
class Pipeline:
    """This rank's chunks of the model in a pipeline of stage meshes, and the torch schedule driving them."""

    pipe: StageMesh
    chunks: list[GPT2D]
    schedule: pp.schedules.PipelineScheduleSingle | pp.schedules.PipelineScheduleMulti
    last_on: int  # the stage mesh running the last chunk: it knows the loss
    tied_shape: torch.Size  # of this rank's block of the token embedding


def build_pipeline(serial: SerialGPT, cfg: Config, q: int, vocab: int) -> Pipeline:
    cls, chunks_of = SCHEDULES[cfg.schedule]
    pipe = stage_meshes(cfg.stages, q, cfg.depth, dp=cfg.dp)  # collective over the world
    n_chunks = cfg.stages * len(chunks_of(0, cfg.stages))
    b, t = cfg.batch // cfg.dp // cfg.microbatches, cfg.block_size  # one micro-batch of one copy, serial shape
    chunks, stages = [], []
    for c in chunks_of(pipe.stage, pipe.stages):
        blocks = range(c * cfg.n_layer // n_chunks, (c + 1) * cfg.n_layer // n_chunks)
        chunk = GPT2D(serial, pipe.mesh, blocks, first=c == 0, last=c == n_chunks - 1)
        out = (b, t, -(-vocab // q) * q) if chunk.last else (b, t, cfg.n_embd)  # logits: the padded vocabulary
        first = c == 0  # the first chunk takes token ids [b, t] (torch 2.11 checks the first stage's input too)
        shape = (b, t) if first else (b, t, cfg.n_embd)
        kw = {"output_shape": out, "stage_index": c, "num_stages": n_chunks, "token_ids": first}
        stage = pipeline_stage(chunk, pipe, microbatch_shape=shape, **kw)
        stages.append(stage)
        chunks.append(chunk)
    tokens = cfg.batch // cfg.dp * cfg.block_size  # one copy's share: the copies' mean is serial's

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # Σ over micro-batches = serial's mean
        return optimus2d.cross_entropy(logits, targets, pipe.mesh, reduction="sum") / tokens

    schedule = cls(
        stages if len(stages) > 1 else stages[0], n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=False
    )
    last_on = next(s for s in range(cfg.stages) if n_chunks - 1 in chunks_of(s, cfg.stages))
    tied_shape = Embedding2D.from_serial(serial.wte, pipe.mesh).weight.shape
    return Pipeline(pipe, chunks, schedule, last_on, tied_shape)


def tie_grads(pl: Pipeline) -> None:
    """The token embedding's gradient is its lookups' (first chunk) plus the head's (last chunk):
    sum both copies' over the lane (zeros from ranks without one) and give the sum to both."""
    tied = [c.wte.weight for c in pl.chunks if c.first or c.last]
    total = torch.zeros(pl.tied_shape, device=pl.pipe.mesh.device)
    for w in tied:
        if w.grad is not None:
            total += w.grad
    dist.all_reduce(total, group=pl.pipe.lane)
    for w in tied:
        w.grad = total.clone()


def clip_pipeline(pl: Pipeline, max_norm: float) -> None:
    """``clip_grad_norm_`` of the whole model: each stage mesh's norm², summed over the lane (the
    tied weight counted once, on the first chunk)."""
    counted = [
        p
        for c in pl.chunks
        for name, p in c.named_parameters()
        if not (c.last and not c.first and name == "wte.weight")
    ]
    norm = optimus2d.clip_grad_norm_(counted, math.inf, pl.pipe.mesh)  # max_norm=inf: measures, clips nothing
    total = norm.double().pow(2).reshape(1)
    dist.all_reduce(total, group=pl.pipe.lane)
    clip = max_norm / (total.sqrt().float()[0] + 1e-6)
    if clip < 1:
        for p in (p for c in pl.chunks for p in c.parameters()):
            if p.grad is not None:
                p.grad.detach().mul_(clip)


def pipeline_step(pl: Pipeline, optimizer, ids, targets, cfg) -> float:
    """``train_step`` in pipeline stages: the schedule's forwards and backwards, then one step of every chunk."""
    optimizer.zero_grad(set_to_none=True)
    first, last = any(c.first for c in pl.chunks), any(c.last for c in pl.chunks)
    losses: list[torch.Tensor] = []
    pl.schedule.step(*((ids,) if first else ()), target=targets if last else None, losses=losses if last else None)
    tie_grads(pl)
    clip_pipeline(pl, cfg.grad_clip)
    optimizer.step()
    loss = torch.stack(losses).sum().detach() if last else torch.zeros((), device=pl.pipe.mesh.device)
    dist.broadcast(loss, src=pl.pipe.lane_ranks[pl.last_on], group=pl.pipe.lane)
    if pl.pipe.dp_group is not None:  # each copy's mean over its share → the whole batch's
        dist.all_reduce(loss, group=pl.pipe.dp_group)
        loss /= pl.pipe.dp
    return loss.item()


def weight_difference(models: list[nn.Module], serial: SerialGPT) -> float:
    """The largest relative difference of a trained weight from the serial twin's, on every rank
    (collective over the world: each model over its mesh, then a max).

    All but the key bias (the middle third of ``in_proj_bias``): it cannot change the loss (softmax
    over keys ignores a shift), so its gradient is 0 in serial and rounding on the mesh, which AdamW
    turns into steps of lr either way."""
    reference = serial.state_dict()
    worst = 0.0
    for model in models:
        for key, value in optimus2d.serial_state_dict(model).items():
            ref = reference[key]
            if key.endswith("self_attn.in_proj_bias"):
                n = ref.numel() // 3
                value, ref = torch.cat([value[:n], value[2 * n :]]), torch.cat([ref[:n], ref[2 * n :]])
            worst = max(worst, ((value - ref).norm() / ref.norm().clamp(min=1e-12)).item())
    worst = torch.tensor([worst], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Config()).items():
        if isinstance(value, bool):
            parser.add_argument(f"--{name}", action="store_true")
        else:
            choices = list(SCHEDULES) if name == "schedule" else None
            parser.add_argument(f"--{name}", type=type(value), default=value, choices=choices)
    cfg = Config(**vars(parser.parse_args()))
    if cfg.check and cfg.dropout:
        parser.error("--check compares with the serial model step for step: it needs --dropout 0")

    world = optimus2d.init()
    if cfg.dp > 1 and cfg.stages == 1:
        parser.error("--dp copies a pipeline: give --stages ≥ 2 (one mesh's replicas: Mesh.from_device_mesh and DDP)")
    copies = cfg.stages * cfg.dp
    per_stage = world.size // copies if cfg.stages >= 1 and cfg.dp >= 1 and world.size % copies == 0 else 0
    q = math.isqrt(per_stage // cfg.depth) if per_stage and per_stage % cfg.depth == 0 else 0
    if not q or cfg.depth * q * q != per_stage:
        parser.error(
            f"{world.size} ranks are not dp·stages·depth·q² with dp={cfg.dp}, stages={cfg.stages}, depth={cfg.depth}"
        )
    n_chunks = cfg.stages * len(SCHEDULES[cfg.schedule][1](0, cfg.stages))
    if cfg.stages > 1 and cfg.n_layer < n_chunks:
        parser.error(
            f"--schedule {cfg.schedule} on {cfg.stages} stages runs {n_chunks} chunks: it needs --n_layer ≥ {n_chunks}"
        )
    if cfg.stages > 1 and cfg.batch % (cfg.dp * cfg.microbatches * cfg.depth * q):
        splits = cfg.dp * cfg.microbatches * cfg.depth * q
        parser.error(f"--batch {cfg.batch} is not divisible by dp·microbatches·depth·q = {splits}")
    raw = Path(cfg.data).read_text(encoding="utf-8")
    chars = sorted(set(raw))
    text = torch.tensor([chars.index(c) for c in raw], dtype=torch.long)

    torch.manual_seed(cfg.seed)
    serial = SerialGPT(cfg, len(chars)).to(world.device)
    if cfg.stages == 1:
        mesh = optimus2d.Mesh(q, cfg.depth)
        model, pl, layout = GPT2D(serial, mesh), None, ""
        models = [model]
    else:
        pl = build_pipeline(serial, cfg, q, len(chars))
        mesh, models = pl.pipe.mesh, pl.chunks
        copies = f"{cfg.dp} data-parallel copies of " if cfg.dp > 1 else ""
        layout = f"{copies}{cfg.stages} pipeline stages ({cfg.schedule}, {cfg.microbatches} micro-batches) of "
    opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=cfg.lr)
    opt_serial = torch.optim.AdamW(serial.parameters(), lr=cfg.lr)
    clip_2d = lambda params, max_norm: optimus2d.clip_grad_norm_(params, max_norm, mesh)  # noqa: E731
    clip_serial = torch.nn.utils.clip_grad_norm_
    if world.rank == 0:
        n_params = sum(p.numel() for p in serial.parameters())
        print(
            f"GPT: {cfg.n_layer} layers, {n_params:,} parameters, vocabulary {len(chars)}, "
            f"on {world.size} ranks as {layout}Mesh(q={mesh.q}, depth={mesh.depth})"
        )

    tokens = cfg.batch * cfg.block_size
    worst, times, times_serial = 0.0, [], []
    for step, (ids, targets) in zip(range(cfg.steps), batches(text, cfg, world.device), strict=False):
        start = time.perf_counter()
        r = pl.pipe.dp_rank if pl else 0  # this copy's share of the batch
        share = slice(r * cfg.batch // cfg.dp, (r + 1) * cfg.batch // cfg.dp)
        ids_block, targets_block = (optimus2d.scatter_batch(t[share], mesh) for t in (ids, targets))
        if pl is None:
            loss = train_step(model, opt, list(model.parameters()), ids_block, targets_block, cfg, clip_2d)
        else:
            loss = pipeline_step(pl, opt, ids_block, targets_block, cfg)
        times.append(time.perf_counter() - start)
        line = f"step {step:3d}  loss {loss:.6f}  {tokens / times[-1]:8.0f} tokens/s"
        if cfg.check:
            start = time.perf_counter()
            loss_serial = train_step(serial, opt_serial, list(serial.parameters()), ids, targets, cfg, clip_serial)
            times_serial.append(time.perf_counter() - start)
            worst = max(worst, abs(loss - loss_serial) / abs(loss_serial))
            line += f"  serial {loss_serial:.6f} ({tokens / times_serial[-1]:8.0f} tokens/s)"
        if world.rank == 0:
            print(line, flush=True)

    median = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    if world.rank == 0:
        print(f"2D: median {tokens / median:.0f} tokens/s over steps 1..{cfg.steps - 1} ({world.size} ranks)")
    if cfg.check:
        weights = weight_difference(models, serial)  # collective: every rank
        if world.rank == 0:
            print(f"check: largest relative loss difference from the serial twin over {cfg.steps} steps = {worst:.2e}")
            print(f"check: largest relative weight difference from the serial twin = {weights:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"the 2D loss curve left the serial one: {worst:.2e} > 1e-4")
        if weights > 1e-4:
            raise SystemExit(f"the 2D weights left the serial ones: {weights:.2e} > 1e-4")


if __name__ == "__main__":
    main()
