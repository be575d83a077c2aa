"""The kernel JIT monitor, as vLLM 0.26 has it (`--jit-monitor-mode`, `--jit-monitor-verbose`): after an engine's
start-up (weights, warm-up, CUDA graph capture) a Triton kernel compiled while serving means a shape or
specialization the warm-up missed, and the step that met it stalled for the compile
(docs/kernels.md#compiles-while-serving).

`activate` installs a hook on Triton's `knobs.runtime.jit_post_compile_hook` (called after every in-process compile of
a @triton.jit specialization, Triton's on-disk cache included) and, where CuTe-DSL is installed (FlashInfer's GDN
prefill is written in it), wraps `cutlass.cute.compile` as vLLM 0.26 does, so a CuTe-DSL kernel compiled while
serving is reported too (logged as its compile begins: one of FlashInfer's takes seconds). In mode "warn" each
kernel is logged once, in vLLM's words ("Triton kernel JIT compilation during inference: NAME. This causes a latency
spike; consider extending warmup to cover this shape/config.", "CuTeDSL JIT compilation during inference: NAME.
..."); with `verbose`, every compile, with its specialization (Triton); in mode "error" the compile raises, so the
step that met it fails at once. Compiles inside `starting_up()` (an engine's
start-up in this process: a second engine built after the first is serving, as the gates do) are not reported. Off
CUDA, and under TRITON_INTERPRET=1, nothing compiles and nothing is reported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
from collections.abc import Iterator
from typing import Any

from deltaserve.engine_config import check_jit_monitor_mode

logger = logging.getLogger(__name__)

MESSAGE = (
    "Triton kernel JIT compilation during inference: %s%s. This causes a latency spike; consider extending warmup "
    "to cover this shape/config."
)
CUTE_MESSAGE = (
    "CuTeDSL JIT compilation during inference: %s. This causes a latency spike; consider extending warmup to cover "
    "this shape/config."
)

_lock = threading.Lock()
_state: dict[str, Any] = {
    "mode": None,
    "verbose": False,
    "starting": 0,
    "warned": set(),
    "chained": None,
    "cute": None,  # (the cutlass.cute module, its own compile) while wrapped
}


@contextlib.contextmanager
def starting_up() -> Iterator[None]:
    """An engine's start-up in this process: what it compiles is its warm-up's work, not reported."""
    with _lock:
        _state["starting"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["starting"] -= 1


def is_active() -> bool:
    return _state["mode"] is not None


def activate(mode: str = "warn", verbose: bool = False) -> None:
    """Reports every Triton compile from now on (outside starting_up). The first call's mode and verbosity hold for
    the process, as vLLM's; later calls change nothing."""
    check_jit_monitor_mode(mode)
    if is_active():
        return
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing can compile
        return
    _state.update(mode=mode, verbose=verbose, chained=knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_post_compile_hook = on_compile
    _wrap_cute_compile()
    logger.info("Kernel JIT monitor activated; monitored JIT compilations during inference will use mode=%s.", mode)


class MonitoredCuteCompile:
    """`cutlass.cute.compile` reporting each compile first; `compile[options]` keeps working (CuTe-DSL's option
    form), its result wrapped alike."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getitem__(self, options: Any) -> MonitoredCuteCompile:
        return MonitoredCuteCompile(self.inner[options])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kernel = args[0] if args else kwargs.get("function")
        name = getattr(kernel, "__name__", None) or (type(kernel).__name__ if kernel is not None else "<unknown>")
        _report(name, CUTE_MESSAGE % name)
        return self.inner(*args, **kwargs)


def _wrap_cute_compile() -> None:
    """Wrap cutlass.cute.compile where CuTe-DSL is installed (left alone where it is not: nothing of ours or
    FlashInfer's can compile one then)."""
    if importlib.util.find_spec("cutlass") is None:
        return
    try:
        import cutlass.cute as cute
    except Exception as exc:  # an installed but broken CuTe-DSL: FlashInfer's kernels cannot run either
        logger.debug("CuTe-DSL not importable (%s): its compiles are not monitored", exc)
        return
    _state["cute"] = (cute, cute.compile)
    cute.compile = MonitoredCuteCompile(cute.compile)


def _report(name: str, line: str) -> None:
    """Log `line` (or in mode "error" raise it) for one compile of kernel `name` while serving; each kernel once
    unless verbose."""
    if _state["starting"]:
        return
    if _state["mode"] == "error":
        raise RuntimeError(line)
    with _lock:
        if not _state["verbose"] and name in _state["warned"]:
            return
        _state["warned"].add(name)
    logger.warning("%s", line)


def on_compile(**event: Any) -> Any:
    """Triton's post-compile hook (key, repr, fn, compile, is_manual_warmup, already_compiled as keywords)."""
    chained = _state["chained"]
    result = chained(**event) if chained is not None else None
    if event.get("is_manual_warmup"):
        return result
    info = event.get("fn")
    name = getattr(info, "name", None) or str(event.get("repr", "?")).split("[", 1)[0]
    _report(name, MESSAGE % (name, f" ({event.get('repr')})" if _state["verbose"] else ""))
    return result


def reset() -> None:
    """Back to inactive (tests): the previous hook restored, the warned names forgotten."""
    if is_active():
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = _state["chained"]
    if _state["cute"] is not None:
        cute, compile_fn = _state["cute"]
        cute.compile = compile_fn
    _state.update(mode=None, verbose=False, warned=set(), chained=None, cute=None)
