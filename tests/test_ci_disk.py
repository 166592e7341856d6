"""``scripts/test.sh`` on a disk too small for its environments: what it installs, removes and runs.

The real script runs in a scratch directory where every installer and every Python is a stub, and
``df`` reports a disk of the test's choosing: BASE GB free, less 5 while ``.venv-torch211`` exists and
6 while ``.venv-timm`` does (what they keep on the real disk, rounded up). The stubs record what ran.
A disk that cannot hold an environment must not fail the run, only move its 4-rank sections onto
``.venv`` and say so; an install that fails for another reason must fail it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_DF = """#!/usr/bin/env bash
free=$(cat "$FAKE_DF_BASE")
[ -d .venv-torch211 ] && free=$((free - 5))
[ -d .venv-timm ] && free=$((free - 6))
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "/dev/fake 1 1 $((free * 1048576)) 1% /"
"""
# a setup script's stub: installs the environment's stub Python and mpiexec, or fails as FAKE_FAIL says
_SETUP = """#!/usr/bin/env bash
d=$1
case "${FAKE_FAIL:-}" in
  "$d:nospace") mkdir -p "$d"; echo "ERROR: [Errno 28] No space left on device"; exit 1;;
  "$d:other") mkdir -p "$d"; echo "ERROR: No matching distribution found"; exit 1;;
esac
mkdir -p "$d/bin"
for tool in python mpiexec; do
  printf '#!/bin/sh\\necho "%s $*" >> "$RAN"\\n' "$d" > "$d/bin/$tool"
  chmod +x "$d/bin/$tool"
done
"""


def run_ci(tmp_path: Path, base_gb: int, fail: str = "") -> tuple[int, str, list[str]]:
    """test.sh's exit code, output, and the environments whose mpiexec ran, in order."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("")
    stub = tmp_path / "stub_setup.sh"
    stub.write_text(_SETUP)
    for env, script in ((".venv-torch211", "setup_torch211.sh"), (".venv-timm", "setup_timm.sh")):
        (tmp_path / "scripts" / script).write_text(f"bash {stub} {env}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "df").write_text(_DF)
    (bin_dir / "df").chmod(0o755)
    subprocess.run(["bash", str(stub), ".venv"], cwd=tmp_path, check=True, env={**os.environ, "FAKE_FAIL": ""})
    (tmp_path / "base").write_text(str(base_gb))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_DF_BASE": str(tmp_path / "base"),
        "FAKE_FAIL": fail,
        "RAN": str(tmp_path / "ran"),
    }
    env.pop("OPTIMUS2D_SKIP_TIMM", None)
    proc = subprocess.run(
        ["bash", "scripts/test.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    ran = (tmp_path / "ran").read_text().splitlines() if (tmp_path / "ran").exists() else []
    mpiexecs = [line.split()[0] for line in ran if " -n 4 " in f" {line} " and "--only-mpi" in line]
    return proc.returncode, proc.stdout + proc.stderr, mpiexecs


@pytest.mark.parametrize(
    "base_gb, expected",
    [
        # both fit: installed together while the serial tests run
        (20, [".venv-torch211", ".venv-torch211", ".venv-timm", ".venv-timm"]),
        # one at a time: the low end's goes once its tests ran, and the high end's installs
        (12, [".venv-torch211", ".venv-torch211", ".venv-timm", ".venv-timm"]),
        # only the low end's: the high end's 4-rank sections run on .venv
        (8, [".venv-torch211", ".venv-torch211", ".venv", ".venv"]),
        # neither
        (5, [".venv", ".venv"]),
    ],
)
def test_each_environment_the_disk_holds_runs_its_sections(tmp_path: Path, base_gb: int, expected: list[str]) -> None:
    rc, out, ran = run_ci(tmp_path, base_gb)
    assert rc == 0, out
    assert ran == expected, out
    if base_gb == 12:
        assert "removing .venv-torch211 (7 GB free) to make room for .venv-timm" in out
    else:
        assert "removing" not in out, out  # nothing removed where it makes no room
    if expected[-1] == ".venv":
        assert "== NOT TESTED at that end:" in out and "its install needs about" in out, out


def test_an_install_the_disk_cannot_finish_is_removed_and_its_sections_run_on_venv(tmp_path: Path) -> None:
    rc, out, ran = run_ci(tmp_path, 20, fail=".venv-timm:nospace")
    assert rc == 0, out
    assert ran == [".venv-torch211", ".venv-torch211", ".venv", ".venv"], out
    assert ".venv-timm did not fit on the disk" in out and not (tmp_path / ".venv-timm").exists()


@pytest.mark.parametrize("env", [".venv-torch211", ".venv-timm"])
def test_an_install_that_fails_for_another_reason_fails_the_run(tmp_path: Path, env: str) -> None:
    rc, out, ran = run_ci(tmp_path, 12 if env == ".venv-timm" else 20, fail=f"{env}:other")
    assert rc == 1, out
    assert f"{env} failed to install: removed" in out and "No matching distribution" in out
    assert "== torch 2.15.0" not in out and "NOT TESTED" not in out
    # it stops at the first wait for the environment: torch 2.11's sections ran only where it installed
    assert ran == ([] if env == ".venv-torch211" else [".venv-torch211"] * 2), out
