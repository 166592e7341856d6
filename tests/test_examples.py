"""The examples train under mpiexec and torchrun, their loss curves equal to their serial twins'."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import BIN, _clean_env

EXAMPLES = Path(__file__).parent.parent / "examples"
pytestmark = pytest.mark.slow


def _run(launcher: list[str], script: str, *args: str, check: bool = True) -> str:
    """The script's output; ``check=False``: it must fail, and its output and errors are returned."""
    python = [] if "torchrun" in launcher[0] else [sys.executable]  # torchrun starts python itself
    cmd = [*launcher, *python, str(EXAMPLES / script), *args]
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=300)
    if not check:
        assert out.returncode != 0, out.stdout[-2000:]
        return out.stdout + out.stderr
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_gpt_trains_like_its_serial_twin_on_a_2x2_mesh():
    out = _run([str(BIN / "mpiexec"), "-n", "4"], "train_gpt.py", "--check", "--steps", "20")
    assert "check: largest relative loss difference from the serial twin over 20 steps" in out
    assert "tokens/s" in out


def test_gpt_under_torchrun_on_a_2x2x2_mesh():
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "8"]
    out = _run(torchrun, "train_gpt.py", "--check", "--steps", "3", "--depth", "2")
    assert "check: largest relative loss difference from the serial twin over 3 steps" in out


def test_gpt_trains_in_two_pipeline_stages_on_8_ranks():
    out = _run([str(BIN / "mpiexec"), "-n", "8"], "train_gpt.py", "--check", "--steps", "3", "--stages", "2")
    assert "on 8 ranks as 2 pipeline stages (1F1B, 4 micro-batches) of Mesh(q=2, depth=1)" in out
    assert "check: largest relative loss difference from the serial twin over 3 steps" in out
    assert "check: largest relative weight difference from the serial twin" in out


def test_gpt_trains_in_two_data_parallel_copies_of_a_zero_bubble_pipeline():
    args = ["--check", "--steps", "3", "--stages", "2", "--dp", "2", "--depth", "2", "--microbatches", "2"]
    args += ["--n_layer", "4", "--schedule", "ZBVZeroBubble"]
    out = _run([str(BIN / "mpiexec"), "-n", "8"], "train_gpt.py", *args)
    layout = "2 data-parallel copies of 2 pipeline stages (ZBVZeroBubble, 2 micro-batches) of Mesh(q=1, depth=2)"
    assert f"on 8 ranks as {layout}" in out
    assert "check: largest relative loss difference from the serial twin over 3 steps" in out


def test_vit_trains_like_its_serial_twin_on_a_3x3_mesh():
    cmd = ["--check", "--steps", "5", "--batch", "9", "--n_head", "6"]
    out = _run([str(BIN / "mpiexec"), "-n", "9"], "train_vit.py", *cmd)
    assert "check: largest relative loss difference from the serial twin over 5 steps" in out


def test_mlp_demo_runs():
    out = _run([str(BIN / "mpiexec"), "-n", "4"], "train_mlp.py", "--steps", "3")
    assert "max |param 2D - param serial|" in out


def test_a_pretrained_llama_fine_tunes_from_meta_beside_its_serial_twin(tmp_path):
    args = ["--check", "--steps", "3", "--dir", str(tmp_path)]
    out = _run([str(BIN / "mpiexec"), "-n", "4"], "train_pretrained.py", *args)
    assert "check passed: 3 steps equal to the serial model's" in out


def test_a_vlm_llava_with_a_frozen_tower_on_its_own_mesh_trains_beside_its_serial_twin():
    out = _run([str(BIN / "mpiexec"), "-n", "4"], "train_vlm.py", "--check", "--steps", "3")
    assert "vision tower (frozen) on Mesh(q=1, depth=4)" in out
    assert "check passed: 3 steps equal to the serial model's" in out


def test_a_vlm_llava_with_its_tower_in_1d_trains_beside_its_serial_twin():
    out = _run(
        [str(BIN / "mpiexec"), "-n", "4"], "train_vlm.py", "--check", "--tower", "1d", "--heads", "4", "--steps", "3"
    )
    assert "vision tower (frozen) on 1D over 4 ranks" in out
    assert "check passed: 3 steps equal to the serial model's" in out


def test_a_vlm_llava_with_its_language_model_context_parallel_trains_beside_its_serial_twin():
    out = _run([str(BIN / "mpiexec"), "-n", "4"], "train_vlm.py", "--check", "--cp", "4", "--steps", "3")
    assert "the language model's sequence split over cp=4 ranks" in out
    assert "check passed: 3 steps equal to the serial model's" in out


@pytest.mark.parametrize("heads", [6, 4])
def test_a_vlm_llava_placed_by_the_planner_trains_beside_its_serial_twin(heads):
    """``--encoder-ranks auto``: the table of placements priced on this machine, then the pick trained.
    With heads the 4 ranks divide, Megatron's 1D is offered too: the tower alone, or the whole
    ``model.model`` (LLaVA calls its LLM's embedding itself: a 1D LLM beside a meshed tower is not offered)."""
    args = ("--check", "--encoder-ranks", "auto", "--steps", "2", "--heads", str(heads))
    out = _run([str(BIN / "mpiexec"), "-n", "4"], "train_vlm.py", *args)
    [pick] = [line for line in out.splitlines() if line.startswith("*")]
    assert "apart: encoder on 2 ranks as 1×1×2, rest on 2 as 1×1×2" in out
    together = re.findall(r"together on 4 ranks: encoder (\S+), rest (\S+)", out)
    meshes = {"1×1×4", "2×2"}
    offered = {(e, r) for e in meshes for r in meshes} | ({("1d", r) for r in {*meshes, "1d"}} if heads == 4 else set())
    assert sorted(together) == sorted(offered)
    if "together" in pick:
        tower, llm = re.search(r"encoder (\S+), rest (\S+)", pick).groups()
        assert f"language model and projector on {_where(llm)}" in out and f"tower (frozen) on {_where(tower)}" in out
        assert "check passed: 2 steps equal to the serial model's" in out
    else:
        assert "check passed (projector and language model): 2 steps equal to the serial model's" in out


def _where(shape: str) -> str:
    """2×2 → "Mesh(q=2", 1×1×4 → "Mesh(q=1", 1d → "1D over 4 ranks"."""
    return "1D over 4 ranks" if shape == "1d" else f"Mesh(q={int(shape.split('×')[0])}"


def test_a_vlm_llava_all_in_1d_trains_beside_its_serial_twin():
    """``--llm 1d``: all of ``model.model`` one Megatron region (the tower, the projector, the LLM split by
    heads and linears over the 4 ranks), the LM head and the loss on the mesh; a meshed tower beside it refused."""
    out = _run(
        [str(BIN / "mpiexec"), "-n", "4"], "train_vlm.py", "--check", "--llm", "1d", "--heads", "4", "--steps", "2"
    )
    assert "language model and projector on 1D over 4 ranks, vision tower (frozen) on 1D over 4 ranks" in out
    assert "check passed: 2 steps equal to the serial model's" in out
    refused = _run([str(BIN / "mpiexec"), "-n", "1"], "train_vlm.py", "--llm", "1d", "--tower", "own", check=False)
    assert "--llm 1d runs the whole model.model in 1D, its tower too: not --tower own" in refused
    refused = _run([str(BIN / "mpiexec"), "-n", "4"], "train_vlm.py", "--llm", "1d", check=False)  # 6 heads
    assert "--tower/--llm 1d split the 6 heads over 4 ranks: give --heads a multiple" in refused
    refused = _run([str(BIN / "mpiexec"), "-n", "1"], "train_vlm.py", "--microbatches", "0", check=False)
    assert "--microbatches 0: at least 1" in refused
    refused = _run([str(BIN / "mpiexec"), "-n", "2"], "train_vlm.py", "--encoder-ranks", "1", "--microbatches", "1",
                   check=False)  # fmt: skip
    assert "--microbatches 1 with --encoder-ranks: the two sets' 1F1B needs 2 or more" in refused


@pytest.mark.parametrize("ranks, towers, llm", [(8, 4, "Mesh(q=2, depth=1)"), (9, 1, "Mesh(q=2, depth=2)")])
def test_a_vlm_llava_with_its_tower_on_ranks_of_its_own_trains_beside_its_serial_twin(ranks, towers, llm):
    """Non-colocated: the tower on the first ranks, the LLM on the rest (the issue's two commands)."""
    args = ["--check", "--encoder-ranks", str(towers), "--steps", "2"]
    out = _run([str(BIN / "mpiexec"), "-n", str(ranks)], "train_vlm.py", *args)
    assert f"projector and language model on ranks {towers}..{ranks - 1} as {llm}" in out
    assert "check passed (tower): 2 steps" in out
    assert "check passed (projector and language model): 2 steps equal to the serial model's" in out
