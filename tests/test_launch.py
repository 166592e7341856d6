"""optimus2d.init() under every launcher, each in processes of its own."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import optimus2d.launch as launch

SCRIPT = str(Path(__file__).parent / "scripts" / "launch_check.py")
BIN = Path(sys.executable).parent
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(launch._MPI_VARS)}
    env.pop("MPIR_CVAR_ENABLE_HEAVY_YIELD", None)  # set under mpiexec where ranks outnumber cores
    for name in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        env.pop(name, None)  # how many ranks share the node: each launch says its own
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _slurm(n: int, *args: str, port: int | None = None, **step: str) -> list[subprocess.Popen]:
    """``n`` tasks of an srun step (``step``: more of its variables, such as SLURM_JOB_ID; ``port``:
    its MASTER_PORT, 0 for none: the port of the job and step)."""
    port = _free_port() if port is None else port
    return [
        subprocess.Popen(
            [sys.executable, SCRIPT, *args],
            env=_clean_env(
                SLURM_PROCID=str(r),
                SLURM_NTASKS=str(n),
                SLURM_LOCALID=str(r),
                SLURM_JOB_NODELIST="127.0.0.1",
                SLURM_STEP_TASKS_PER_NODE=str(n),
                **({"MASTER_PORT": str(port)} if port else {}),
                **step,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]


def test_single_process_is_a_world_of_one():
    out = _run([sys.executable, SCRIPT], _clean_env())
    assert out.returncode == 0, out.stderr
    assert "ok launcher=single rank=0 size=1 local=0 Mesh(q=1, depth=1" in out.stdout


def test_adopts_an_existing_process_group():
    out = _run([sys.executable, SCRIPT, "existing"], _clean_env())
    assert out.returncode == 0, out.stderr
    assert "ok launcher=existing" in out.stdout and "shared_cores=False" in out.stdout  # one process


@pytest.mark.slow
def test_torchrun_four_ranks_on_a_2x2_mesh():
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4", SCRIPT]
    out = _run(cmd, _clean_env())
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(4):
        assert f"ok launcher=torchrun rank={r} size=4 local={r} Mesh(q=2, depth=1" in out.stdout
    shared = len(os.sched_getaffinity(0)) < 4  # long waits back off where the ranks outnumber the cores
    assert re.findall(r"shared_cores=(True|False)", out.stdout) == [str(shared)] * 4, out.stdout


@pytest.mark.slow
def test_mpiexec_four_ranks_on_a_2x2_mesh():
    out = _run([str(BIN / "mpiexec"), "-n", "4", sys.executable, SCRIPT], _clean_env())
    assert out.returncode == 0, out.stderr[-3000:]
    yielding = "1" if len(os.sched_getaffinity(0)) < 4 else "unset"  # MPICH sleeps in its waits where oversubscribed
    for r in range(4):
        assert f"ok launcher=mpi rank={r} size=4 local={r} Mesh(q=2, depth=1" in out.stdout
    assert re.findall(r"heavy_yield=(1|unset)", out.stdout) == [yielding] * 4, out.stdout
    assert re.findall(r"shared_cores=(True|False)", out.stdout) == [str(yielding == "1")] * 4, out.stdout


@pytest.mark.slow
def test_slurm_two_tasks_on_a_depth_two_mesh():
    procs = _slurm(2)
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (stdout, stderr)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, stderr[-3000:]
        assert f"ok launcher=slurm rank={r} size=2 local={r} Mesh(q=1, depth=2" in stdout
        assert f"shared_cores={len(os.sched_getaffinity(0)) < 2}" in stdout


@pytest.mark.slow
def test_two_srun_steps_of_one_job_at_once_keep_their_worlds():
    """They had one port (the job's): ranks of each joined the other's store, mixed worlds formed."""
    job = next(
        j for j in range(os.getpid() % 9000, 20000) if all(_port_is_free(20000 + (j * 97 + s) % 20000) for s in (0, 1))
    )
    procs = [p for step in (0, 1) for p in _slurm(2, port=0, SLURM_JOB_ID=str(job), SLURM_STEP_ID=str(step))]
    for r, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        assert f"ok launcher=slurm rank={r % 2} size=2 local={r % 2} Mesh(q=1, depth=2" in stdout


@pytest.mark.slow
def test_a_step_that_reaches_another_steps_store_is_refused_on_every_rank(tmp_path):
    """Two steps given one MASTER_PORT: one step's rank 0 holds it; the other's rank 0 cannot bind
    it, and its rank 1, reaching a store of another step, raises at once (it joined that world)."""
    port, release = _free_port(), tmp_path / "release"
    first = _slurm(2, "hold", "10", port=port, SLURM_JOB_ID="7", SLURM_STEP_ID="0", LAUNCH_CHECK_RELEASE=str(release))
    time.sleep(3)  # its rank 0 holds the port until the second step is done
    second = _slurm(2, "check", "10", port=port, SLURM_JOB_ID="7", SLURM_STEP_ID="1")
    outs = [p.communicate(timeout=120) for p in second]
    release.touch()
    outs = [p.communicate(timeout=120) for p in first] + outs
    assert [p.returncode for p in first] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert all(p.returncode != 0 for p in second)
    assert "reached the store" in outs[3][1] and "job 7, step 0, start 1" in outs[3][1], outs[3][1][-3000:]


@pytest.mark.slow
def test_a_port_that_something_else_holds_is_a_timeout_not_a_hang():
    """torch's store client waited with no limit on a listener that never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        rank0, rank1 = _slurm(2, "check", "3", port=listener.getsockname()[1])  # rank 0 cannot bind it
        start = time.monotonic()
        _, stderr = rank1.communicate(timeout=60)
        rank0.communicate(timeout=60)
    assert rank1.returncode != 0 and "TimeoutError: rank 1: the store of Slurm rank 0" in stderr, stderr[-3000:]
    assert time.monotonic() - start < 30


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_an_srun_step_starts_again_after_shutdown():
    """The World of the first start kept its process group, whose store held the step's port."""
    procs = _slurm(2, "restart", port=0, SLURM_JOB_ID="4711", SLURM_STEP_ID="3")
    for r, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0 and f"ok again launcher=slurm rank={r}" in stdout, stderr[-3000:]


@pytest.mark.slow
def test_a_peer_that_never_joins_gives_an_error_not_a_hang():
    procs = _slurm(2, "stall", "3")
    stdout, stderr = procs[0].communicate(timeout=60)
    procs[1].kill()
    assert "raised after" in stdout, stderr[-3000:]
    seconds = float(stdout.split("raised after ")[1].split("s")[0])
    assert 2.5 <= seconds < 20


def test_mpich_sleeps_in_its_blocking_waits_only_where_ranks_outnumber_cores(monkeypatch, caplog):
    """Beside a few hundred gloo groups MPICH's spinning blocking calls take seconds on shared cores
    (``yield_when_oversubscribed``): init() sets MPICH's sleep-yield there, and nowhere else."""
    parent = os.getppid()
    bound = {0: {0, 1}, parent: {0, 1}}  # pid → its cores (0: this process)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: bound[pid])
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    env = {"MPI_LOCALNRANKS": "8"}
    assert launch.yield_when_oversubscribed(env) and env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    for kept in ({"MPI_LOCALNRANKS": "2"}, {}, {"MPI_LOCALNRANKS": "x"}):  # a core a rank; not MPICH's launcher
        assert not launch.yield_when_oversubscribed(kept) and "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in kept
    for name in ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "MPICH_ENABLE_HEAVY_YIELD", "MPIR_PARAM_ENABLE_HEAVY_YIELD"):
        users = {"MPI_LOCALNRANKS": "8", name: "0"}  # the user's own choice stands, under any of MPICH's names
        assert not launch.yield_when_oversubscribed(users) and users == {"MPI_LOCALNRANKS": "8", name: "0"}
    bound.update({0: {3}, parent: set(range(8))})  # -bind-to core: a core each, the node's 8 for 8 ranks
    pinned = {"MPI_LOCALNRANKS": "8"}
    assert not launch.yield_when_oversubscribed(pinned) and "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in pinned
    bound.update({0: {0, 1}, parent: {0, 1}})
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())  # MPI started: too late to matter, said so
    late = {"MPI_LOCALNRANKS": "8"}
    with caplog.at_level("INFO", logger="optimus2d.launch"):
        assert not launch.yield_when_oversubscribed(late) and "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in late
    assert "8 ranks on 2 cores and MPI started before init()" in caplog.text


def test_each_launcher_says_how_many_ranks_share_the_node(monkeypatch):
    said = launch._node_ranks_said  # a process group made by the caller: the launcher's variables
    assert said({"LOCAL_WORLD_SIZE": "4", "MPI_LOCALNRANKS": "1"}) == 4  # torchrun under mpiexec: torchrun's
    assert said({"MPI_LOCALNRANKS": "8"}) == 8 and said({"OMPI_COMM_WORLD_LOCAL_SIZE": "6"}) == 6
    assert said({}) == 1 and said({"LOCAL_WORLD_SIZE": "x"}) == 1
    slurm = launch._slurm_node_ranks  # srun: the step's tasks on this node
    assert slurm({"SLURM_STEP_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "1"}) == 3
    assert slurm({"SLURM_STEP_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "2"}) == 1
    assert slurm({"SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "8"}) == 2  # the step's, not the job's
    assert slurm({"SLURM_TASKS_PER_NODE": "4,1", "SLURM_NODEID": "1"}) == 1
    assert slurm({}) == 1 and slurm({"SLURM_STEP_TASKS_PER_NODE": "4(y2)"}) == 1
    monkeypatch.setattr(launch, "_usable_cores", lambda: 2)
    assert launch._shares_cores(3) and not launch._shares_cores(2) and not launch._shares_cores(1)
    monkeypatch.undo()
    monkeypatch.delattr(os, "sched_getaffinity")  # not Linux: the cores cannot be read, no backoff
    assert not launch._shares_cores(64)


def test_a_long_wait_on_shared_cores_tests_its_operation_less_often(monkeypatch):
    """On shared cores a wait that has lasted t sleeps t/16 between tests of its operation, from
    50 µs up to 1 ms; with a core a rank, or for an operation that advances only while tested (an
    MPI collective's schedule), always 50 µs (a clock of its own: the sleeps asked for)."""
    from optimus2d.comm import watch

    class Clock:
        def __init__(self) -> None:
            self.now, self.sleeps = 0.0, []

        def monotonic(self) -> float:
            return self.now

        def sleep(self, seconds: float) -> None:
            self.sleeps.append(seconds)
            self.now += seconds

    def sleeps(seconds: float, shared: bool, backoff: bool = True) -> list[float]:
        clock = Clock()
        monkeypatch.setattr(watch, "time", clock)
        monkeypatch.setattr(watch, "_shared_cores", shared)
        watch.wait(lambda: clock.now >= seconds, None, "a test wait", 60.0, backoff=backoff)
        assert seconds <= clock.now <= seconds + max(5e-5, min(1e-3, seconds / 16))  # ends with its operation
        return clock.sleeps

    unshared = sleeps(0.2, shared=False)
    assert set(unshared) == {5e-5} and 3999 <= len(unshared) <= 4001  # 0.2 s in steps of 50 µs
    assert sleeps(0.2, shared=True, backoff=False) == unshared  # an MPI collective's schedule: tested as often
    shared = sleeps(0.2, shared=True)
    assert shared[:16] == [5e-5] * 16 and shared[-1] == 1e-3 and max(shared) == 1e-3
    waited = itertools.accumulate([0.0, *shared[:-1]])  # how long the wait had lasted at each sleep
    assert all(s == max(5e-5, min(1e-3, t / 16)) for s, t in zip(shared, waited, strict=True))
    assert len(shared) <= 260  # about 250 tests, not 4000
    monkeypatch.setattr(watch, "_shared_cores", True)
    monkeypatch.setattr(watch, "_failed", [])  # the timeout reports itself: not this process's record
    with pytest.raises(TimeoutError, match="did not complete within 2 s"):  # the deadline holds, ≤ 1 ms late
        watch.wait(lambda: False, None, "a test wait", 2.0)


def test_detect_launcher(monkeypatch):
    for var in (*LAUNCH_VARS, *launch._MPI_VARS):
        monkeypatch.delenv(var, raising=False)
    assert launch.detect_launcher() == "single"
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert launch.detect_launcher() == "slurm"
    monkeypatch.setenv("PMI_RANK", "0")  # srun --mpi=pmi2 sets both: MPI takes precedence
    assert launch.detect_launcher() == "mpi"
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "h")):
        monkeypatch.setenv(var, value)
    assert launch.detect_launcher() == "torchrun"


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu[07-09,12],cpu1", "gpu07"), ("node12", "node12"), ("a-b[003]", "a-b003"), ("x1,x2", "x1")],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert launch.first_host(nodelist) == host


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "abc"])
def test_a_timeout_that_is_not_positive_is_refused(timeout):
    """torch said "timed out after -1000ms" on every rank, or "within -1 day, 23:59:59"."""
    with pytest.raises(ValueError, match="positive number of seconds" if timeout != "abc" else "could not convert"):
        launch.init(timeout=timeout)
