"""Train a small ViT on synthetic images on the 2D/2.5D mesh; ``--check`` trains its serial twin beside it.

    mpiexec -n 4 python examples/train_vit.py --check

Patch embedding (a Linear on flattened patches), a class token and learned positions, pre-norm
transformer blocks, a final LayerNorm and a linear classifier on the class token. The class token
and positions are a user-written ``ShardedModule`` (hidden dim split over the row group), which is
all it takes to bring a new kind of parameter onto the mesh.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import optimus2d
from optimus2d.comm import Sharding, reduce_grad
from optimus2d.layers import LayerNorm2D, Linear2D, ShardedModule, TransformerBlock2D, fill_from_serial


@dataclass
class Config:
    image: int = 16
    patch: int = 4
    channels: int = 3
    classes: int = 12
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 48
    batch: int = 8
    steps: int = 20
    lr: float = 1e-3
    depth: int = 1
    seed: int = 0
    check: bool = False


def patches(images: torch.Tensor, p: int) -> torch.Tensor:
    return rearrange(images, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=p, p2=p)


class SerialViT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        n = (cfg.image // cfg.patch) ** 2
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch**2, cfg.n_embd)
        self.cls_token = nn.Parameter(torch.randn(1, 1, cfg.n_embd) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, cfg.n_embd) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.n_embd, cfg.n_head, 4 * cfg.n_embd, 0.0, "gelu", batch_first=True, norm_first=True
            )
            for _ in range(cfg.n_layer)
        )
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.classes)
        self.patch = cfg.patch

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(patches(images, self.patch))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)[:, 0]), labels)


class TokenParams2D(ShardedModule):
    """The class token ``[1, 1, E]`` and positions ``[1, n+1, E]``, as blocks ``[.., E/q]`` (block j)."""

    def __init__(self, serial: SerialViT, mesh: optimus2d.Mesh) -> None:
        super().__init__(mesh)
        for name in ("cls_token", "pos_embed"):  # declared on meta, then given serial's blocks
            self.declare(name, Sharding(((), (), ("row",)), tuple(getattr(serial, name).shape)), device="meta")
        fill_from_serial(self, serial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axes = ("col", "depth")  # replicated there: gradients are summed over them
        cls, pos = reduce_grad(self.cls_token, self.mesh, axes), reduce_grad(self.pos_embed, self.mesh, axes)
        return torch.cat([cls.expand(x.shape[0], -1, -1), x], 1) + pos


class ViT2D(nn.Module):
    def __init__(self, serial: SerialViT, mesh: optimus2d.Mesh) -> None:
        super().__init__()
        self.mesh, self.patch = mesh, serial.patch
        self.patch_embed = Linear2D.from_serial(serial.patch_embed, mesh)
        self.tokens = TokenParams2D(serial, mesh)
        self.blocks = nn.ModuleList(TransformerBlock2D.from_serial(b, mesh) for b in serial.blocks)
        self.norm = LayerNorm2D.from_serial(serial.norm, mesh)
        self.head = Linear2D.from_serial(serial.head, mesh)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """images: the full batch (the same on every rank); labels: this rank's batch block."""
        x = self.patch_embed(optimus2d.scatter(patches(images, self.patch), self.mesh))  # [b/(d·q), n, E/q]
        x = self.tokens(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0])  # [b/(d·q), classes/q]
        return optimus2d.cross_entropy(logits, labels, self.mesh)


def data(cfg: Config, device: torch.device):
    """Class templates plus noise: the same batches on every rank."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    templates = torch.randn(cfg.classes, cfg.channels, cfg.image, cfg.image, generator=gen)
    while True:
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        noise = torch.randn(cfg.batch, cfg.channels, cfg.image, cfg.image, generator=gen)
        yield (templates[labels] + noise).to(device), labels.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Config()).items():
        kind = {"action": "store_true"} if isinstance(value, bool) else {"type": type(value), "default": value}
        parser.add_argument(f"--{name}", **kind)
    cfg = Config(**vars(parser.parse_args()))
    world = optimus2d.init()
    mesh = optimus2d.Mesh(math.isqrt(world.size // cfg.depth), cfg.depth)
    torch.manual_seed(cfg.seed)
    serial = SerialViT(cfg).to(world.device)
    model = ViT2D(serial, mesh)
    opt, opt_serial = (torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in (model, serial))
    worst = 0.0
    for step, (images, labels) in zip(range(cfg.steps), data(cfg, world.device), strict=False):
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(images, optimus2d.scatter_batch(labels, mesh))
        loss.backward()
        opt.step()
        line = f"step {step:3d}  loss {loss.item():.6f}  {cfg.batch / (time.perf_counter() - start):7.1f} images/s"
        if cfg.check:
            opt_serial.zero_grad()
            loss_serial = serial(images, labels)
            loss_serial.backward()
            opt_serial.step()
            worst = max(worst, abs(loss.item() - loss_serial.item()) / abs(loss_serial.item()))
            line += f"  serial {loss_serial.item():.6f}"
        if world.rank == 0:
            print(line, flush=True)
    if cfg.check:
        if world.rank == 0:
            print(f"check: largest relative loss difference from the serial twin over {cfg.steps} steps = {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"the 2D loss curve left the serial one: {worst:.2e} > 1e-4")


if __name__ == "__main__":
    main()
