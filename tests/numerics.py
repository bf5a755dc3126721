"""Float comparisons that hold on any CPU.

Two summation orders (micro-batches, packing, ranks, the CPU's vector width) give fp32 results that agree
to a few ulps of the values' *own magnitude*, never bit for bit: one ulp at 20 is 1.9e-6, so an absolute
1e-6 on a loss of 20 asserts bit-equality. Every tolerance here is relative: element-wise, plus the same
fraction of the largest magnitude in the tensor for elements near zero (whose absolute error follows the
sums they came from, not their own size).
"""

from __future__ import annotations

import torch

FP32_RTOL = 1e-5  # ~80 ulps: the spread of fp32 sums over thousands of terms in another order
BF16_RTOL = 1e-4  # bf16 parameters, fp32 reduction: only the order of the fp32 sums differs


def assert_close(got: torch.Tensor, expected: torch.Tensor, rtol: float = FP32_RTOL, what: str = "") -> None:
    got, expected = got.double(), expected.double()
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    diff = float((got - expected).abs().max()) if expected.numel() else 0.0
    assert torch.allclose(got, expected, rtol=rtol, atol=rtol * scale), (
        f"{what}: max difference {diff:.3g} at scale {scale:.3g} (rtol {rtol:g})"
    )


def assert_all_close(got: dict, expected: dict, rtol: float = FP32_RTOL, what: str = "") -> None:
    """:func:`assert_close` for every tensor of two dicts with the same keys."""
    assert got.keys() == expected.keys(), f"{what}: {sorted(got)} != {sorted(expected)}"
    for name in expected:
        assert_close(got[name], expected[name], rtol, f"{what} {name}".strip())
