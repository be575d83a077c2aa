"""Helpers shared by the kernel tests: device choice, dtype cases, NaN-poisoned outputs, relative-RMSE checks.

On a CPU-only machine tests/conftest.py has set TRITON_INTERPRET=1 before any kernel module is imported,
so the same test bodies run the kernels under Triton's interpreter here and natively on the H200.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# fp32 everywhere (the interpreter cannot do bf16 arithmetic); bf16 is the real model dtype, GPU only.
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bfloat16")]


def tolerance(dtype: torch.dtype, fp32: float = 1e-5, low: float = 1e-2) -> float:
    """Relative-RMSE budget: tight for fp32, one or two bf16 ulps' worth for 16-bit dtypes."""
    return fp32 if dtype == torch.float32 else low


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    """Relative RMSE of out against ref must not exceed ratio; any NaN (an unwritten output) fails."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != ref {tuple(ref.shape)}"
    out_f, ref_f = out.detach().float().cpu(), ref.detach().float().cpu()
    assert not torch.isnan(out_f).any(), f"{name}: output holds NaN (a row was never written?)"
    assert not torch.isnan(ref_f).any(), f"{name}: reference holds NaN"
    err = (out_f - ref_f).pow(2).mean().sqrt().item()
    base = ref_f.pow(2).mean().sqrt().item()
    rel = err / max(base, 1e-30)
    assert rel <= ratio, f"{name}: relative RMSE {rel:.3e} > {ratio:.1e} (abs {err:.3e}, ref RMS {base:.3e})"


@contextlib.contextmanager
def poisoned_empty(int_poison: int | None = None) -> Iterator[None]:
    """Inside the block torch.empty / torch.empty_like return NaN-filled float tensors (and, given int_poison,
    integer tensors filled with it), so a kernel output element that is never written shows up (fla's test
    discipline)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def _poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif int_poison is not None and t.dtype != torch.bool:
            t.fill_(int_poison)
        return t

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        return _poison(real_empty(*args, **kwargs))

    def empty_like(*args: object, **kwargs: object) -> torch.Tensor:
        return _poison(real_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float32, device=DEVICE) * scale).to(dtype)


def varlen_starts(lengths: list[int]) -> torch.Tensor:
    """query_start_loc [B+1] (int32, on DEVICE) from per-sequence lengths."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return torch.tensor(starts, dtype=torch.int32, device=DEVICE)
