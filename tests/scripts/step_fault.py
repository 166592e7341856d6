"""Started by tests/test_faults.py on 4 ranks: a training step in which rank 1 fails.

modes: "kill" (rank 1 SIGKILLs itself mid-step: its peers wait in a collective until the timeout),
"raise" (rank 1 raises an uncaught ValueError mid-step: ``init()`` reports it, its peers stop at
once). Every rank prints "rank r entering step at t" (t: time.time()); a rank that survives prints
nothing more: the test reads the exit codes and times from outside.
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import optimus2d

mode, timeout = sys.argv[1], float(sys.argv[2])
torch.set_num_threads(1)
world = optimus2d.init(timeout=timeout)
mesh = optimus2d.Mesh(2)
torch.manual_seed(0)
model = optimus2d.parallelize(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), mesh)
x = optimus2d.scatter(torch.randn(8, 4, 16), mesh)
model(x).square().mean().backward()  # one healthy step
print(f"rank {world.rank} entering step at {time.time():.3f}", flush=True)
if world.rank == 1:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("rank 1's batch was corrupt")
for _ in range(100):  # the peers go on into collectives that rank 1 never joins
    model(x).square().mean().backward()
print(f"rank {world.rank} finished: no error", flush=True)
