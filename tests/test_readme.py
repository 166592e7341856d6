"""The README's snippets, run as they are written.

Every fenced ```python block of README.md runs: those that call ``optimus2d.init()`` under
``mpiexec -n 4`` (the venv's own mpiexec), one after the other in one job, the others each in a
plain subprocess; each from a fresh directory that holds the small Hugging Face checkpoints the snippets
name (``llama-dir``, ``llava-dir``, written first by transformers' own ``save_pretrained``). A block
preceded by ``<!-- not run: reason -->`` is only compiled and its imports checked; one preceded by
``<!-- needs torch X.Y -->`` runs where torch is X.Y or newer (FSDP2 over replicas). Also: every
example file is named in the README, and every example command it names exists.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
RANKS = 4
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->\s*$")
_NEEDS = re.compile(r"<!--\s*needs torch (\d+)\.(\d+)\s*-->\s*$")


def snippets() -> list[tuple[int, str, str | None]]:
    """(line, code, reason not run) of every ```python block."""
    text = README.read_text(encoding="utf-8")
    out = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = [s for s in text[: match.start()].rstrip("\n").splitlines()[-1:] if s.strip()]
        skip = _NOT_RUN.search(before[0]) if before else None
        reason = skip.group(1) if skip else None
        needs = _NEEDS.search(before[0]) if before else None
        if needs and _torch_version() < (int(needs.group(1)), int(needs.group(2))):
            reason = f"needs torch {needs.group(1)}.{needs.group(2)}"
        out.append((line, match.group(1), reason))
    return out


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


SNIPPETS = snippets()
RUN = [(line, code) for line, code, reason in SNIPPETS if reason is None]
OUTLINES = [(line, code, reason) for line, code, reason in SNIPPETS if reason is not None]


def test_the_readme_has_snippets_and_few_are_not_run():
    assert len(RUN) >= 6, [line for line, _ in RUN]
    assert len([o for o in OUTLINES if not o[2].startswith("needs torch")]) <= 1, OUTLINES


@pytest.mark.parametrize(("line", "code", "reason"), OUTLINES, ids=[f"line{line}" for line, *_ in OUTLINES])
def test_an_outline_compiles_and_its_imports_exist(line, code, reason):
    tree = ast.parse(code, f"README.md:{line}")
    if reason.startswith("needs torch"):  # what it imports is what that torch adds
        return
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            module = __import__(node.module, fromlist=["_"])
            for alias in node.names:
                assert hasattr(module, alias.name), f"README.md:{line}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                __import__(alias.name)


def test_every_example_is_in_the_readme_and_every_named_one_exists():
    text = README.read_text(encoding="utf-8")
    named = set(re.findall(r"examples/(\w+\.py)", text))
    present = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert present <= named, f"examples the README does not name: {sorted(present - named)}"
    assert named <= present, f"examples the README names that do not exist: {sorted(named - present)}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """``llama-dir`` (vocabulary 97: padded on q = 2) and ``llava-dir``, small, as Hugging Face writes them."""
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("readme-checkpoints")
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip  (a tied head: its vocabulary of 97 is padded to 98 on q = 2)
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama-dir")
    llava = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
            patch_size=8,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        ),
        image_token_id=63, vision_feature_layer=-2, vision_feature_select_strategy="default",
        attn_implementation="sdpa",
    )  # fmt: skip
    transformers.LlavaForConditionalGeneration(llava).save_pretrained(root / "llava-dir")
    return root


_RUNNER = """
import os, runpy, sys
for name in sys.argv[1:]:  # each snippet from its own directory, as its own __main__
    os.chdir(os.path.join({root!r}, name))
    runpy.run_path(name + ".py", run_name="__main__")
"""


@pytest.mark.slow
def test_the_snippets_run_as_written(checkpoints, tmp_path):
    """Every runnable snippet: those that call ``optimus2d.init()`` one after the other in one
    4-rank mpiexec job (one start and one import of torch and transformers for all; a snippet that
    raises ends the job, its traceback naming ``readme_line<N>.py``), the others each in a process."""
    parallel, serial = [], []
    for line, code in RUN:
        name = f"readme_line{line}"
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.py").write_text(textwrap.dedent(code), encoding="utf-8")
        for checkpoint in ("llama-dir", "llava-dir"):
            (tmp_path / name / checkpoint).symlink_to(checkpoints / checkpoint)
        (parallel if "optimus2d.init()" in code else serial).append(name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runner = tmp_path / "run_snippets.py"
    runner.write_text(_RUNNER.format(root=str(tmp_path)), encoding="utf-8")
    jobs = [[sys.executable, str(runner), name] for name in serial]
    if parallel:
        if not MPIEXEC.exists():
            pytest.skip(f"no {MPIEXEC}")
        jobs.append([str(MPIEXEC), "-n", str(RANKS), sys.executable, str(runner), *parallel])
    for command in jobs:
        out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
        assert out.returncode == 0, f"{command[-len(parallel) :]}:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
