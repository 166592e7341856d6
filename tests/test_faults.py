"""Faults under real launchers: a rank that dies or raises mid-step ends the whole job, fast.

Each case starts its own 4-rank job running ``tests/scripts/step_fault.py``: under ``mpiexec``
and ``torchrun``, which end the other ranks themselves once one fails, and as 4 processes started
the way ``srun`` starts them, where nothing but optimus2d ends them. Asserted from outside: every
surviving rank's process exits non-zero within 2× the collective timeout (+ 10 s to exit) of a
SIGKILL; after an uncaught exception (reported to the peers through the store) the timeout is
60 s and every rank exits within 20 s, the error named: the report ended them, not a wait.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_launch import BIN, _clean_env, _free_port

SCRIPT = str(Path(__file__).parent / "scripts" / "step_fault.py")
TIMEOUT_S = 6.0  # for a kill: the peers wait it out
REPORT_TIMEOUT_S = 60.0  # for a raise: far longer than the report takes
_EXIT_S = 10.0  # a process exits, 4 of them on 2 cores


def _timeout(mode: str) -> str:
    return str(TIMEOUT_S if mode == "kill" else REPORT_TIMEOUT_S)


def _launch(launcher: str, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    if launcher == "mpiexec":
        cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, SCRIPT, mode, _timeout(mode)]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4", SCRIPT, mode, _timeout(mode)]
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=120)
    return out, time.time()


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_a_rank_that_fails_mid_step_ends_the_job(launcher, mode):
    out, ended = _launch(launcher, mode)
    text = out.stdout + out.stderr
    entered = [float(t) for t in re.findall(r"entering step at ([\d.]+)", out.stdout)]
    assert len(entered) == 4, text[-3000:]
    assert out.returncode != 0, text[-3000:]
    assert "finished: no error" not in out.stdout, text[-3000:]
    took = ended - max(entered)
    if mode == "kill":  # the peers wait out the timeout (or the launcher ends them first)
        assert took < 2 * TIMEOUT_S + _EXIT_S, f"{took:.1f} s after the kill\n{text[-3000:]}"
    else:  # reported through the store: the peers stop within a fraction of a second
        assert took < REPORT_TIMEOUT_S / 3, f"{took:.1f} s after the error\n{text[-3000:]}"
        assert "rank 1's batch was corrupt" in text


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_with_no_launcher_to_end_them_the_peers_end_themselves(mode):
    port, n = str(_free_port()), 4
    env = {"SLURM_NTASKS": str(n), "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, mode, _timeout(mode)],
            env=_clean_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    outputs, ended = {}, {}
    deadline = time.time() + 120
    while len(ended) < 4 and time.time() < deadline:
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.time()
                outputs[rank] = proc.communicate()
        time.sleep(0.05)
    for proc in procs:
        proc.kill()
    assert len(ended) == 4, f"ranks {sorted(set(range(4)) - set(ended))} still ran after 120 s"
    entered = [float(re.search(r"entering step at ([\d.]+)", outputs[r][0]).group(1)) for r in range(4)]
    for rank in (0, 2, 3):
        out, err = outputs[rank]
        took = ended[rank] - max(entered)
        assert procs[rank].returncode != 0 and "finished: no error" not in out, err[-2000:]
        if mode == "kill":  # gloo sees the connection close, or the waits time out, or a peer reports either
            assert took < 2 * TIMEOUT_S + _EXIT_S, f"rank {rank}: {took:.1f} s after the kill\n{err[-2000:]}"
            assert re.search(r"TimeoutError|PeerFailedError|Connection (reset|closed)", err), err[-2000:]
        else:
            assert took < REPORT_TIMEOUT_S / 3, f"rank {rank}: {took:.1f} s after the error\n{err[-2000:]}"
            assert "PeerFailedError" in err and "rank 1: ValueError: rank 1's batch was corrupt" in err, err[-2000:]
