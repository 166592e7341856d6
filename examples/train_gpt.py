"""Train a small character-level GPT on the 2D/2.5D mesh; ``--check`` trains its serial twin beside it.

    mpiexec -n 4 python examples/train_gpt.py --check          # 2×2 mesh, asserts equal loss curves
    torchrun --standalone --nproc_per_node 8 examples/train_gpt.py --depth 2

The model (nanoGPT-shaped: token and position embeddings, pre-norm blocks of causal
self-attention and MLP, a final LayerNorm and a head tied to the token embedding) is built from
torch.nn on every rank with the same seed, and its 2D twin takes its blocks. Both see the same
batches; every rank keeps its block ``[batch/(depth·q), seq, n_embd/q]`` of each activation.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import optimus2d
from optimus2d import Embedding2D, LayerNorm2D, TransformerBlock2D


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
    """The same model on the mesh: ids ``[b/(d·q), t]`` → the loss, the same on every rank."""

    def __init__(self, serial: SerialGPT, mesh: optimus2d.Mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.wte = Embedding2D.from_serial(serial.wte, mesh)
        self.wpe = Embedding2D.from_serial(serial.wpe, mesh)
        self.blocks = nn.ModuleList(TransformerBlock2D.from_serial(b, mesh) for b in serial.blocks)
        self.ln_f = LayerNorm2D.from_serial(serial.ln_f, mesh)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        x = self.wte(ids) + self.wpe(positions)  # [b/(d·q), t, n_embd/q]
        for block in self.blocks:
            x = block(x, is_causal=True)
        logits = self.wte.attend(self.ln_f(x))  # [b/(d·q), t, ⌈vocab/q⌉]
        return optimus2d.cross_entropy(logits, targets, self.mesh)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Config()).items():
        if isinstance(value, bool):
            parser.add_argument(f"--{name}", action="store_true")
        else:
            parser.add_argument(f"--{name}", type=type(value), default=value)
    cfg = Config(**vars(parser.parse_args()))
    if cfg.check and cfg.dropout:
        parser.error("--check compares with the serial model step for step: it needs --dropout 0")

    world = optimus2d.init()
    if world.size % cfg.depth or math.isqrt(world.size // cfg.depth) ** 2 != world.size // cfg.depth:
        parser.error(f"{world.size} ranks are not depth·q² with depth={cfg.depth}")
    mesh = optimus2d.Mesh(math.isqrt(world.size // cfg.depth), cfg.depth)
    raw = Path(cfg.data).read_text(encoding="utf-8")
    chars = sorted(set(raw))
    text = torch.tensor([chars.index(c) for c in raw], dtype=torch.long)

    torch.manual_seed(cfg.seed)
    serial = SerialGPT(cfg, len(chars)).to(world.device)
    model = GPT2D(serial, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    opt_serial = torch.optim.AdamW(serial.parameters(), lr=cfg.lr)
    clip_2d = lambda params, max_norm: optimus2d.clip_grad_norm_(params, max_norm, mesh)  # noqa: E731
    clip_serial = torch.nn.utils.clip_grad_norm_
    if world.rank == 0:
        n_params = sum(p.numel() for p in serial.parameters())
        print(
            f"GPT: {cfg.n_layer} layers, {n_params:,} parameters, vocabulary {len(chars)}, "
            f"on {world.size} ranks as Mesh(q={mesh.q}, depth={mesh.depth})"
        )

    tokens = cfg.batch * cfg.block_size
    worst, times, times_serial = 0.0, [], []
    for step, (ids, targets) in zip(range(cfg.steps), batches(text, cfg, world.device), strict=False):
        start = time.perf_counter()
        loss = train_step(
            model, opt, list(model.parameters()), optimus2d.scatter_batch(ids, mesh),
            optimus2d.scatter_batch(targets, mesh), cfg, clip_2d,
        )  # fmt: skip
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
        if world.rank == 0:
            print(f"check: largest relative loss difference from the serial twin over {cfg.steps} steps = {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"the 2D loss curve left the serial one: {worst:.2e} > 1e-4")


if __name__ == "__main__":
    main()
