"""vLLM's EngineArgs -> LLMEngine.from_engine_args path (its llm_engine_example's loop): keywords and the command
line build the EngineConfig `deltaserve serve` and LLM(...) would, vLLM's other keywords and flags are refused or
logged by the same table, and the engine it builds steps requests to the tokens LLM.generate gives them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import deltaserve
from deltaserve import EngineArgs, LLMEngine, SamplingParams
from deltaserve.engine.llm import LLM


def test_the_names_are_exported_as_vllm_exports_them() -> None:
    assert deltaserve.EngineArgs is EngineArgs and deltaserve.LLMEngine is LLMEngine
    assert {"EngineArgs", "LLMEngine"} <= set(deltaserve.__all__)


def test_keywords_build_the_config_the_offline_llm_would(tiny_dense: Path) -> None:
    args = EngineArgs(model=str(tiny_dense), device="cpu", max_model_len=256, enable_prefix_caching=False)
    assert args.max_model_len == 256 and args.model == str(tiny_dense)  # vLLM's attributes read back
    config = args.create_engine_config()
    assert (config.model, config.device, config.max_model_len, config.enable_prefix_caching) == (
        str(tiny_dense), "cpu", 256, False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="enable_lora"):
        EngineArgs(model="m", enable_lora=True).create_engine_config()  # the table's refusal, named
    with pytest.raises(TypeError, match="no_such_setting"):
        EngineArgs(model="m", no_such_setting=1).create_engine_config()
    with pytest.raises(ValueError, match="needs a model"):
        EngineArgs().create_engine_config()


def test_the_command_line_is_serves(tiny_dense: Path) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["--model", str(tiny_dense), "--max-model-len", "256", "--device", "cpu", "--no-enable-prefix-caching",
            "--disable-log-stats"]  # fmt: skip
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    config = args.create_engine_config()
    assert (config.model, config.max_model_len, config.device, config.enable_prefix_caching) == (
        str(tiny_dense), 256, "cpu", False,
    )  # fmt: skip
    assert args.disable_log_stats
    # no model: the built-in tiny checkpoint on the CPU, as `deltaserve serve` with no MODEL
    assert EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config().device == "cpu"
    with pytest.raises(ValueError, match="--enable-lora"):
        EngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_dense), "--enable-lora"]))


def test_the_engine_steps_requests_to_the_offline_llms_tokens(tiny_dense: Path) -> None:
    """vLLM's llm_engine_example loop: add requests, step until none is unfinished, keep the finished outputs."""
    args = EngineArgs(model=str(tiny_dense), device="cpu", max_model_len=256)
    with pytest.raises(ValueError, match="stat_loggers"):
        LLMEngine.from_engine_args(args, stat_loggers=[object()])
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["The cat sat on the mat", "Once upon a time", "A third prompt to abort"]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    engine.abort_request(["2", "no-such-request"])  # vLLM 0.26 takes a list; unknown ids are skipped
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert sorted(finished) == ["0", "1"] and all(len(tokens) == 6 for tokens in finished.values())
    expected = LLM(str(tiny_dense), device="cpu", max_model_len=256).generate(prompts[:2], params, use_tqdm=False)
    assert [finished[str(i)] for i in range(2)] == [list(out.outputs[0].token_ids) for out in expected]
