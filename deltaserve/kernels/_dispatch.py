"""Decides, per call, whether an op runs its Triton kernel or its torch twin; the ops' optional `out` tensors.

Triton runs on CUDA tensors unless DELTASERVE_USE_TRITON=0. CPU tensors always take the torch twin in the
engine; tests reach the Triton launchers directly under TRITON_INTERPRET=1.

`triton_or_ref` builds an op from its two twins when that is the whole rule. Ops with a rule of their own (FP8
weights in `moe.fused_moe`, an fp32-only kernel in `gdn_spec.gdn_verify`, the GEMV's shape test in `linear`) and
the FP8 ops, which tests switch to Triton module by module, keep a hand-written dispatcher.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from deltaserve import env

P = ParamSpec("P")
R = TypeVar("R")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and env.use_triton()


def triton_or_ref(ref: Callable[P, R], triton: str, on: str | None = None) -> Callable[P, R]:
    """The op whose twins are `ref` (plain torch) and `triton` ("module.function" under deltaserve.kernels, with
    ref's parameters): a call runs the Triton launcher when use_triton(the argument named `on`, default ref's first)
    holds, else ref, passing the arguments through as given. The launcher's module is imported on first use (a
    CPU-only install never imports triton); both twins are looked up in their modules per call, as a hand-written
    dispatcher's names are, so a test's stand-in for either is seen. The op carries ref's signature and docstring
    under ref's name without the `_ref` suffix."""
    parameters = list(inspect.signature(ref).parameters)
    on = on or parameters[0]
    position = parameters.index(on)
    module_name, _, launcher_name = f"deltaserve.kernels.{triton}".rpartition(".")
    ref_module, ref_name = sys.modules[ref.__module__], ref.__name__

    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        decider = args[position] if position < len(args) else kwargs[on]
        if use_triton(decider):  # type: ignore[arg-type]
            module = sys.modules.get(module_name) or importlib.import_module(module_name)
            return getattr(module, launcher_name)(*args, **kwargs)
        return getattr(ref_module, ref_name)(*args, **kwargs)

    functools.update_wrapper(op, ref)
    op.__name__ = ref.__name__.removesuffix("_ref")
    op.__qualname__ = ref.__qualname__.removesuffix("_ref")
    return op


def output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The op's output: `out` when the caller gives one (a contiguous view of a larger buffer, so a mixed step's
    decode and prefill halves land in one tensor without a copy), else a new tensor of like's dtype and device."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} on {out.device}, want {tuple(shape)} {like.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out
