"""Comparing parallel runs with the single-process reference."""

from __future__ import annotations

import torch


def assert_params_close(
    params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float = 1e-5
) -> None:
    """Every tensor within `rtol` relative (Frobenius norm) of the reference.

    Relative in norm, not per element: Adam divides each update by sqrt(v), so an element whose
    gradient is at float-noise level turns reduction-order noise (different for each dp) into an
    update of up to lr; the tensor as a whole stays within 1e-7..1e-6 of the reference. The
    element-wise absolute check (1e-4, 0.5 % of the 0.02 init scale) still catches any element
    that really diverged.
    """
    assert set(params) == set(ref), set(params) ^ set(ref)
    for name, expected in ref.items():
        got = params[name].to(expected.dtype)
        assert got.shape == expected.shape, (
            f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
        )
        rel = float((got - expected).norm() / expected.norm().clamp_min(1e-12))
        assert rel <= rtol, f"{name}: relative difference {rel:.2e} > {rtol:.0e}"
        torch.testing.assert_close(
            got, expected, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
