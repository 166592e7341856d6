"""Train a tiny LLaVA-style model (a frozen CLIP tower, the projector, LLaMA) with its tower on a mesh of its own.

    mpiexec -n 4 python examples/train_vlm.py --check                # LLM on 2×2, tower on 1×1×4
    mpiexec -n 4 python examples/train_vlm.py --check --tower same   # both on the 2×2 mesh
    mpiexec -n 4 python examples/train_vlm.py --check --tower 1d --heads 4  # the tower in Megatron's 1D
    mpiexec -n 9 python examples/train_vlm.py --check                # LLM on 3×3, tower on 1×1×9
    mpiexec -n 8 python examples/train_vlm.py --check --cp 2         # 2×2 mesh × cp 2: the LLM's sequence split in 2
    mpiexec -n 4 python examples/train_vlm.py --check --cp 4         # the LLM's sequence split over 4 ranks

Hugging Face's ``LlavaForConditionalGeneration`` from a small random config, on synthetic
image–text pairs: each image (16×16, 8×8 patches: 4 feature rows once the class token is dropped)
fills its sample's 4 image tokens, and the caption that follows depends on the image's class, so
the projector has something to learn. The vision tower is frozen (``requires_grad_(False)`` before
``parallelize``), the projector and the language model train with AdamW on ``labels=`` (the serial
loss; the image tokens are ignored with -100).

The layout is heterogeneous: the language model on the q×q (×depth) mesh, and with ``--tower own``
(default) the tower on ``Mesh(1, p)``, every rank a whole tower on its own slice of the images,
which sends nothing in backward since the tower is frozen: ``parallelize(..., plan={"model.vision_tower":
tower})`` moves the images to the tower's mesh and the feature layer back. ``--tower same`` keeps the
tower on the model's mesh. ``--tower 1d`` runs the tower with Megatron's 1D tensor parallelism over
every rank (``plan={"model.vision_tower": megatron.Megatron(mesh)}``: torch's ``parallelize_module``
splits its attention heads and MLPs; ``--heads`` must divide by the ranks). ``--cp N`` splits the
language model's fused sequence over N ranks (context parallelism, the mesh's depth axis: q×q×N
ranks, ``plan={"model.language_model": context.ContextParallel(mesh)}``, causal and balanced
head–tail) while the embedding, the projector, the head and the loss keep the batch layout; the
sequence defaults to 64 tokens. ``--check`` trains
the serial twin (the same initial weights, the same batches) and asserts the same losses, the same
final weights and no gradient in the frozen tower.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
import transformers

import optimus2d

IMAGE, ROWS = 143, 4  # the image token (the last of the vocabulary); feature rows per image
CLASSES = 8


def build(heads: int = 6) -> transformers.LlavaForConditionalGeneration:
    """The same random model on every rank (hidden sizes divide by 2, 3 and 4; 6 heads by 2 and 3)."""
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
            image_size=16, patch_size=8,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=IMAGE + 1, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        ),
        image_token_id=IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(1234)
    return transformers.LlavaForConditionalGeneration(config)


def batches(batch: int, seq: int):
    """Synthetic pairs, the same on every rank: an image of class c (its prototype plus noise), a
    text prefix of 0–2 random tokens, the 4 image tokens, then a caption that class c determines."""
    gen = torch.Generator().manual_seed(0)
    prototypes = torch.randn(CLASSES, 3, 16, 16, generator=gen)
    captions = torch.randint(1, IMAGE, (CLASSES, seq), generator=gen)
    while True:
        classes = torch.randint(0, CLASSES, (batch,), generator=gen)
        pixels = prototypes[classes] + 0.5 * torch.randn(batch, 3, 16, 16, generator=gen)
        ids = torch.randint(1, IMAGE, (batch, seq), generator=gen)
        for row, c in enumerate(classes.tolist()):
            start = 1 + row % 3
            ids[row, 0] = 0  # bos
            ids[row, start : start + ROWS] = IMAGE
            ids[row, start + ROWS :] = captions[c, : seq - start - ROWS]
        labels = ids.masked_fill(ids == IMAGE, -100)
        yield dict(input_ids=ids, pixel_values=pixels, labels=labels)


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """eps not tiny beside the gradients: a gradient that is rounding alone (zero in serial, 1e-9 on
    the mesh) must not become a step of lr, which no relative tolerance would forgive."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, eps=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="global; default: the number of ranks")
    parser.add_argument("--seq", type=int, default=None, help="tokens a sample; default 16, with --cp 64")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks for the language model")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tower", choices=["own", "same", "1d"], default="own")
    parser.add_argument("--heads", type=int, default=6, help="attention heads of the tower and the LLM (divide 48)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    world = optimus2d.init()
    torch.set_num_threads(1)
    if args.cp > 1 and args.depth > 1:
        parser.error("--cp splits the sequence over the mesh's depth axis: give --cp or --depth, not both")
    depth = max(args.depth, args.cp)
    q = math.isqrt(world.size // depth)
    if world.size % depth or q * q * depth != world.size:
        parser.error(f"{world.size} ranks are not depth·q² with depth={depth}")
    batch = args.batch or world.size
    if batch % (depth * q) or batch % world.size:
        parser.error(f"--batch {batch} must divide by depth·q = {depth * q} and by {world.size} ranks")
    args.seq = args.seq or (64 if args.cp > 1 else 16)
    if args.seq < 3 + ROWS:
        parser.error(f"--seq must be at least {3 + ROWS}")
    if args.seq % (2 * args.cp):
        parser.error(f"--seq {args.seq} must divide into 2·cp = {2 * args.cp} chunks (head–tail balance)")

    mesh = optimus2d.Mesh(q, depth)  # the language model's and the projector's
    tower = optimus2d.Mesh(1, world.size) if args.tower == "own" else mesh
    plan = {"model.vision_tower": tower} if tower is not mesh else {}
    if args.tower == "1d":  # Megatron's 1D over every rank, on torch's parallelize_module: heads split by rank
        plan = {"model.vision_tower": optimus2d.megatron.Megatron(mesh)}
    if args.cp > 1:  # the language model's sequence split over depth; the rest in the batch layout
        plan["model.language_model"] = optimus2d.context.ContextParallel(mesh, mask="causal", balance="head_tail")
    model = build(args.heads)
    model.model.vision_tower.requires_grad_(False)  # frozen: no gradient, and nothing sent back to it
    serial = copy.deepcopy(model) if args.check else None  # the same initial weights
    model = optimus2d.parallelize(model, mesh, plan=plan or None)
    opt = adamw(model, args.lr)
    serial_opt = adamw(serial, args.lr) if serial is not None else None
    if world.rank == 0:
        where = f"1D over {world.size} ranks" if args.tower == "1d" else f"Mesh(q={tower.q}, depth={tower.depth})"
        print(
            f"LLaVA: language model and projector on Mesh(q={mesh.q}, depth={mesh.depth}), vision tower "
            f"(frozen) on {where}; batch {batch}×{args.seq} tokens"
            + (f"; the language model's sequence split over cp={args.cp} ranks" if args.cp > 1 else ""),
            flush=True,
        )

    tokens = batch * args.seq
    times, worst = [], 0.0
    for step, full in zip(range(args.steps), batches(batch, args.seq), strict=False):
        start = time.perf_counter()
        out = model(**{k: optimus2d.scatter_batch(v, mesh) for k, v in full.items()})
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        loss = out.loss.item()
        times.append(time.perf_counter() - start)
        line = f"step {step:3d}  loss {loss:.6f}  {tokens / times[-1]:8.0f} tokens/s"
        if serial is not None:
            serial_loss = serial(**full).loss
            serial_loss.backward()
            serial_opt.step()
            serial_opt.zero_grad()
            diff = abs(loss - serial_loss.item()) / abs(serial_loss.item())
            worst = max(worst, diff)
            line += f"  serial {serial_loss.item():.6f}  (relative difference {diff:.1e})"
            assert diff <= 1e-4, line
        if world.rank == 0:
            print(line, flush=True)

    median = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    if world.rank == 0:
        print(f"median {tokens / median:.0f} tokens/s over steps 1..{args.steps - 1} ({world.size} ranks)", flush=True)
    if serial is not None:
        frozen = [model.model.vision_tower, serial.model.vision_tower]
        assert all(p.grad is None for t in frozen for p in t.parameters()), "the frozen tower got gradients"
        state = optimus2d.serial_state_dict(model)  # collective: every rank
        assert list(state) == list(serial.state_dict())
        largest = 0.0
        for key, value in serial.state_dict().items():
            err = ((state[key] - value).norm() / value.norm().clamp(min=1e-12)).item()
            assert err <= 1e-4, f"{key}: the trained weights differ from serial by {err:.2e}"
            largest = max(largest, err)
        if world.rank == 0:
            print(
                f"check passed: {args.steps} steps equal to the serial model's (losses within {worst:.1e}, "
                f"weights within {largest:.1e}); the frozen tower got no gradients",
                flush=True,
            )
    optimus2d.shutdown()


if __name__ == "__main__":
    main()
