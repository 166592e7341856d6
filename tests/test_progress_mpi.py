"""``load_pretrained``, ``save_pretrained`` and ``checkpoint.save`` report: a bar and one summary
line on the mesh's first rank only (logged at INFO when the bar is off, printed to stderr with it)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import optimus2d

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]


@pytest.fixture
def shared(shared_dir):
    """A directory every rank sees (conftest's ``shared_dir``)."""
    return shared_dir


def _gpt2(meta: bool = False):
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=1, n_head=6)  # q = 1, 2, 3
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return transformers.GPT2LMHeadModel(config)


def _summaries(records, what: str) -> list[str]:
    return [r.getMessage() for r in records if r.name == "optimus2d" and r.getMessage().startswith(what)]


def test_a_summary_on_the_first_rank_only(mesh, shared, caplog, capsys):
    if dist.get_rank() == 0:
        _gpt2().save_pretrained(f"{shared}/hf")
    dist.barrier()
    capsys.readouterr()  # transformers' own bar
    caplog.set_level(logging.INFO, logger="optimus2d")
    first = dist.get_rank() == mesh.ranks[0]

    model = optimus2d.parallelize(_gpt2(meta=True), mesh)
    optimus2d.load_pretrained(model, f"{shared}/hf")  # progress None: stderr is no terminal here
    optimus2d.save_pretrained(model, f"{shared}/tuned")
    optimus2d.checkpoint.save(f"{shared}/ckpt", model)
    assert capsys.readouterr().err == ""  # no bar, nothing printed
    lines = {what: _summaries(caplog.records, what) for what in ("load_pretrained", "save_pretrained", "checkpoint")}
    keys = len(model.state_dict())  # collective (GPT-2's fused q/k/v is gathered into the serial layout)
    if not first:
        assert lines == {what: [] for what in lines}, lines
        return
    assert all(len(found) == 1 for found in lines.values()), lines
    with safe_open(f"{shared}/hf/model.safetensors", "pt") as f:
        tensors = len(list(f.keys()))  # the tied head once
    assert lines["load_pretrained"][0].startswith(f"load_pretrained: {tensors} tensors, ")
    assert f"from {shared}/hf in " in lines["load_pretrained"][0]
    assert lines["save_pretrained"][0].startswith(f"save_pretrained: {tensors} tensors, ")
    assert f"in 1 file to {shared}/tuned in " in lines["save_pretrained"][0]
    assert lines["save_pretrained"][0].endswith(
        f"s on a {mesh.q}×{mesh.q}{f'×{mesh.depth}' if mesh.depth > 1 else ''} mesh"
    )
    assert lines["checkpoint"][0].startswith(f"checkpoint.save: {keys} tensors, ")


def test_progress_true_prints_the_bar_and_the_summary_to_stderr(mesh, shared, caplog, capsys):
    model = optimus2d.parallelize(_gpt2(), mesh)
    caplog.set_level(logging.INFO, logger="optimus2d")
    optimus2d.save_pretrained(model, f"{shared}/tuned", progress=True)
    err = capsys.readouterr().err
    assert not _summaries(caplog.records, "save_pretrained")  # printed instead of logged
    if dist.get_rank() == mesh.ranks[0]:
        assert "save_pretrained: " in err and " in 1 file to " in err, err
        pytest.importorskip("tqdm")
        assert "tensor" in err.split("save_pretrained: ")[0] or "it/s" in err or "%" in err, err  # the bar
    else:
        assert err == "", err
