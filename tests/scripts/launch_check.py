"""Started by tests/test_launch.py under each launcher: init, then one real check.

modes: "check" (a Linear2D on the largest mesh that fits, against nn.Linear), "stall" (rank 1
never joins a collective: rank 0 must get an error within the timeout), "existing" (the process
group is created first by the user's own code), "hold" (as "check", then up to 60 s more, until the
file $LAUNCH_CHECK_RELEASE exists: the store stays up), "restart" (as "check", then shutdown(), init()
and an all-reduce again).
"""

import math
import os
import sys
import time

import torch
import torch.distributed as dist

import optimus2d

mode = sys.argv[1] if len(sys.argv) > 1 else "check"
torch.set_num_threads(1)
if mode == "existing":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 60
world = optimus2d.init(timeout=timeout)
again = optimus2d.init()  # idempotent: the same World (a second call said local_rank 0, "existing", under mpiexec)
assert again == world, (again, world)

if mode == "stall":
    if world.rank == 1:
        time.sleep(30)
        sys.exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        print("no error", flush=True)
    except Exception as err:
        print(f"raised after {time.monotonic() - start:.1f}s: {type(err).__name__}", flush=True)
    sys.exit(0)

q = math.isqrt(world.size)
while world.size % (q * q):
    q -= 1
mesh = optimus2d.Mesh(q, depth=world.size // (q * q))
torch.manual_seed(0)
serial = torch.nn.Linear(6 * q, 4 * q)
layer = optimus2d.layers.Linear2D.from_serial(serial, mesh)
x = torch.randn(2 * world.size, 3, 6 * q)
y = optimus2d.gather(layer(optimus2d.scatter(x, mesh)), mesh)
err = ((y - serial(x)).abs().max() / serial(x).abs().max()).item()
assert err < 1e-5, err
yielding = os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "unset")  # set by init() where ranks outnumber cores
line = f"ok launcher={world.launcher} rank={world.rank} size={world.size} local={world.local_rank} {mesh}"
shared = optimus2d.comm.watch._shared_cores  # set by init(): more ranks on this node than cores
# one write: mpiexec interleaves the ranks' writes
sys.stdout.write(f"{line} heavy_yield={yielding} shared_cores={shared}\n")
sys.stdout.flush()
if mode == "hold":
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["LAUNCH_CHECK_RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.1)
if mode == "restart":
    optimus2d.shutdown()
    world = optimus2d.init(timeout=timeout)
    total = torch.ones(1) * (world.rank + 1)
    dist.all_reduce(total)
    assert total.item() == world.size * (world.size + 1) / 2, total
    sys.stdout.write(f"ok again launcher={world.launcher} rank={world.rank}\n")
    sys.stdout.flush()
