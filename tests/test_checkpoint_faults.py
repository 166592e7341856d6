"""A rank SIGKILLed while saving over a checkpoint (tests/scripts/save_kill.py), under mpiexec, torchrun
and no launcher at all: every process ends within 2×timeout of the kill (+ 10 s to exit), and the previous checkpoint
reads back exactly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import optimus2d.launch as launch
from optimus2d import checkpoint
from optimus2d.checkpoint.files import PREVIOUS, SAVING

SCRIPT = str(Path(__file__).parent / "scripts" / "save_kill.py")
BIN = Path(sys.executable).parent
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
TIMEOUT_S = 10.0  # optimus2d.init(timeout=...) in the script
LAUNCHERS = {  # "none": SLURM's variables set by hand, no process watching the ranks (as in test_launch.py)
    "mpiexec": [str(BIN / "mpiexec"), "-n", "4", sys.executable],
    "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4"],
    "none": [],
}


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(launch._MPI_VARS)}
    root = str(Path(__file__).parent.parent)  # the ranks import this checkout's optimus2d, as this process does
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(launcher: str, args: list[str]) -> list[subprocess.Popen]:
    """The launcher's process, or (no launcher: SLURM's variables set by hand) the 4 ranks themselves."""
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if launcher != "none":
        return [subprocess.Popen([*LAUNCHERS[launcher], *args], env=_clean_env(), **popen)]
    port = str(_free_port())
    slurm = dict(SLURM_NTASKS="4", SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=port)
    return [
        subprocess.Popen(
            [sys.executable, *args],
            env={**_clean_env(), **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            **popen,
        )
        for r in range(4)
    ]


def _run_killed_job(launcher: str, mode: str, directory: Path) -> tuple[list[int], str, list[float]]:
    """Run the script's job: the exit codes of its processes, their output, and the seconds from
    the kill to each one's exit (the processes are read one after the other: upper bounds)."""
    procs = _start(launcher, [SCRIPT, str(directory), str(TIMEOUT_S), mode])
    outs, ended, deadline = [], [], time.monotonic() + 90
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"{launcher}: the job did not end within 90 s: {[p.returncode for p in procs]}")
        ended.append(time.time())
    out = "\n".join(outs)
    killed_at = directory / "killed_at"
    assert killed_at.exists(), f"{launcher}: no rank killed itself:\n{out[-4000:]}"
    return [p.returncode for p in procs], out, [t - float(killed_at.read_text()) for t in ended]


def _assert_ended_in_error(launcher: str, rcs: list[int], out: str, after_kill: list[float]) -> None:
    print(f"{launcher}: exit codes {rcs}, {', '.join(f'{t:.1f}' for t in after_kill)} s after the kill")
    assert all(rc != 0 for rc in rcs), f"{launcher}: exit codes {rcs} after a rank was killed:\n{out[-4000:]}"
    assert "save B returned" not in out, out[-4000:]
    assert max(after_kill) < 2 * TIMEOUT_S + 10, f"{launcher}: ended {after_kill} s after the kill:\n{out[-4000:]}"


def _assert_reads_back_a(directory: Path) -> None:
    path = str(directory / "ckpt")
    want, state_a = torch.load(directory / "a.pt"), torch.load(directory / "a_state.pt")
    got = checkpoint.read(path)
    assert set(got["model"]) == set(state_a)
    for key, value in state_a.items():
        assert torch.equal(got["model"][key], value), key
    for pkey, states in want["optimizer"].items():
        assert set(got["optimizer"][pkey]) == set(states)
        for name, value in states.items():
            assert torch.equal(got["optimizer"][pkey][name], value), f"{pkey}/{name}"
    assert got["meta"] == want["meta"]
    loaded = checkpoint.load(path)  # no model: the serial state dict, in this process
    assert all(torch.equal(loaded[k], v) for k, v in state_a.items())


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint(launcher, tmp_path):
    rcs, out, after_kill = _run_killed_job(launcher, "write", tmp_path)
    _assert_ended_in_error(launcher, rcs, out, after_kill)
    _assert_reads_back_a(tmp_path)
    half = str(tmp_path / "ckpt") + SAVING
    assert os.path.isdir(half) and any(f.endswith(".distcp") for f in os.listdir(half)), os.listdir(tmp_path)
    with pytest.raises(ValueError, match=r"optimus2d-saving': it has no manifest\.json, so a save did not finish"):
        checkpoint.read(half)
    serial = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    before = [p.clone() for p in serial.parameters()]
    with pytest.raises(ValueError, match=r"optimus2d-saving': it has no manifest\.json, so a save did not finish"):
        checkpoint.load(half, serial)
    assert all(torch.equal(p, b) for p, b in zip(serial.parameters(), before, strict=True))


@pytest.mark.slow
def test_a_coordinator_killed_between_the_commit_renames_leaves_the_previous_checkpoint(tmp_path):
    rcs, out, after_kill = _run_killed_job("none", "commit", tmp_path)
    _assert_ended_in_error("none", rcs, out, after_kill)
    assert not (tmp_path / "ckpt").exists() and (tmp_path / f"ckpt{PREVIOUS}").is_dir(), os.listdir(tmp_path)
    _assert_reads_back_a(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fail", "async-fail", "stages-fail"])
def test_a_rank_that_fails_before_writing_makes_every_rank_raise(mode, tmp_path):
    """Rank 1 raises in DCP's save (async_save; save_stages' DCP save, in a pipeline of 2 stages)
    before DCP's first collective, so the others wait in it: they time out (DCP and the commit run
    on groups of their own, the commit waiting longer), and every rank raises within 2×timeout; the
    previous checkpoint reads back. No launcher watches the ranks (SLURM's variables set by hand):
    mpiexec and torchrun end the others once one exits, which could hide a rank that would hang."""
    rcs, out, after_fail = _run_killed_job("none", mode, tmp_path)
    _assert_ended_in_error("none", rcs, out, after_fail)
    assert out.count("save B raised") == 4, out[-4000:]
    assert "rank 1 cannot write" in out, out[-4000:]
    _assert_reads_back_a(tmp_path)


_NO_CPU_BACKEND = """
import sys, torch, torch.distributed as dist
from torch import nn
from optimus2d import checkpoint
dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)  # as NCCL's: no CPU backend
torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 4)).sum().backward()
opt.step()
checkpoint.async_save(sys.argv[1], model, opt).result()
other = nn.Linear(4, 4)
other_opt = torch.optim.AdamW(other.parameters())
checkpoint.load(sys.argv[1], other, other_opt)
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
assert torch.equal(other_opt.state[other.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
print("ok")
"""


def test_async_save_where_the_default_group_has_no_cpu_backend(tmp_path):
    """DCP's ``async_save`` refuses a default group without a CPU backend (NCCL alone: a single GPU)
    even where it writes alone; the checkpoint is then written before ``async_save`` returns, and
    loads back exactly (simulated on the CPU: a default group of gloo for cuda tensors alone)."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_CPU_BACKEND, str(tmp_path / "ck")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_save_after_an_async_save_of_a_model_without_a_mesh_waits_for_it(tmp_path):
    """A plain torch.nn model (no Mesh): ``async_save`` then ``save`` to the same path. The second
    did not wait for the first, replaced the directory its background write and commit still used,
    and the two committed each other's half-written files: 5 of 6 checkpoints unreadable, the one
    before them lost, the Future's success false. Now it waits: both commit, in order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters())

    def step():
        optimizer.zero_grad()
        model(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()

    for trial in range(3):
        path = tmp_path / f"c{trial}"
        step()
        checkpoint.save(path, model, optimizer)
        step()
        pending = checkpoint.async_save(path, model, optimizer)
        step()
        latest = {k: v.clone() for k, v in model.state_dict().items()}
        checkpoint.save(path, model, optimizer)
        pending.result()
        read = checkpoint.read(path)["model"]
        assert all(torch.equal(read[k], latest[k]) for k in latest)
        assert sorted(os.listdir(tmp_path)) == [f"c{n}" for n in range(trial + 1)]
