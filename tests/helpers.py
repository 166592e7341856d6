"""Shared test helpers: comparisons against serial torch, made the same way on every rank."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero), computed in fp64."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale else diff


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5, what: str = "") -> None:
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def assert_state_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert list(got) == list(want), f"keys {list(got)} != {list(want)}"
    for key in want:
        assert_close(got[key], want[key], tol, key)


def step_both(serial, parallel, x, mesh, lr=0.1, optimizer=torch.optim.SGD):
    """fwd+bwd+optimizer step of a serial module and its 2D twin on the same full input.

    Returns (output gathered, serial output, input grad gathered, serial input grad). The loss
    weighs every output element differently, so a misplaced block cannot cancel out.
    """
    from optimus2d import gather, scatter

    x_serial = x.clone().requires_grad_()
    y_serial = serial(x_serial)
    torch.manual_seed(2)
    probe = torch.randn_like(y_serial)
    (y_serial * probe).sum().backward()
    optimizer(serial.parameters(), lr=lr).step()

    x_full = x.clone().requires_grad_()
    y_local = parallel(scatter(x_full, mesh))
    (y_local * scatter(probe, mesh)).sum().backward()
    optimizer(parallel.parameters(), lr=lr).step()
    # x_full.grad: scatter's backward gathered every rank's block into the full gradient
    return gather(y_local.detach(), mesh), y_serial, x_full.grad, x_serial.grad


def check_against_serial(serial, parallel, x, mesh, tol=1e-5, optimizer=torch.optim.SGD):
    """Outputs, input gradients and parameters after one step, all within ``tol``."""
    from optimus2d import serial_state_dict

    y, y_ref, dx, dx_ref = step_both(serial, parallel, x, mesh, optimizer=optimizer)
    state = serial_state_dict(parallel)
    assert_close(y, y_ref, tol, "output")
    assert_close(dx, dx_ref, tol, "input grad")
    assert_state_close(state, serial.state_dict(), tol)
