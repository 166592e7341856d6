"""``scripts/test.sh`` on a disk too small for its environments: what it installs, removes and runs.

The real script (and ``scripts/envs.sh``) runs in a scratch directory where every installer and every
Python is a stub, and ``df`` reports a disk of the test's choosing: BASE KiB free, less what each
environment there keeps (4.6 GiB for ``.venv-torch211``, 5.3 for ``.venv-timm``, as measured; ``du``
reports the same). The stubs record what ran. A disk that cannot hold an environment must not fail
the run, only move its 4-rank sections onto ``.venv`` and say so; an install that fails for another
reason must fail it, and leave an environment that was there as it was. And a user's ``-k`` or ``-m``
narrows each section's own selection.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 20  # KiB
KEEPS = {".venv-torch211": int(4.6 * GIB), ".venv-timm": int(5.3 * GIB)}

_DF = """#!/usr/bin/env bash
free=$(cat "$FAKE_DF_BASE")
for d in .venv-torch211 .venv-timm; do [ -f "$d/kib" ] && free=$((free - $(cat "$d/kib"))); done
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "/dev/fake 1 1 $free 1% /"
"""
_DU = """#!/usr/bin/env bash
[ "$1" = -sk ] || { echo "du: the script must ask for KiB (-sk), not $1" >&2; exit 2; }
printf '%s\\t%s\\n' "$(cat "$2/kib" 2>/dev/null || echo 4)" "$2"
"""
# a setup script's stub: installs the environment's stub Python and mpiexec, or fails as FAKE_FAIL says
_SETUP = """#!/usr/bin/env bash
d=$1
case " ${FAKE_FAIL:-} " in
  *" $d:nospace "*) mkdir -p "$d"; echo "ERROR: [Errno 28] No space left on device"; exit 1;;
  *" $d:other "*) mkdir -p "$d"; echo "ERROR: No matching distribution found"; exit 1;;
esac
mkdir -p "$d/bin"
echo "$2" > "$d/kib"
for tool in python mpiexec; do
  printf '#!/bin/sh\\necho "%s $*" >> "$RAN"\\n' "$d" > "$d/bin/$tool"
  printf '[ "$FAKE_MPI_FAIL" != "%s" ] || exit 1\\n[ "$FAKE_NONE_IN" != "%s" ] || exit 5\\n' "$d" "$d" >> "$d/bin/$tool"
  chmod +x "$d/bin/$tool"
done
"""


def scratch(tmp_path: Path) -> Path:
    """A directory holding test.sh, envs.sh, stub installers, a stub .venv, and a bin/ of df and du."""
    (tmp_path / "scripts").mkdir()
    for name in ("test.sh", "envs.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    (tmp_path / "scripts" / "setup.sh").write_text("")
    stub = tmp_path / "stub_setup.sh"
    stub.write_text(_SETUP)
    for env, script in ((".venv-torch211", "setup_torch211.sh"), (".venv-timm", "setup_timm.sh")):
        (tmp_path / "scripts" / script).write_text(f"bash {stub} {env} {KEEPS[env]}\n")
    (tmp_path / "bin").mkdir()
    for tool, text in (("df", _DF), ("du", _DU)):
        (tmp_path / "bin" / tool).write_text(text)
        (tmp_path / "bin" / tool).chmod(0o755)
    subprocess.run(["bash", str(stub), ".venv", "0"], cwd=tmp_path, check=True, env={**os.environ, "FAKE_FAIL": ""})
    return tmp_path


def run_ci(
    where: Path,
    base_kib: int,
    fail: str = "",
    *,
    mpi_fail: str = "",
    skip_timm: bool = False,
    args: tuple[str, ...] = (),
    none_in: str = "",
) -> tuple[int, str, list[str]]:
    """test.sh's exit code, output, and the environments whose mpiexec ran 4 ranks, in order (``args``
    go to test.sh; the pytests of ``none_in`` say "no tests ran")."""
    (where / "base").write_text(str(base_kib))
    (where / "ran").unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{where / 'bin'}:{os.environ['PATH']}",
        "FAKE_DF_BASE": str(where / "base"),
        "FAKE_FAIL": fail,
        "FAKE_MPI_FAIL": mpi_fail,
        "RAN": str(where / "ran"),
        "FAKE_NONE_IN": none_in,
    }
    env.pop("OPTIMUS2D_SKIP_TIMM", None)
    if skip_timm:
        env["OPTIMUS2D_SKIP_TIMM"] = "1"
    command = ["bash", "scripts/test.sh", *args]
    proc = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=120)
    ran = (where / "ran").read_text().splitlines() if (where / "ran").exists() else []
    mpiexecs = [line.split()[0] for line in ran if " -n 4 " in line and "--only-mpi" in line]
    return proc.returncode, proc.stdout + proc.stderr, mpiexecs


BOTH = [".venv-torch211", ".venv-torch211", ".venv-timm", ".venv-timm"]
LOW_ONLY = [".venv-torch211", ".venv-torch211", ".venv", ".venv"]


@pytest.mark.parametrize(
    "free_gib, expected, swapped",
    [
        (20, BOTH, False),  # both fit: installed one after the other while the serial tests run
        (12, BOTH, True),  # one at a time: the low end's goes once its tests ran, the high end's installs
        (9.2, BOTH, True),  # 4.6 GiB left, and 4.6 more once .venv-torch211 goes: just enough
        (8.5, LOW_ONLY, False),  # the high end's never fits: nothing removed for it
        (5, [".venv", ".venv"], False),  # neither
    ],
)
def test_each_environment_the_disk_holds_runs_its_sections(tmp_path, free_gib, expected, swapped) -> None:
    where = scratch(tmp_path)
    rc, out, ran = run_ci(where, int(free_gib * GIB))
    assert rc == 0, out
    assert ran == expected, out
    assert ("removing .venv-torch211" in out) == swapped, out
    assert ("removing .venv-timm" in out) == swapped, out  # the next run starts as this one did
    assert (where / ".venv-timm").exists() == (expected == BOTH and not swapped)
    if expected[-1] == ".venv":
        assert "== NOT TESTED at that end:" in out and "its install needs about" in out, out


def test_a_disk_of_one_at_a_time_tests_both_ends_on_every_run(tmp_path: Path) -> None:
    """A developer's .venv-torch211 from before, no .venv-timm, 6 GiB free: neither end is lost."""
    where = scratch(tmp_path)
    subprocess.run(["bash", "stub_setup.sh", ".venv-torch211", str(KEEPS[".venv-torch211"])], cwd=where, check=True)
    base = int(6 * GIB) + KEEPS[".venv-torch211"]  # 6 GiB free with it there
    for _ in range(2):
        rc, out, ran = run_ci(where, base)
        assert rc == 0 and ran == BOTH, out
        assert "removing .venv-torch211" in out and "removing .venv-timm" in out, out


def test_an_install_the_disk_cannot_finish_is_removed_and_its_sections_run_on_venv(tmp_path: Path) -> None:
    where = scratch(tmp_path)
    rc, out, ran = run_ci(where, 20 * GIB, fail=".venv-timm:nospace")
    assert rc == 0, out
    assert ran == LOW_ONLY, out
    # tried again once .venv-torch211 made room, then given up
    assert out.count(".venv-timm did not fit on the disk") == 2 and "removing .venv-torch211" in out, out
    assert not (where / ".venv-timm").exists()


@pytest.mark.parametrize(
    "env, free_gib, ran_before",
    [
        (".venv-torch211", 20, []),  # at the wait after the serial tests: nothing at 4 ranks ran
        (".venv-timm", 20, [".venv-torch211"] * 2),  # its first try: at the wait after torch 2.11's tests
        (".venv-timm", 12, [".venv-torch211"] * 2),  # its second, once torch 2.11's made room: at the end
    ],
)
def test_an_install_that_fails_for_another_reason_fails_the_run(tmp_path, env, free_gib, ran_before) -> None:
    where = scratch(tmp_path)
    rc, out, ran = run_ci(where, free_gib * GIB, fail=f"{env}:other")
    assert rc == 1, out
    assert f"{env} failed to install (not for want of disk)" in out and "No matching distribution" in out
    assert "== torch 2.15.0" not in out and "NOT TESTED" not in out
    assert ran == ran_before, out
    assert ("== mpiexec -n 18" in out) == (free_gib == 12), out
    time.sleep(1.5)  # nothing the run started goes on installing after it
    assert not (where / ".ci-logs" / "ready.venv-timm").exists(), out


def test_an_environment_that_fails_to_update_is_left_as_it_was(tmp_path: Path) -> None:
    where = scratch(tmp_path)
    subprocess.run(["bash", "stub_setup.sh", ".venv-torch211", "7"], cwd=where, check=True)
    rc, out, ran = run_ci(where, 20 * GIB, fail=".venv-torch211:other")
    assert rc == 1 and ran == [], out
    assert (where / ".venv-torch211" / "bin" / "python").exists()  # not removed: a pin or the network


def test_what_an_earlier_run_marked_is_not_read_as_this_ones(tmp_path: Path) -> None:
    where = scratch(tmp_path)
    (where / ".ci-logs").mkdir()
    (where / ".ci-logs" / "broken").write_text(".venv-timm failed to install (not for want of disk)\n")
    (where / ".ci-logs" / "ready.venv-timm").write_text("")
    subprocess.run(["bash", "stub_setup.sh", ".venv-timm", "7"], cwd=where, check=True)
    rc, out, ran = run_ci(where, 20 * GIB, skip_timm=True)  # .venv-timm is there, but not for this run
    assert rc == 0 and ran == LOW_ONLY, out
    assert "NOT TESTED at that end: OPTIMUS2D_SKIP_TIMM=1" in out


def test_a_run_that_stopped_after_making_room_leaves_the_next_one_both_ends(tmp_path: Path) -> None:
    """One at a time, a test at 4 ranks on torch 2.15 fails: .venv-timm stays; the next run removes it."""
    where = scratch(tmp_path)
    base = 12 * GIB
    rc, out, ran = run_ci(where, base, mpi_fail=".venv-timm")
    assert rc != 0 and ran == [".venv-torch211", ".venv-torch211", ".venv-timm"], out
    assert (where / ".venv-timm").exists() and not (where / ".venv-torch211").exists()
    rc, out, ran = run_ci(where, base)
    assert rc == 0 and ran == BOTH, out
    assert "removing .venv-timm (left by a run that stopped) to make room for .venv-torch211" in out


def test_a_users_selection_joins_each_sections_own(tmp_path: Path) -> None:
    """pytest keeps the last -k and -m it is given: the user's must narrow a section's, not replace it."""
    where = scratch(tmp_path)
    rc, out, _ = run_ci(where, 20 * GIB, args=("-k=linear", "-mnot slow", "-x"))
    assert rc == 0, out
    runs = [line for line in (where / "ran").read_text().splitlines() if line.startswith(".venv ")]
    serial = [line for line in runs if "--only-mpi" not in line]
    assert serial == [".venv -m pytest -q -m (not slow) -k (linear) -x"], runs
    at_18 = [line for line in runs if " -n 18 " in line]
    assert at_18 and "-k (refuses or lanes or 1F1B-sum or ZBVZeroBubble-sum) and (linear)" in at_18[0], runs
    at_8 = [line for line in runs if " -n 8 " in line and "-m (not families)" in line]
    assert at_8 and "-k ((not (GPipe or" in at_8[0] and "DualPipeV) or test_pipeline_layouts_mpi" in at_8[0], runs
    assert "and (linear)" in at_8[0] and "--deselect" in at_8[0], runs
    for line in runs:  # every .venv run: the user's both, after the section's own, and its other argument
        assert line.endswith("-x") or "-x " in line, line
        assert ("-m " in line and "and (not slow)" in line) or "-m (not slow)" in line, line
        assert " and (linear)" in line or "-k (linear)" in line, line


@pytest.mark.parametrize("args, rc", [((), 5), (("-k", "linear"), 0)])
def test_a_section_with_none_of_the_tests_a_user_selects_passes(tmp_path, args, rc) -> None:
    """pytest's "no tests ran" (exit code 5): with the user's selection, a section that holds none of
    its tests; without one, a section that selects nothing, a fault of the script."""
    where = scratch(tmp_path)
    got, out, _ = run_ci(where, 20 * GIB, args=args, none_in=".venv")
    assert got == rc, out
    assert ("none of this section's tests is selected" in out) == (rc == 0), out
