"""The runner's step hook: an optional callable that sees every collected step with its host timings.

ModelRunner.set_step_observer(fn) registers fn (None removes it); the runner then calls fn(plan, result, timings)
at the end of each collect(), on the thread that collects, for every step that held work. Without an observer
the runner takes no time stamps at all: one `is None` check in execute() and one in collect(). Benchmarks and
profiles use it (benchmarks/profile_decode.py: how long the host waits for the GPU); an observer must not keep
the step waiting (it runs before the engine learns the step's tokens).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltaserve.step import StepPlan, StepResult


@dataclass(frozen=True)
class StepTimings:
    """Host seconds (time.perf_counter) of one step on the runner that samples (rank 0)."""

    launch_s: float  # in execute(): the plan applied, the inputs built, forward and sampling launched
    wait_s: float  # in collect(), blocked on the GPU: the step's token (and prompt-logprob) copies to complete
    collect_s: float  # all of collect(), wait_s included (host copies to Python, logprobs)
    launched_at: float  # perf_counter() when execute() returned the step's handle
    collected_at: float  # perf_counter() when collect() had the step's result


StepObserver = Callable[[StepPlan, StepResult, StepTimings], None]


def timed_launch(execute: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ModelRunner.execute: with an observer registered, stamps the handle it returns with the launch's start
    and end (handle.launch_started, handle.launched_at); without one, calls it straight through."""

    @functools.wraps(execute)
    def wrapper(runner: Any, *args: Any, **kwargs: Any) -> Any:
        if runner._step_observer is None:
            return execute(runner, *args, **kwargs)
        started = time.perf_counter()
        handle = execute(runner, *args, **kwargs)
        handle.launch_started, handle.launched_at = started, time.perf_counter()
        return handle

    return wrapper
