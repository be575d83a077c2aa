"""Shared Triton plumbing for the kernels in this package: the one autotune entry point and small helpers.

Every `@triton.autotune` in deltaserve goes through `autotune` here. Triton's autotuner benchmarks its
configs on a GPU driver, which does not exist under TRITON_INTERPRET=1 (it raises "0 active drivers"), so
when interpreting, or when no CUDA device is present, only the first config is kept; that first config must
therefore be valid for every shape the launcher accepts. On the GPU it never benchmarks inside CUDA-graph
capture (see `_CaptureSafeAutotuner`). Kernels that update state in place (conv states, GDN states, the
KV cache) are not autotuned at all: benchmarking would apply their updates many times.

Batch-dependent integer arguments (token, row, sequence and entry counts, block-table widths, size buckets)
are listed in each kernel's `do_not_specialize`: Triton otherwise compiles a variant per value class
(== 1, divisible by 16, other), and a variant first met while serving stalls that step for a compile. The
start-up warm-up cannot cover every such class; tests/engine/test_runtime_compiles.py checks on the GPU that
serving-like traffic compiles nothing new.

Programmatic dependent launch (PDL, docs/kernels.md#programmatic-dependent-launch): a kernel that starts with
`pdl_wait(USE_PDL)` may be launched with `**pdl_launch(tensor)`, which on a Hopper-or-newer GPU sets USE_PDL and
Triton's `launch_pdl`. Such a kernel's programs are then scheduled while the previous kernel in the stream still runs
(once every program of that kernel has passed its own `pdl_wait`), and block in `pdl_wait` until it has finished and its
writes are visible. Because every PDL kernel signals its dependents only after its own wait, a PDL kernel that starts
finds every kernel before its immediate predecessor complete: loads placed above `pdl_wait` may read only data that the
predecessor neither writes nor reads-for-update (weights, this step's metadata, the GDN state slots of earlier steps);
every other load, and every store, comes after it; and every program passes `pdl_wait`, also one with nothing to do (a
kernel that could finish without waiting would let its successor start before its predecessor ends). A plain launch
(torch, cuBLAS, USE_PDL False) keeps full stream order.

Under the interpreter, Triton 3.6 turns a runtime scalar into a Python int with `int(array_of_shape_1)`,
which numpy ≥ 2.3 refuses, so `for i in range(lo, hi, BLOCK)` with loaded bounds fails. `_interpreter_shim`
swaps that one conversion for `.item()`; it is installed only when interpreting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.autotuner import Autotuner

from deltaserve import env


def is_interpreting() -> bool:
    """True when Triton runs kernels with numpy on the CPU (TRITON_INTERPRET=1)."""
    return env.triton_interpret()


def _interpreter_shim() -> None:
    """Make interpreted tensors index via `.item()` (see the module docstring); idempotent."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "deltaserve_shim", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.deltaserve_shim = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if is_interpreting():
    _interpreter_shim()


def can_benchmark() -> bool:
    """True when configs can be timed: a real CUDA device and not the interpreter."""
    return torch.cuda.is_available() and not is_interpreting()


@functools.cache
def _device_sm_count(device_index: int) -> int:
    if not can_benchmark():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs a launcher sizes its grid or picks its configuration for: the device's on CUDA, 4 elsewhere (the
    interpreter tests). benchmarks/kernel_resources.py replaces it in each launcher's module to size CPU compiles as
    on an H100 / H200 (132)."""
    if device.type != "cuda":
        return 4
    return _device_sm_count(device.index if device.index is not None else 0)


class _CaptureSafeAutotuner(Autotuner):
    """An Autotuner that never benchmarks inside CUDA-graph capture: a key first seen while capturing runs
    configs[0] uncached (so the first eager call with that key still tunes); keys tuned before capture
    replay their tuned config."""

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        # Triton 3.6's key: the named key args, then the dtype of every tensor argument.
        named = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        named = {k: v for k, v in named.items() if k in self.arg_names}
        key = [named[k] for k in self.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return tuple(key)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        capturing = len(self.configs) > 1 and torch.cuda.is_current_stream_capturing()
        if capturing and self._key(args, kwargs) not in self.cache:
            configs, self.configs = self.configs, self.configs[:1]
            try:
                return super().run(*args, **kwargs)
            finally:
                self.configs = configs
        return super().run(*args, **kwargs)


def autotune(configs: Sequence[triton.Config], key: list[str]) -> Callable[[Any], Any]:
    """`triton.autotune` that keeps only `configs[0]` when it cannot benchmark (interpreter or no GPU) and
    never benchmarks inside CUDA-graph capture (warm each shape up eagerly first to get tuned configs)."""
    kept = list(configs) if can_benchmark() else list(configs[:1])

    def decorator(fn: Any) -> Autotuner:
        tuner = _CaptureSafeAutotuner(fn, fn.arg_names, kept, key, reset_to_zero=None, restore_value=None)
        AUTOTUNERS.append(tuner)
        return tuner

    return decorator


# Every autotuner made here: a test reads their caches to see whether a step tuned a new key (a stall of
# hundreds of ms while serving, even when no kernel has to compile).
AUTOTUNERS: list[Autotuner] = []


def num_tuned_keys() -> dict[str, int]:
    """Kernel name -> how many autotune keys it has tuned in this process."""
    return {tuner.base_fn.__name__: len(tuner.cache) for tuner in AUTOTUNERS}


@functools.cache
def _has_pdl(device_index: int) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or newer."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """Launch options for a kernel that opens with `pdl_wait(USE_PDL)`, for a launch on t's device: USE_PDL and
    Triton's launch_pdl on a Hopper-or-newer GPU with DELTASERVE_PDL on, else none (the kernel's USE_PDL default is
    False: a plain, fully ordered launch; always so under the interpreter)."""
    if not t.is_cuda or is_interpreting() or not env.pdl():
        return {}
    if not _has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """With USE_PDL: wait until the previous kernel in the stream has finished and its writes are visible, then let
    the next PDL kernel's programs be scheduled (see the module docstring for what may be loaded above this)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def search_steps(num_seqs: int) -> int:
    """Steps of an in-kernel binary search over a batch's sequences: 8 (256 sequences, the default
    max_num_seqs) unless the batch holds more. It is a constexpr, so deriving it from each batch's sequence
    count compiled a new kernel for every new power of two while serving; steps past convergence are no-ops."""
    return max(8, (num_seqs - 1).bit_length())


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands get exact fp32 dots ("ieee") so fp32 tests are tight on GPU; bf16/fp16 use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def require_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")


@triton.jit
def i64(x):
    """Widen an index to int64 before it meets a stride: caches and long batches pass 2**31 elements."""
    return tl.cast(x, tl.int64)


@triton.jit
def silu_f32(x):
    """SiLU on an fp32 block: x·sigmoid(x)."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def softplus_f32(x):
    """torch's softplus (beta 1, threshold 20): x where x > 20, else log1p(e^x)."""
    e = tl.exp(tl.minimum(x, 20.0))
    # log(1 + e) loses e entirely once e < 2^-24; the series keeps it (log1p is not in every backend).
    log1p_e = tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))
    return tl.where(x > 20.0, x, log1p_e)
