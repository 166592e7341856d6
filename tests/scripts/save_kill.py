"""Started by tests/test_checkpoint_faults.py on 4 ranks: a rank killed while saving over a checkpoint.

usage: save_kill.py DIRECTORY TIMEOUT_S MODE

Saves checkpoint A to DIRECTORY/ckpt (rank 0 also writes what ``read`` gives then to
DIRECTORY/a.pt, and A's serial state dict to DIRECTORY/a_state.pt), takes an optimizer step, and
saves B over A, during which one rank SIGKILLs itself, first writing the time to
DIRECTORY/killed_at:

* MODE "write": rank 1, after writing the first item of its shard file (the file half written);
* MODE "commit": rank 0, between the commit's two renames (A moved aside, B not yet in place);
* MODE "fail" / "async-fail": rank 1 does not die but raises in DCP's ``save`` (``async_save``)
  before DCP's first collective; B is saved by ``checkpoint.save`` (``async_save(...).result()``).
* MODE "stages-fail": as "fail", for a pipeline of 2 stages (ranks 0-1: the first Linear and the
  GELU on a 1×1×2 mesh, ranks 2-3: the second Linear) saved by ``save_stages``.

Every rank prints a line when it reaches save B and when save B returns or raises.
"""

import os
import signal
import sys
import time
from collections import OrderedDict

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch import nn

import optimus2d
from optimus2d import checkpoint
from optimus2d.checkpoint.files import PREVIOUS

directory, timeout, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
path = os.path.join(directory, "ckpt")
torch.set_num_threads(1)
world = optimus2d.init(timeout=timeout)
torch.manual_seed(0)
serial = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
if mode == "stages-fail":
    from optimus2d.checkpoint.stages import save_stages
    from optimus2d.pipeline import stage_meshes

    pipe = stage_meshes(2, 1, 2)
    mesh, features = pipe.mesh, (16, 32)[pipe.stage]
    held = {"0": serial[0], "1": serial[1]} if pipe.stage == 0 else {"2": serial[2]}
    model = optimus2d.parallelize(nn.Sequential(OrderedDict(held)), mesh)

    def save(path, model, opt):
        save_stages(path, model, opt)
else:
    mesh, features = optimus2d.Mesh(q=2), 16
    model = optimus2d.parallelize(serial, mesh)
    save = checkpoint.save
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)


def step() -> None:
    opt.zero_grad()
    model(optimus2d.scatter(torch.randn(8, 5, features), mesh)).square().mean().backward()
    opt.step()


def note_time() -> None:
    with open(os.path.join(directory, "killed_at"), "w") as f:
        f.write(repr(time.time()))
        f.flush()
        os.fsync(f.fileno())


def die() -> None:
    note_time()
    print(f"rank {world.rank}: killing itself ({mode})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def fail(*args, **kwargs):
    note_time()
    raise RuntimeError(f"rank {world.rank} cannot write ({mode})")


step()
save(path, model, opt)
state_a = optimus2d.serial_state_dict(model)
if world.rank == 0:
    read_a = checkpoint.read(path)
    torch.save(read_a, os.path.join(directory, "a.pt"))
    torch.save(read_a["model"] if mode == "stages-fail" else state_a, os.path.join(directory, "a_state.pt"))
step()

if mode == "write" and world.rank == 1:
    real_write_item = dcp_filesystem._write_item

    def write_item_then_die(transforms, stream, data, *args, **kwargs):
        result = real_write_item(transforms, stream, data, *args, **kwargs)
        stream.flush()
        die()
        return result

    dcp_filesystem._write_item = write_item_then_die
elif mode == "commit" and world.rank == 0:
    real_rename = os.rename

    def rename_then_die(src, dst):
        real_rename(src, dst)
        if os.fspath(dst) == path + PREVIOUS:
            die()

    os.rename = rename_then_die

elif mode in ("fail", "async-fail", "stages-fail") and world.rank == 1:
    setattr(dcp, "async_save" if mode == "async-fail" else "save", fail)

print(f"rank {world.rank}: saving B", flush=True)
start = time.monotonic()
try:
    if mode == "async-fail":
        checkpoint.async_save(path, model, opt).result()
    else:
        save(path, model, opt)
except BaseException as err:  # DCP's CheckpointException is a BaseException
    first = (str(err).strip().splitlines() or [""])[0][:300]
    print(f"rank {world.rank}: save B raised after {time.monotonic() - start:.1f}s: {type(err).__name__}: {first}")
    sys.stdout.flush()
    raise
print(f"rank {world.rank}: save B returned", flush=True)
