"""runner/jit_monitor.py, vLLM 0.26's kernel JIT monitor: --jit-monitor-mode / --jit-monitor-verbose reach the engine,
an engine activates the monitor once its start-up is done (the log line vLLM prints), and Triton's post-compile
hook then logs each kernel once ("warn"), every compile in full (verbose), or fails the step ("error"); compiles
during an engine's start-up are not reported, and a hook set before keeps being called. On the CPU nothing compiles
(Triton's interpreter), so the hook is driven the way Triton calls it."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from deltaserve.api.cli_args import add_arguments
from deltaserve.engine.llm import LLM
from deltaserve.engine_config import EngineConfig
from deltaserve.runner import jit_monitor
from deltaserve.tiny.trained import trained_model_dir

knobs = pytest.importorskip("triton").knobs


@pytest.fixture(autouse=True)
def fresh_monitor() -> Iterator[None]:
    jit_monitor.reset()
    yield
    jit_monitor.reset()


def _compile(name: str) -> None:
    """What Triton passes its post-compile hook after compiling a specialization of `name`."""
    hook = knobs.runtime.jit_post_compile_hook
    assert hook is not None, "no hook installed"
    hook(key=("k",), repr=f"{name}[num_warps=4](x_ptr: *bf16)", fn=SimpleNamespace(name=name), compile={},
         is_manual_warmup=False, already_compiled=False)  # fmt: skip


def test_warn_logs_each_kernel_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.jit_monitor"):
        jit_monitor.activate("warn")
        for name in ("_gdn_decode_kernel", "_gdn_decode_kernel", "_paged_attn_combine_kernel"):
            _compile(name)
    activated = "Kernel JIT monitor activated; monitored JIT compilations during inference will use mode=warn."
    assert activated in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "Triton kernel JIT compilation during inference: _gdn_decode_kernel. This causes a latency spike; consider "
        "extending warmup to cover this shape/config.",
        "Triton kernel JIT compilation during inference: _paged_attn_combine_kernel. This causes a latency spike; "
        "consider extending warmup to cover this shape/config.",
    ]


def test_verbose_logs_every_compile_with_its_specialization(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deltaserve.runner.jit_monitor"):
        jit_monitor.activate("warn", verbose=True)
        _compile("_gdn_decode_kernel")
        _compile("_gdn_decode_kernel")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("(_gdn_decode_kernel[num_warps=4](x_ptr: *bf16))" in w for w in warnings)


def test_error_fails_the_compile_and_start_up_compiles_are_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    jit_monitor.activate("error")
    with jit_monitor.starting_up():  # a second engine's warm-up in this process
        _compile("_conv_kernel")
    with pytest.raises(RuntimeError, match="Triton kernel JIT compilation during inference: _conv_kernel"):
        _compile("_conv_kernel")


def test_the_first_activation_holds_and_an_earlier_hook_keeps_being_called() -> None:
    seen: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **event: seen.append(event["fn"].name)
    jit_monitor.activate("warn")
    jit_monitor.activate("error")  # a later engine in the process changes nothing, as in vLLM
    _compile("_x_kernel")  # warns, does not raise
    assert seen == ["_x_kernel"]
    jit_monitor.reset()
    assert knobs.runtime.jit_post_compile_hook is not None  # the earlier hook is back
    knobs.runtime.jit_post_compile_hook = None


def test_modes_other_than_vllms_are_refused() -> None:
    with pytest.raises(ValueError, match="Unsupported JIT monitor mode: 'off'"):
        EngineConfig(model="m", jit_monitor_mode="off")
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--jit-monitor-mode", "error", "--jit-monitor-verbose"])
    assert (args.jit_monitor_mode, args.jit_monitor_verbose) == ("error", True)
    assert parser.parse_args([]).jit_monitor_mode == "warn"
    with pytest.raises(SystemExit):
        parser.parse_args(["--jit-monitor-mode", "off"])


def test_an_engine_activates_it_once_started(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.jit_monitor"):
        LLM(trained_model_dir("dense"), dtype="float32", max_model_len=256, jit_monitor_mode="error")
    assert jit_monitor.is_active()
    assert "will use mode=error." in caplog.text
    assert knobs.runtime.jit_post_compile_hook is jit_monitor.on_compile


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_a_speculating_engine_compiles_nothing_while_serving(variant: str) -> None:
    """On the GPU, in mode "error": an engine with MTP serves traffic that meets every eager path after its start-up
    without one Triton compile (docs/kernels.md#compiles-while-serving): prompts chunked beside verify steps (mixed
    eager steps of assorted batch sizes), max_tokens 1 .. 17 (rows that may not draft decode plainly, the path the
    27B's MTP server compiled in its first requests: grids/h100_mtp-27b-c64-20261206-s31), greedy and sampled rows,
    the batch shrinking as requests end."""
    import torch

    from deltaserve.sampling_params import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # a small share of the card, and the engine released however the test ends: the next GPU test starts its own
    llm = LLM(trained_model_dir(variant), dtype="bfloat16", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
              gpu_memory_utilization=0.3, jit_monitor_mode="error")  # fmt: skip
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + (37 * i) % 90)] for i in range(14)]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=(1, 2, 3, 5, 17)[i % 5], ignore_eos=True)
        for i in range(len(prompts))
    ]
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert not jit_monitor._state["warned"]


def test_cutedsl_compiles_are_reported_as_vllm_reports_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where CuTe-DSL is installed (FlashInfer's GDN prefill is written in it), cutlass.cute.compile is wrapped as
    vLLM 0.26 wraps it: a compile while serving is logged in vLLM's words before it runs, its option form
    (`compile[opts]`) still works, start-up compiles are not reported, and reset puts the original back."""
    import importlib.machinery
    import sys
    import types

    calls: list[tuple[str, object]] = []

    class FakeCompile:
        def __init__(self, options: object = None) -> None:
            self.options = options

        def __getitem__(self, options: object) -> FakeCompile:
            return FakeCompile(options)

        def __call__(self, kernel: object, *args: object) -> str:
            calls.append((getattr(kernel, "__name__", type(kernel).__name__), self.options))
            return "compiled"

    cutlass = types.ModuleType("cutlass")
    cutlass.__spec__ = importlib.machinery.ModuleSpec("cutlass", None)
    cute = types.ModuleType("cutlass.cute")
    original = FakeCompile()
    cute.compile = original
    cutlass.cute = cute
    monkeypatch.setitem(sys.modules, "cutlass", cutlass)
    monkeypatch.setitem(sys.modules, "cutlass.cute", cute)

    class _FullyFusedDeltaRuleSm90:  # a CuTe-DSL kernel object, named by its class
        pass

    def prep_kernel() -> None:
        pass

    with caplog.at_level(logging.WARNING, logger="deltaserve.runner.jit_monitor"):
        jit_monitor.activate("warn")
        assert cute.compile is not original
        with jit_monitor.starting_up():
            assert cute.compile(prep_kernel) == "compiled"  # the warm-up's: not reported
        assert cute.compile(_FullyFusedDeltaRuleSm90()) == "compiled"
        assert cute.compile["--opt"](prep_kernel) == "compiled"
        cute.compile(_FullyFusedDeltaRuleSm90())  # once per kernel in "warn"
    assert calls == [
        ("prep_kernel", None),
        ("_FullyFusedDeltaRuleSm90", None),
        ("prep_kernel", "--opt"),
        ("_FullyFusedDeltaRuleSm90", None),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "CuTeDSL JIT compilation during inference: _FullyFusedDeltaRuleSm90. This causes a latency spike; consider "
        "extending warmup to cover this shape/config.",
        "CuTeDSL JIT compilation during inference: prep_kernel. This causes a latency spike; consider extending "
        "warmup to cover this shape/config.",
    ]
    jit_monitor.reset()
    assert cute.compile is original
    jit_monitor.activate("error")
    with pytest.raises(RuntimeError, match="CuTeDSL JIT compilation during inference: prep_kernel"):
        cute.compile(prep_kernel)
