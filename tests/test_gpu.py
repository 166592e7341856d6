"""The GPU path (NCCL, CUDA tensors, CUDA-event timing): skipped where there is no CUDA device.

CI's machines have none; a session lent a GPU runs ``python -m pytest tests/test_gpu.py`` there.
Everything runs in a subprocess, so NCCL never starts inside the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.slow]


_PRELUDE = """
import copy, sys, torch, optimus2d
import torch.nn.functional as F
from torch import nn
sys.path.insert(0, "tests")
from helpers import assert_close
world = optimus2d.init()
assert world.backend == "nccl", world
mesh = optimus2d.Mesh(1)
"""


def _run_on_one_gpu(body: str) -> None:
    """``body`` in a fresh process after ``_PRELUDE`` (NCCL world of one, ``mesh``, ``assert_close``);
    it passes when the script reaches its end."""
    out = _python("-c", _PRELUDE + textwrap.dedent(body) + '\nprint("ok")\n')
    assert out.strip().endswith("ok"), out[-2000:]


def _python(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_layers_on_one_gpu_match_torch_in_fp32_and_bf16():
    _run_on_one_gpu(
        """
        torch.manual_seed(0)
        serial = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True, norm_first=True).cuda()
        block = optimus2d.layers.TransformerBlock2D.from_serial(serial, mesh)
        x = torch.randn(4, 16, 64, device="cuda")
        err = ((block(optimus2d.scatter(x, mesh)) - serial(x)).abs().max() / serial(x).abs().max()).item()
        assert err < 1e-5, err
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, y_ref = block(optimus2d.scatter(x, mesh)), serial(x)
        err = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
        assert err < 2e-2, err
        """
    )


def test_gpt2_and_llama_training_step_on_one_gpu_match_transformers():
    """Logits, loss and the weights after one SGD step, fp32 on the GPU, against the serial model."""
    _run_on_one_gpu(
        """
        import transformers
        configs = {
            "gpt2": transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=6,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            "llama": transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=32, attn_implementation="sdpa"),
        }
        for name, config in configs.items():
            torch.manual_seed(0)
            serial = transformers.AutoModelForCausalLM.from_config(config).cuda()
            parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh)
            ids = torch.randint(0, config.vocab_size, (4, 9), device="cuda")
            logits_ref = serial(input_ids=ids, use_cache=False).logits
            loss_ref = F.cross_entropy(logits_ref[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss_ref.backward()
            torch.optim.SGD(serial.parameters(), lr=0.5).step()
            logits = parallel(input_ids=optimus2d.scatter_batch(ids, mesh), use_cache=False).logits
            assert logits.is_cuda
            loss = optimus2d.cross_entropy(logits[:, :-1], ids[:, 1:], mesh)
            loss.backward()
            torch.optim.SGD(parallel.parameters(), lr=0.5).step()
            assert_close(optimus2d.gather(logits.detach(), mesh)[..., : config.vocab_size], logits_ref, 1e-4, name)
            assert_close(loss, loss_ref, 1e-5, name + " loss")
            state = optimus2d.serial_state_dict(parallel)
            for key, value in serial.state_dict().items():
                assert_close(state[key], value, 1e-4, f"{name} {key}")
        """
    )


def test_bf16_layers_on_one_gpu_match_torch_in_bf16():
    """Weights and activations in bf16 (no autocast): MLP2D and LayerNorm2D against torch's in bf16."""
    _run_on_one_gpu(
        """
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda().bfloat16()
        norm = nn.LayerNorm(256).cuda().bfloat16()
        for serial, parallel in ((mlp, optimus2d.layers.MLP2D.from_serial(mlp, mesh)),
                                 (norm, optimus2d.layers.LayerNorm2D.from_serial(norm, mesh))):
            assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in parallel.parameters())
            x = torch.randn(4, 32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            x2 = x.detach().clone().requires_grad_()
            y, y_ref = parallel(optimus2d.scatter(x2, mesh)), serial(x)
            assert y.dtype == torch.bfloat16
            probe = torch.randn_like(y_ref)
            (y_ref * probe).sum().backward()
            (y * probe).sum().backward()
            assert_close(y, y_ref, 1e-2, "output")
            assert_close(x2.grad, x.grad, 2e-2, "input grad")
        """
    )


def test_checkpoint_on_one_gpu_resumes_exactly_and_loads_in_one_process(tmp_path):
    """Save a model and its AdamW state from the GPU, load them into a fresh twin: the next step is
    the uninterrupted one's; ``checkpoint.load(path)`` alone gives the serial state dict."""
    _run_on_one_gpu(
        f"""
        torch.manual_seed(0)
        serial = nn.TransformerEncoderLayer(64, 4, 256, 0.0, batch_first=True, norm_first=True).cuda()
        models = [optimus2d.layers.TransformerBlock2D.from_serial(copy.deepcopy(serial), mesh) for _ in range(2)]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        x = optimus2d.scatter(torch.randn(4, 16, 64, device="cuda"), mesh)
        def step(model, opt):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        step(models[0], opts[0])
        optimus2d.checkpoint.save({str(tmp_path)!r}, models[0], opts[0])
        optimus2d.checkpoint.load({str(tmp_path)!r}, models[1], opts[1])
        for m, o in zip(models, opts):
            step(m, o)
        a, b = (optimus2d.serial_state_dict(m) for m in models)
        for key in a:
            assert b[key].is_cuda, key
            assert_close(b[key], a[key], 1e-5, key)  # not bitwise: attention's backward may add atomically
        """
    )
    loaded = _python("-c", f"import optimus2d; print(sorted(optimus2d.checkpoint.load({str(tmp_path)!r})))")
    assert "self_attn.in_proj_weight" in loaded and "linear1.weight" in loaded, loaded


def test_bf16_block_benchmark_on_one_gpu_reports_tflops(tmp_path):
    args = ["--hidden", "512", "--heads", "8", "--batch", "4", "--rounds", "3", "--dtype", "bfloat16"]
    _python("-m", "benchmarks", "--results", str(tmp_path), "block", *args)
    rows = json.loads((tmp_path / "block-p1-q1d1.json").read_text())["rows"]
    assert [r["peer"] for r in rows] == ["optimus2d 2D", "torch, 1 rank"]
    assert all(r["tflops_per_rank"] > 0 for r in rows), rows


def test_mlp_benchmark_on_one_gpu_times_with_cuda_events(tmp_path):
    args = ["--hidden", "1024", "--ffn", "4096", "--batch", "8", "--rounds", "3"]
    _python("-m", "benchmarks", "--results", str(tmp_path), "mlp", *args)
    rows = {r["peer"]: r for r in json.loads((tmp_path / "mlp-p1-q1d1.json").read_text())["rows"]}
    assert set(rows) == {"optimus2d 2D", "torch, 1 rank"}
    assert rows["optimus2d 2D"]["train_ms"] > 0 and rows["optimus2d 2D"]["elements_measured"] == 0
    # the allocator's peak of one layer's step: the recomputed GELU is freed before its input
    # gradient is made, so MLP2D peaks no higher than torch (and keeps ffn fewer elements a row)
    assert 0 < rows["optimus2d 2D"]["peak_step_bytes"] <= rows["torch, 1 rank"]["peak_step_bytes"]
    # torch keeps h + 2·ffn a row, MLP2D h + ffn (it recomputes the GELU)
    assert rows["optimus2d 2D"]["activation_bytes"] * (1024 + 2 * 4096) == rows["torch, 1 rank"]["activation_bytes"] * (
        1024 + 4096
    )
