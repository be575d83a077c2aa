"""vLLM's asyncio engine API: AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...)) and its generate(), whose outputs
come as each request's output_kind asks (cumulative by default, deltas, or once finished) with the tokens the offline
LLM gives; aborts by id or list; vLLM's keywords that are not served refused by name; shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deltaserve import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, RequestOutputKind, SamplingParams, TokensPrompt
from deltaserve.engine.llm import LLM

PROMPT = "The cat sat on the mat"


@pytest.fixture(scope="module")
def engine(tiny_dense: Path) -> AsyncLLM:
    args = AsyncEngineArgs(model=str(tiny_dense), device="cpu", max_model_len=256, disable_log_stats=True)
    llm = AsyncLLMEngine.from_engine_args(args)
    yield llm
    llm.shutdown()
    assert llm.is_stopped and not llm.is_running


def collect(engine: AsyncLLM, prompt: object, params: SamplingParams, request_id: str) -> list:
    async def run() -> list:
        return [output async for output in engine.generate(prompt, params, request_id)]

    return asyncio.run(run())


def test_the_names_are_vllms(engine: AsyncLLM) -> None:
    assert AsyncLLMEngine is AsyncLLM and not engine.log_stats
    assert engine.get_tokenizer() is engine.tokenizer and engine.is_running and not engine.errored
    assert asyncio.run(engine.get_supported_tasks()) == ("generate",)
    asyncio.run(engine.check_health())
    with pytest.raises(ValueError, match="stat_loggers"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model="m"), stat_loggers=[object()])


def test_outputs_come_as_the_output_kind_asks(engine: AsyncLLM, tiny_dense: Path) -> None:
    expected = LLM(str(tiny_dense), device="cpu", max_model_len=256).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    tokens = list(expected.outputs[0].token_ids)

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=kind)

    cumulative = collect(engine, PROMPT, params(RequestOutputKind.CUMULATIVE), "cumulative")
    assert [len(out.outputs[0].token_ids) for out in cumulative] == [1, 2, 3, 4, 5]
    assert list(cumulative[-1].outputs[0].token_ids) == tokens and cumulative[-1].finished
    assert cumulative[-1].prompt == PROMPT and cumulative[-1].outputs[0].text == expected.outputs[0].text
    deltas = collect(engine, PROMPT, params(RequestOutputKind.DELTA), "delta")
    assert [t for out in deltas for t in out.outputs[0].token_ids] == tokens
    final = collect(engine, TokensPrompt(prompt_token_ids=list(expected.prompt_token_ids)),
                    params(RequestOutputKind.FINAL_ONLY), "final")  # fmt: skip
    assert len(final) == 1 and list(final[0].outputs[0].token_ids) == tokens and final[0].finished


def test_refusals_and_aborts(engine: AsyncLLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="lora"):
        asyncio.run(_first(engine, greedy, lora_request=object()))
    with pytest.raises(ValueError, match="data_parallel_rank"):
        asyncio.run(_first(engine, greedy, data_parallel_rank=1))
    with pytest.raises(ValueError, match="reasoning_ended"):
        asyncio.run(_first(engine, greedy, reasoning_ended=True))

    async def abort_midway() -> list:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        seen = []
        async for output in engine.generate(PROMPT, long, "to-abort"):
            seen.append(output)
            if len(seen) == 2:
                await engine.abort(["to-abort", "unknown"])
                break
        return seen

    assert len(asyncio.run(abort_midway())) == 2
    # the engine still serves after the abort
    assert collect(engine, PROMPT, greedy, "after")[-1].finished


async def _first(engine: AsyncLLM, params: SamplingParams, **keywords: object) -> object:
    async for output in engine.generate(PROMPT, params, "refused", **keywords):
        return output
    return None
