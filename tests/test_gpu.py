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


def _python(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_layers_on_one_gpu_match_torch_in_fp32_and_bf16():
    script = textwrap.dedent(
        """
        import torch, optimus2d
        from torch import nn
        world = optimus2d.init()
        assert world.backend == "nccl", world
        mesh = optimus2d.Mesh(1)
        torch.manual_seed(0)
        serial = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True, norm_first=True).cuda()
        block = optimus2d.TransformerBlock2D.from_serial(serial, mesh)
        x = torch.randn(4, 16, 64, device="cuda")
        err = ((block(optimus2d.scatter(x, mesh)) - serial(x)).abs().max() / serial(x).abs().max()).item()
        assert err < 1e-5, err
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, y_ref = block(optimus2d.scatter(x, mesh)), serial(x)
        err = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
        assert err < 2e-2, err
        print("ok")
        """
    )
    assert _python("-c", script).strip().endswith("ok")


def test_mlp_benchmark_on_one_gpu_times_with_cuda_events(tmp_path):
    args = ["--hidden", "1024", "--ffn", "4096", "--batch", "8", "--rounds", "3"]
    _python("-m", "benchmarks", "--results", str(tmp_path), "mlp", *args)
    rows = {r["peer"]: r for r in json.loads((tmp_path / "mlp-p1-q1d1.json").read_text())["rows"]}
    assert set(rows) == {"optimus2d 2D", "torch, 1 rank"}
    assert rows["optimus2d 2D"]["train_ms"] > 0 and rows["optimus2d 2D"]["elements_measured"] == 0
    # torch keeps h + 2·ffn a row, MLP2D h + ffn (it recomputes the GELU)
    assert rows["optimus2d 2D"]["activation_bytes"] * (1024 + 2 * 4096) == rows["torch, 1 rank"]["activation_bytes"] * (
        1024 + 4096
    )
