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
