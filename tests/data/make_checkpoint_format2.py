"""How checkpoint-format2/ and checkpoint-format2.expected.pt were written, with optimus2d at 4450c34
(the last commit whose checkpoint.save wrote format 2), from the repository root:

    mpiexec -n 4 python tests/data/make_checkpoint_format2.py

Tiny (a padded vocabulary, a fused q/k/v) on 2×2 after two AdamW steps; the expected file holds the
serial state dict, ``checkpoint.read``'s result, and the losses of two more steps. Kept to show what
the files are; today's checkpoint.save writes format 3.
"""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, "tests")
import test_checkpoint_mpi as T

import optimus2d
from optimus2d import checkpoint, serial_state_dict

optimus2d.init()
mesh = optimus2d.Mesh(2, 1)
model = T._parallel(0, mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
T._train(model, opt, mesh, range(2))
path = "tests/data/checkpoint-format2"
checkpoint.save(path, model, opt)
state = serial_state_dict(model)
losses = T._train(model, opt, mesh, range(2, 4))
if dist.get_rank() == 0:
    expected = {"model": state, "read": checkpoint.read(path), "losses": losses}
    torch.save(expected, "tests/data/checkpoint-format2.expected.pt")
