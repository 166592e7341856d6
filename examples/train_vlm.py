"""Train a tiny LLaVA-style model (a frozen CLIP tower, the projector, LLaMA) with its tower on a mesh of its own.

    mpiexec -n 4 python examples/train_vlm.py --check                # LLM on 2×2, tower on 1×1×4
    mpiexec -n 4 python examples/train_vlm.py --check --tower same   # both on the 2×2 mesh
    mpiexec -n 4 python examples/train_vlm.py --check --tower 1d --heads 4  # the tower in Megatron's 1D
    mpiexec -n 4 python examples/train_vlm.py --check --llm 1d --heads 4    # all of model.model in 1D
    mpiexec -n 9 python examples/train_vlm.py --check                # LLM on 3×3, tower on 1×1×9
    mpiexec -n 8 python examples/train_vlm.py --check --cp 2         # 2×2 mesh × cp 2: the LLM's sequence split in 2
    mpiexec -n 4 python examples/train_vlm.py --check --cp 4         # the LLM's sequence split over 4 ranks
    mpiexec -n 8 python examples/train_vlm.py --check --encoder-ranks 4  # tower on ranks 0..3, LLM on 4..7
    mpiexec -n 9 python examples/train_vlm.py --check --encoder-ranks 1  # tower on rank 0, LLM on 1..8 (2×2×2)

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
splits its attention heads and MLPs; ``--heads`` must divide by the ranks). ``--llm 1d`` runs the
language model in 1D too; LLaVA calls its LLM's embedding itself, so the 1D region is all of
``model.model`` (``plan={"model": Megatron(mesh)}``: the tower, the projector and the LLM), the LM
head and the loss on the mesh. ``--cp N`` splits the
language model's fused sequence over N ranks (context parallelism, the mesh's depth axis: q×q×N
ranks, ``plan={"model.language_model": context.ContextParallel(mesh)}``, causal and balanced
head–tail) while the embedding, the projector, the head and the loss keep the batch layout; the
sequence defaults to 64 tokens. ``--encoder-ranks N`` puts the tower on ranks of its own, apart from
the language model (non-colocated): the tower on the first N ranks (``Mesh(1, N)``), the projector
and the language model on the other M as the squarest mesh of M ranks (4: 2×2, 8: 2×2×2, 6: 1×1×6),
two stages of torch's ``Schedule1F1B`` on ``optimus2d.pipeline.rank_sets``: each batch in
``--microbatches`` micro-batches, the tower's ranks computing the features of micro-batch m + 1
while the language model's ranks work on m, each feature block sent straight to the ranks whose
blocks it meets. ``--encoder-ranks auto`` prices every placement (together on the meshes of all
the ranks, and in 1D where the ranks divide ``--heads``; apart on every split) and trains the
pick. ``--check`` trains
the serial twin (the same initial weights, the same batches) and asserts the same losses, the same
final weights and no gradient in the frozen tower.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import time

import torch
import transformers
from torch.distributed.pipelining import Schedule1F1B

import optimus2d
from optimus2d.cost.calibration import hardware
from optimus2d.cost.planner import ONE_D, Layer, Part

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


def serial_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> float:
    """One step of the serial twin on the whole batch; its loss."""
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def beside_serial(line: str, loss: float, serial_loss: float) -> tuple[str, float]:
    """``line`` with the serial loss and the relative difference, asserted within 1e-4; and that difference."""
    diff = abs(loss - serial_loss) / abs(serial_loss)
    line += f"  serial {serial_loss:.6f}  (relative difference {diff:.1e})"
    assert diff <= 1e-4, line
    return line, diff


def weights_within(state: dict, reference: dict) -> float:
    """The largest relative difference of ``state``'s tensors from ``reference``'s, each asserted within 1e-4."""
    largest = 0.0
    for key, value in state.items():
        err = ((value - reference[key]).norm() / reference[key].norm().clamp(min=1e-12)).item()
        assert err <= 1e-4, f"{key}: the trained weights differ from serial by {err:.2e}"
        largest = max(largest, err)
    return largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="global; default: the number of ranks")
    parser.add_argument("--seq", type=int, default=None, help="tokens a sample; default 16, with --cp 64")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks for the language model")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tower", choices=["own", "same", "1d"], default=None, help="default own")
    parser.add_argument(
        "--llm",
        choices=["mesh", "1d"],
        default=None,
        help="1d: the LLM in Megatron's 1D over every rank, and so the tower and projector (LLaVA calls the "
        "LLM's embedding itself: the 1D region is the whole model.model); default mesh",
    )
    parser.add_argument("--heads", type=int, default=6, help="attention heads of the tower and the LLM (divide 48)")
    parser.add_argument(
        "--encoder-ranks",
        default="0",
        help="the tower on the first N ranks, the LLM apart; auto: together or apart, and the meshes, as "
        "optimus2d.pipeline.propose_placement picks",
    )
    parser.add_argument(
        "--microbatches", type=int, default=2, help="with --encoder-ranks: micro-batches a step (2 or more)"
    )
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    world = optimus2d.init()
    torch.set_num_threads(1)
    shapes = None  # with auto: the (q, depth) of the tower's mesh and of the LLM's, or ONE_D
    if args.microbatches < 1:
        parser.error(f"--microbatches {args.microbatches}: at least 1")
    if args.encoder_ranks == "auto":
        if args.cp > 1 or args.depth > 1 or args.tower not in (None, "own") or args.llm not in (None, "mesh"):
            parser.error("--encoder-ranks auto places the tower and the LLM itself: no --cp, --depth, --tower or --llm")
        args.batch = args.batch or args.microbatches * world.size
        args.seq = args.seq or 16
        placement = place(args, world)
        args.encoder_ranks, shapes = placement.encoder_ranks, (placement.best.encoder, placement.best.rest)
        args.tower, args.llm = ("1d" if shapes[0] == ONE_D else None), ("1d" if shapes[1] == ONE_D else None)
    elif not args.encoder_ranks.isdigit():
        parser.error(f"--encoder-ranks {args.encoder_ranks!r}: a number of ranks, or auto")
    args.encoder_ranks = int(args.encoder_ranks)
    if args.llm == "1d" and (args.tower or "1d") != "1d":
        parser.error(f"--llm 1d runs the whole model.model in 1D, its tower too: not --tower {args.tower}")
    if args.llm == "1d" and args.cp > 1:
        parser.error("--llm 1d: the LLM split by heads over every rank, not its sequence: no --cp")
    if "1d" in (args.tower, args.llm) and args.heads % world.size:
        parser.error(f"--tower/--llm 1d split the {args.heads} heads over {world.size} ranks: give --heads a multiple")
    if args.encoder_ranks:
        if args.cp > 1 or args.depth > 1 or args.tower not in (None, "own") or args.llm not in (None, "mesh"):
            parser.error("--encoder-ranks places the tower and the LLM itself: no --cp, --depth, --tower or --llm")
        if args.microbatches < 2:  # torch's Schedule1F1B refuses fewer micro-batches than stages
            parser.error(f"--microbatches {args.microbatches} with --encoder-ranks: the two sets' 1F1B needs 2 or more")
        if not 0 < args.encoder_ranks < world.size:
            parser.error(f"--encoder-ranks {args.encoder_ranks} must leave the LLM at least one of {world.size} ranks")
        return train_on_rank_sets(args, world, parser, shapes)
    if args.cp > 1 and args.depth > 1:
        parser.error("--cp splits the sequence over the mesh's depth axis: give --cp or --depth, not both")
    args.tower = args.tower or ("1d" if args.llm == "1d" else "own")
    if shapes is None:
        depth = max(args.depth, args.cp)
    else:  # the LLM's mesh from the placement; in 1D, the squarest (its projector's and head's)
        depth = (squarest(world.size) if shapes[1] == ONE_D else shapes[1])[1]
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
    if shapes is not None and ONE_D not in shapes:  # the placement's pick, together: the tower on its mesh
        tower = mesh if shapes[0] == shapes[1] else optimus2d.Mesh(*shapes[0])
    plan = {"model.vision_tower": tower} if tower is not mesh else {}
    if args.tower == "1d":  # Megatron's 1D over every rank, on torch's parallelize_module: heads split by rank
        plan = {"model.vision_tower": optimus2d.megatron.Megatron(mesh)}
    if args.llm == "1d":  # all of model.model (tower, projector, LLM) one 1D region; the LM head on the mesh
        plan = {"model": optimus2d.megatron.Megatron(mesh)}
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
        llm = f"1D over {world.size} ranks" if args.llm == "1d" else f"Mesh(q={mesh.q}, depth={mesh.depth})"
        print(
            f"LLaVA: language model and projector on {llm}, vision tower "
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
            line, diff = beside_serial(line, loss, serial_step(serial, serial_opt, full))
            worst = max(worst, diff)
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
        largest = weights_within(state, serial.state_dict())
        if world.rank == 0:
            print(
                f"check passed: {args.steps} steps equal to the serial model's (losses within {worst:.1e}, "
                f"weights within {largest:.1e}); the frozen tower got no gradients",
                flush=True,
            )
    optimus2d.shutdown()


def squarest(ranks: int) -> tuple[int, int]:
    """(q, depth) of the mesh of ``ranks`` with the largest q (q² divides ``ranks``)."""
    q = math.isqrt(ranks)
    while ranks % (q * q):
        q -= 1
    return q, ranks // (q * q)


def place(args, world) -> optimus2d.pipeline.Placement:
    """``--encoder-ranks auto``: the tower (frozen, its patches and class token a sequence) and the
    projector with the LLM (its first layer's input gradient feeds the trained projector) priced
    together on every rank and apart on every split (``propose_placement``), on this machine's costs
    (``cost.calibration.hardware``: measured once over every rank, cached); rank 0 prints the table."""
    config = build(args.heads).config
    vision, text = config.vision_config, config.get_text_config()
    patches = (vision.image_size // vision.patch_size) ** 2 + 1
    tower_layers = vision.num_hidden_layers + 1 + config.vision_feature_layer
    tower = Part("model.vision_tower", Layer(args.batch, patches, vision.hidden_size, vision.intermediate_size,
                 vision.num_attention_heads), tower_layers, frozen=True, dtensor_attention=True)  # fmt: skip
    llm = Part(
        "model.language_model",
        Layer(args.batch, args.seq, text.hidden_size, 3 * text.intermediate_size // 2, text.num_attention_heads),
        text.num_hidden_layers,
        input_grad=True,
        dtensor_attention=True,  # CLIP's and LLaMA's attention split in 1D by parallelize_module
    )  # fmt: skip (gated: f' = 3f/2)
    hw = hardware(optimus2d.Mesh(1, world.size))
    one_d = world.size > 1 and args.heads % world.size == 0  # Megatron's split: the heads over the ranks
    placement = optimus2d.pipeline.propose_placement(
        tower, llm, world.size, hw, microbatches=args.microbatches, one_d=one_d
    )
    # LLaVA calls its LLM's embedding itself: the LLM runs in 1D only inside a 1D region of all of
    # model.model, the tower's 1D too (a 1D LLM beside a tower on a mesh is not offered)
    table = tuple(c for c in placement.table if c.rest != ONE_D or c.encoder == ONE_D)
    placement = dataclasses.replace(placement, best=table[0], table=table)
    if world.rank == 0:
        print(placement.explain(), flush=True)
    return placement


def train_on_rank_sets(args, world, parser, shapes=None) -> None:
    """``--encoder-ranks N``: the frozen tower on ranks 0..N-1, the projector and the LLM on the rest;
    ``shapes``: the (q, depth) of each set's mesh (default: 1×1×N, and the squarest of the rest)."""
    from optimus2d.pipeline.models.llama import causal_lm_loss, causal_lm_targets
    from optimus2d.pipeline.models.llava import llava_stages

    n, towers = args.microbatches, args.encoder_ranks
    (tq, tdepth), (q, depth) = shapes or ((1, towers), squarest(world.size - towers))
    sets = optimus2d.pipeline.rank_sets([range(towers), range(towers, world.size)], q=(tq, q), depth=(tdepth, depth))
    mesh, stage = sets.mesh, sets.stage
    blocks = math.lcm(tdepth * tq, depth * q)
    batch = args.batch or n * blocks
    if batch % (n * blocks):
        parser.error(f"--batch {batch} must divide by micro-batches · lcm(tower ranks, depth·q) = {n}·{blocks}")
    args.seq = args.seq or 16
    model = build(args.heads)
    model.model.vision_tower.requires_grad_(False)
    tower_layers = model.config.vision_config.num_hidden_layers + 1 + model.config.vision_feature_layer
    encoders, texts = llava_stages(model, [tower_layers], 1)  # copies; ``model`` stays the serial twin
    chunk = optimus2d.parallelize(encoders[0] if stage == 0 else texts[0], mesh)
    mb, vision, vocab = batch // n, model.config.vision_config, model.config.get_text_config().vocab_size
    features = (mb, ROWS, vision.hidden_size)
    if stage == 0:  # images in, features out; frozen: no gradient comes back
        shapes = dict(microbatch_shape=(mb, 3, 16, 16), input_layout="batch", output_shape=features, output_grad=False)
    else:  # features and ids in, logits out
        shapes = dict(microbatch_shape=features, input_grad=False, output_shape=(mb, args.seq, vocab))
    pipe_stage = optimus2d.pipeline.pipeline_stage(chunk, sets, dtype=torch.float32, **shapes)
    opt = adamw(chunk, args.lr) if stage == 1 else None
    serial_opt = adamw(model, args.lr) if args.check else None
    first_llm = towers  # the rank that reports
    if world.rank == first_llm:
        where = f"ranks 0..{towers - 1}" if towers > 1 else "rank 0"
        print(
            f"LLaVA: vision tower (frozen) on {where} as Mesh(q={tq}, depth={tdepth}); projector and "
            f"language model on ranks {towers}..{world.size - 1} as Mesh(q={q}, depth={depth}); batch "
            f"{batch}×{args.seq} tokens in {n} micro-batches (Schedule1F1B)",
            flush=True,
        )

    tokens, times, worst = batch * args.seq, [], 0.0
    for step, full in zip(range(args.steps), batches(batch, args.seq), strict=False):
        start = time.perf_counter()
        target, count = causal_lm_targets(full["labels"], mesh, microbatches=n)
        schedule = Schedule1F1B(pipe_stage, n_microbatches=n, loss_fn=causal_lm_loss(mesh, count), scale_grads=False)
        losses: list = []
        if stage == 0:
            schedule.step(optimus2d.pipeline.scatter_microbatches(full["pixel_values"], mesh, n, layout="batch"))
        else:
            ids = optimus2d.pipeline.scatter_microbatches(full["input_ids"], mesh, n, layout="batch")
            schedule.step(input_ids=ids, target=target, losses=losses)
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - start)
        if stage == 1:
            loss = torch.stack(losses).sum().item()
            line = f"step {step:3d}  loss {loss:.6f}  {tokens / times[-1]:8.0f} tokens/s"
        if serial_opt is not None:
            serial_loss = serial_step(model, serial_opt, full)
            if stage == 1:
                line, diff = beside_serial(line, loss, serial_loss)
                worst = max(worst, diff)
        if world.rank == first_llm:
            print(line, flush=True)

    median = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    if world.rank == first_llm:
        print(f"median {tokens / median:.0f} tokens/s over steps 1..{args.steps - 1} ({world.size} ranks)", flush=True)
    if serial_opt is not None:
        assert all(p.grad is None for p in model.model.vision_tower.parameters()), "the serial tower got gradients"
        assert all(p.grad is None for p in chunk.parameters() if not p.requires_grad), "the frozen tower got gradients"
        largest = weights_within(optimus2d.serial_state_dict(chunk), model.state_dict())  # collective over the set
        if world.rank in (0, first_llm):
            part = "tower" if stage == 0 else "projector and language model"
            print(
                f"check passed ({part}): {args.steps} steps equal to the serial model's (losses within {worst:.1e}, "
                f"weights within {largest:.1e}); the frozen tower got no gradients",
                flush=True,
            )
    optimus2d.shutdown()


if __name__ == "__main__":
    main()
