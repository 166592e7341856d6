"""Fine-tune a Hugging Face LLaMA from a pretrained checkpoint on the mesh, never building it whole.

    mpiexec -n 4 python examples/train_pretrained.py --check     # 2×2 mesh, beside its serial twin
    torchrun --standalone --nproc_per_node 8 examples/train_pretrained.py --depth 2

Nothing can be downloaded here, so the "pretrained" checkpoint is first written by Hugging Face's
own ``save_pretrained`` from a small random model (once, by rank 0). Then every rank builds the
model on the meta device, converts it (``parallelize``: no full tensor is ever allocated), reads only
its own blocks from the safetensors files (``load_pretrained``), trains with ``labels=`` (the serial
causal-LM loss) and writes the result back in Hugging Face's format (``save_pretrained``), which
``from_pretrained`` loads into the serial class. ``--check`` trains ``from_pretrained``'s serial
model on the same batches and asserts the same losses and the same final weights.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import optimus2d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--dir", default="/tmp/optimus2d-pretrained-example")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    world = optimus2d.init()
    torch.set_num_threads(1)
    q = math.isqrt(world.size // args.depth)
    mesh = optimus2d.Mesh(q, args.depth)
    pretrained, tuned = Path(args.dir) / "pretrained", Path(args.dir) / "tuned"
    heads = 6 if q == 3 else 4
    if world.rank == 0 and not (pretrained / "config.json").exists():
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=heads // 2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
            pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(1234)
        transformers.LlamaForCausalLM(config).save_pretrained(pretrained)  # HF's own writer
    if dist.is_initialized():
        dist.barrier()

    config = transformers.AutoConfig.from_pretrained(pretrained)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = optimus2d.parallelize(model, mesh)
    optimus2d.load_pretrained(model, pretrained)  # each rank reads its own blocks only
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    serial = transformers.AutoModelForCausalLM.from_pretrained(pretrained) if args.check else None
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=1e-3) if args.check else None

    torch.manual_seed(0)  # the same batches on every rank
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        local = optimus2d.scatter_batch(ids, mesh)
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        line = f"step {step}: loss {loss.item():.5f}"
        if serial is not None:
            serial_loss = serial(input_ids=ids, labels=ids).loss
            serial_loss.backward()
            serial_opt.step()
            serial_opt.zero_grad()
            line += f"  serial {serial_loss.item():.5f}"
            assert abs(loss.item() - serial_loss.item()) <= 1e-4 * abs(serial_loss.item()), line
        if world.rank == 0:
            print(line, flush=True)

    optimus2d.save_pretrained(model, tuned)  # Hugging Face's layout, one full tensor at a time
    if serial is not None:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tuned)
        for key, value in serial.state_dict().items():
            err = (reloaded.state_dict()[key] - value).norm() / value.norm().clamp(min=1e-12)
            assert err <= 1e-4, f"{key}: the saved fine-tuned weights differ from serial by {err:.2e}"
        if world.rank == 0:
            print(f"check passed: {args.steps} steps equal to the serial model's, {tuned} loads into the serial class")
    optimus2d.shutdown()


if __name__ == "__main__":
    main()
