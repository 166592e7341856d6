"""The families sweep reads each converted parameter's gradient, whole, under its serial key
(``benchmarks/families_sweep.py::parallel_grads``; it read the weights while every parameter was a
DTensor, and called every family WRONG)."""

from __future__ import annotations

import copy

import pytest
import torch

import optimus2d
from benchmarks.families_sweep import parallel_grads

pytestmark = [pytest.mark.mpi, pytest.mark.families]
transformers = pytest.importorskip("transformers")


def test_parallel_grads_are_the_serial_gradients_and_leave_the_weights(mesh):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=24, n_layer=1, n_head=6, vocab_size=48, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    serial = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 48, (2 * mesh.depth * mesh.q, 5))
    serial(input_ids=ids, labels=ids).loss.backward()
    parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    local = optimus2d.scatter_batch(ids, mesh)
    parallel(input_ids=local, labels=local, use_cache=False).loss.backward()
    weights = {k: v.clone() for k, v in optimus2d.serial_state_dict(parallel).items()}
    grads = parallel_grads(parallel)
    scale = max(p.grad.abs().max().item() for p in serial.parameters())
    for name, p in serial.named_parameters():  # as tests/helpers.py: within 1e-4 of its size, or of 1e-3 of the largest
        err = (grads[name] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-3 * scale)
        assert err <= 1e-4, f"gradient of {name}: relative error {err:.3e}"
    after = optimus2d.serial_state_dict(parallel)
    assert all(torch.equal(after[k], weights[k]) for k in weights)  # put back
