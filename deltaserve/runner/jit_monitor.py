"""The kernel JIT monitor, as vLLM 0.26 has it (`--jit-monitor-mode`, `--jit-monitor-verbose`): after an engine's
start-up (weights, warm-up, CUDA graph capture) a Triton kernel compiled while serving means a shape or
specialization the warm-up missed, and the step that met it stalled for the compile
(docs/kernels.md#compiles-while-serving).

`activate` installs a hook on Triton's `knobs.runtime.jit_post_compile_hook` (called after every in-process compile of
a @triton.jit specialization, Triton's on-disk cache included). In mode "warn" each kernel is logged once, in
vLLM's words ("Triton kernel JIT compilation during inference: NAME. This causes a latency spike; consider
extending warmup to cover this shape/config."); with `verbose`, every compile, with its specialization; in mode
"error" the compile raises, so the step that met it fails at once. Compiles inside `starting_up()` (an engine's
start-up in this process: a second engine built after the first is serving, as the gates do) are not reported. Off
CUDA, and under TRITON_INTERPRET=1, nothing compiles and nothing is reported.
"""

from __future__ import annotations

import contextlib
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

_lock = threading.Lock()
_state: dict[str, Any] = {"mode": None, "verbose": False, "starting": 0, "warned": set(), "chained": None}


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
    logger.info("Kernel JIT monitor activated; monitored JIT compilations during inference will use mode=%s.", mode)


def on_compile(**event: Any) -> Any:
    """Triton's post-compile hook (key, repr, fn, compile, is_manual_warmup, already_compiled as keywords)."""
    chained = _state["chained"]
    result = chained(**event) if chained is not None else None
    if _state["starting"] or event.get("is_manual_warmup"):
        return result
    info = event.get("fn")
    name = getattr(info, "name", None) or str(event.get("repr", "?")).split("[", 1)[0]
    detail = f" ({event.get('repr')})" if _state["verbose"] else ""
    if _state["mode"] == "error":
        raise RuntimeError(MESSAGE % (name, detail))
    with _lock:
        if not _state["verbose"] and name in _state["warned"]:
            return result
        _state["warned"].add(name)
    logger.warning(MESSAGE, name, detail)
    return result


def reset() -> None:
    """Back to inactive (tests): the previous hook restored, the warned names forgotten."""
    if is_active():
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = _state["chained"]
    _state.update(mode=None, verbose=False, warned=set(), chained=None)
