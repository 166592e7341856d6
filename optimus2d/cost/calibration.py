"""The ``Hardware`` of this machine, measured in about a second and cached (``plan="auto"``'s costs).

``hardware(mesh)``: every rank of the mesh measures at once (so that ranks sharing cores or links
see each other): the flop rate of a 1024×1024 fp32 matmul on 1024 rows (the slowest rank's: a
step waits for it), and over the mesh's own collectives an all-reduce of 16 and of 2^20 elements:
the small one's time is the latency (per log₂ p stage), the difference the bandwidth (ring
all-reduce moves 2(p − 1)/p of the payload); the same over torch's own process group of the mesh,
which carries DTensor's collectives (a 1D layout's: ``Hardware.torch_link``), where the mesh's
transport is another (MPI). The medians of 5 runs, combined over the ranks (one
all-reduce). Cached as JSON in ``$OPTIMUS2D_CACHE`` (default ``~/.cache/optimus2d``), keyed by the
host, the mesh's size and transport, the device, the threads a rank and torch's version: rank 0
of the mesh reads it and broadcasts what it found, so the ranks agree on one ``Hardware`` (one
broadcast of 6 words). ``refresh=True`` measures again.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from pathlib import Path

import torch

from optimus2d.comm import primitives as P
from optimus2d.comm.mesh import Mesh
from optimus2d.cost.planner import Hardware

__all__ = ["cache_path", "hardware", "time_step"]


def cache_path() -> Path:
    """The cache file: ``$OPTIMUS2D_CACHE/hardware.json`` (default ``~/.cache/optimus2d``)."""
    root = os.environ.get("OPTIMUS2D_CACHE") or Path.home() / ".cache" / "optimus2d"
    return Path(root) / "hardware.json"


def _key(mesh: Mesh) -> str:
    device = mesh.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    threads = torch.get_num_threads()
    return f"{socket.gethostname()}|p={mesh.size}|{mesh.transport}|{name}|threads={threads}|{torch.__version__}"


def _median_s(fn, device: torch.device, runs: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_step(step, mesh: Mesh, runs: int = 3) -> float:
    """Seconds of ``step()`` over ``mesh``: one warm-up, then the median of ``runs``, each started
    together (a 1-element all-reduce before it); the slowest rank's, so every rank returns the same
    number. Collective over the mesh."""
    step()
    start_together = torch.zeros(1, device=mesh.device)
    times = []
    for _ in range(runs):
        if mesh.size > 1:
            P.all_reduce(start_together, mesh, "mesh")
        if mesh.device.type == "cuda":
            torch.cuda.synchronize(mesh.device)
        start = time.perf_counter()
        step()
        if mesh.device.type == "cuda":
            torch.cuda.synchronize(mesh.device)
        times.append(time.perf_counter() - start)
    seconds = torch.tensor([statistics.median(times)], dtype=torch.float64, device=mesh.device)
    if mesh.size > 1:
        P.all_reduce_max(seconds, mesh, "mesh")
    return seconds.item()


def _measure(mesh: Mesh) -> list[float]:
    """[flops, bandwidth, latency, torch's bandwidth, torch's latency] on this rank (its own measurement)."""
    device = mesh.device
    a, b = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    flops = 2.0 * 1024**3 / _median_s(lambda: a @ b, device)
    if mesh.size == 1:
        return [flops, 1e12, 0.0, 1e12, 0.0]
    link = _link(mesh, lambda t: P.all_reduce(t, mesh, "mesh"))
    if mesh.mpi is None:  # the mesh's collectives are torch's own
        return [flops, *link, *link]
    return [flops, *link, *_link(mesh, lambda t: P.all_reduce_group(t, mesh, mesh.group("mesh"), "torch"))]


def _link(mesh: Mesh, all_reduce) -> list[float]:
    """[bandwidth, latency] of ``all_reduce(tensor)`` over the mesh's ranks: of 16 and 2^20 elements."""
    small, big = torch.zeros(16, device=mesh.device), torch.zeros(2**20, device=mesh.device)
    t_small = _median_s(lambda: all_reduce(small), mesh.device)
    t_big = _median_s(lambda: all_reduce(big), mesh.device)
    p = mesh.size
    bandwidth = 2 * (p - 1) / p * big.numel() * 4 / max(t_big - t_small, 1e-9)
    return [bandwidth, t_small / math.log2(max(p, 2))]


def hardware(mesh: Mesh, *, cache: bool = True, refresh: bool = False) -> Hardware:
    """This machine's ``Hardware`` for layouts over ``mesh``'s ranks (module docstring). Collective
    over the mesh: every rank calls it at the same point."""
    key, path = _key(mesh), cache_path()
    found = None
    if cache and not refresh and mesh.ranks.index(mesh.rank) == 0:
        found = _cached(path, key)  # None where absent, edited or damaged: measured again
    words = torch.tensor([1.0, *found] if found else [0.0] * 6, dtype=torch.float64)
    if mesh.size > 1:  # rank 0's cache, or nothing, on every rank
        words = words.to(mesh.device)
        P.broadcast(words, mesh, "mesh", 0)
        words = words.cpu()
    if words[0] == 0:
        mine = torch.tensor(_measure(mesh), dtype=torch.float64)
        if mesh.size > 1:  # the slowest rank's flop rate, the mean links
            slowest = torch.tensor([1.0 / mine[0]], dtype=torch.float64, device=mesh.device)
            P.all_reduce_max(slowest, mesh, "mesh")
            link = mine[1:].to(mesh.device)
            P.all_reduce(link, mesh, "mesh")
            mine = torch.tensor([1.0 / slowest.item(), *(link.cpu() / mesh.size).tolist()], dtype=torch.float64)
        words = torch.cat([torch.ones(1, dtype=torch.float64), mine.double()])
        if cache and mesh.ranks.index(mesh.rank) == 0:
            _store(path, key, words[1:].tolist())
    flops, bandwidth, latency, *torch_link = words[1:].tolist()
    if mesh.mpi is None:  # torch carries the mesh: one link (its two averages may differ in the last bit)
        torch_link = (bandwidth, latency)
    return Hardware(flops, bandwidth, latency, bytes_per_element=4, torch_link=tuple(torch_link))


def _cached(path: Path, key: str) -> list[float] | None:
    """The cache file's 5 words for ``key``, or None where it has none that fit (absent, an older
    release's 3 words, edited, damaged): read on one rank before the broadcast, so it never raises."""
    try:
        found = json.loads(path.read_text()).get(key)
        if not (isinstance(found, list) and len(found) == 5):
            return None
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in found):
            return None
        found = [float(v) for v in found]  # an integer past float's range: OverflowError, below
    except (OSError, ValueError, AttributeError, TypeError, OverflowError):
        return None
    if not all(math.isfinite(v) and v >= 0 for v in found) or min(found[0], found[1], found[3]) <= 0:
        return None
    return found


def _store(path: Path, key: str, values: list[float]) -> None:
    """Add ``key`` to the cache file, atomically (a rename), keeping what else it holds (a file that
    is not a table of entries is replaced). Never raises: rank 0 alone writes, after the others
    have gone on."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        if not isinstance(table, dict):
            table = {}
        table[key] = values
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):  # a read-only home: measured again next time
        pass
