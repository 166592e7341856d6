"""Serial tests run under plain pytest; tests marked ``mpi`` run under
``mpiexec -n N python -m pytest --only-mpi``, N = 1, 4, 8, 9 (or 16, 18: the pipelines), and adapt to N.

Under MPI: one report (rank 0's), and a failure on any rank aborts the whole job at once instead
of leaving the other ranks waiting in a collective.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from optimus2d.launch import yield_when_oversubscribed

# Before MPI starts (pytest_configure below imports mpi4py): with more ranks than cores, MPICH's own
# blocking calls sleep instead of spinning (optimus2d.init() does the same where it starts MPI)
yield_when_oversubscribed()


def _under_mpi(config) -> bool:
    return bool(config.getoption("--only-mpi", False) or config.getoption("--with-mpi", False))


def _world_size(config) -> int:
    if not _under_mpi(config):
        return 1
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def mesh_shapes(world: int) -> list[tuple[int, int]]:
    """Every (q, depth) with depth·q² = world."""
    return [(q, world // (q * q)) for q in range(1, math.isqrt(world) + 1) if world % (q * q) == 0]


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if _under_mpi(config):
        from mpi4py import MPI

        for plugin in config.pluginmanager.get_plugins():  # keep pytest-mpi's skips, drop its long footer
            if type(plugin).__name__ == "MPIPlugin":
                plugin._is_testing_mpi = False
        if MPI.COMM_WORLD.Get_rank() != 0:
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                config.pluginmanager.unregister(reporter)


def pytest_report_header(config):
    if _under_mpi(config):
        from mpi4py import MPI

        return f"MPI: {MPI.COMM_WORLD.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0]}"
    return None


def pytest_generate_tests(metafunc):
    if "mesh_shape" in metafunc.fixturenames:
        shapes = mesh_shapes(_world_size(metafunc.config))
        promised = getattr(metafunc.module, "PROMISED_MESHES_ONLY", False)  # a module's heavy tests (DCP)
        if promised or metafunc.definition.get_closest_marker("families"):  # the meshes the families promise:
            shapes = [(q, d) for q, d in shapes if q > 1 or d <= 4]  # 1, 2×2, 2×2×2, 3×3 (and 1×1×4)
        elif (1, 9) in shapes:  # 1×1×9 proves nothing 1×1×4 and 1×1×8 do not, and CI's 9 ranks share
            shapes.remove((1, 9))  # 2 cores (the tests that pair 3×3 with 1×1×9 still build both)
        metafunc.parametrize("mesh_shape", shapes, ids=[f"q{q}d{d}" for q, d in shapes])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _under_mpi(item.config):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() > 1:
            sys.stderr.write(f"\n[rank {comm.Get_rank()}] {report.nodeid} FAILED\n{report.longreprtext}\n")
            sys.stderr.flush()
            comm.Abort(1)


@pytest.fixture(scope="session")
def world():
    import optimus2d

    torch.set_num_threads(1)
    return optimus2d.init(timeout=120)


_meshes: dict = {}


def meshes_of(world) -> list:
    """A Mesh of every shape of the world (``mesh_shapes``), each built once per session (collectively)."""
    import optimus2d

    for shape in mesh_shapes(world.size):
        if shape not in _meshes:
            _meshes[shape] = optimus2d.Mesh(*shape)
    return [_meshes[shape] for shape in mesh_shapes(world.size)]


@pytest.fixture
def mesh(world, mesh_shape):
    """The mesh of shape (q, depth) over all ranks, built once per session (collectively)."""
    import optimus2d

    if mesh_shape not in _meshes:
        _meshes[mesh_shape] = optimus2d.Mesh(*mesh_shape)
    return _meshes[mesh_shape]


@pytest.fixture
def shared_dir(world):
    """A fresh directory every rank sees (rank 0 makes it, and removes it once every rank is done:
    a barrier over the world, so a test using it must end on every rank alike, as tests here do)."""
    import shutil
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="optimus2d-test-") if world.rank == 0 else None]
    if world.size > 1:
        dist.broadcast_object_list(box, src=0)
    yield box[0]
    if world.size > 1:
        dist.barrier()
    if world.rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)


@pytest.fixture
def world_mesh(world):
    """A fresh mesh over the whole world (the squarest shape), or a skip on one rank: for tests in
    which one rank disagrees (a refusal may leave its mesh unusable, so none is shared)."""
    import math

    import optimus2d

    if world.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    if world.size == 9:  # CI's 9 ranks on 2 cores: each test's own mesh costs seconds there, once the
        # session holds hundreds of groups; the refusals are proved at 4 (MPI, gloo, both torch ends)
        pytest.skip("refusals run at 4 ranks: at 9 the meshes these tests build cost minutes")
    q = math.isqrt(world.size)
    while world.size % (q * q):
        q -= 1
    return optimus2d.Mesh(q, world.size // (q * q))
