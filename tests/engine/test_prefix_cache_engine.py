"""The prefix cache's engine surface: RequestOutput.num_cached_tokens carried from the core through the front end,
the offline LLM(enable_prefix_caching=...) and LLM.reset_prefix_cache(), the core's counters in EngineStats, and
the core loop's reset command answering in command order.

Exactness of the cache (outputs with it on equal outputs with it off in every situation) is the scheduler's and
runner's suite; here a repeated greedy prompt only has to give the same tokens while reporting its hits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deltaserve.engine.core_client import serve_core
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.llm import LLM
from deltaserve.engine.output import RequestState, SequenceProgress
from deltaserve.engine.protocol import EngineCoreOutput, EngineCoreOutputs
from deltaserve.engine.request import RequestOutput
from deltaserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
# ~150 prompt tokens of the tiny tokenizer: two full 64-token checkpoint chunks
PROMPT = " ".join(["The prefix cache keeps the state at the end of a shared prefix."] * 4)
MORE = " And then it goes on."  # its tokens follow PROMPT's unchanged (no token spans the join)


def test_the_front_end_keeps_each_sequences_first_reported_hits(tiny_dense: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dense)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, n=2)
    sequences = [SequenceProgress(f"r#{i}", IncrementalDetokenizer(tokenizer, [1, 2, 3], params)) for i in range(2)]
    state = RequestState("r", None, [1, 2, 3], params, sequences)
    assert state.delta_output().num_cached_tokens == 0  # nothing reported yet
    state.apply(1, EngineCoreOutput("r#1", (5,), None, num_cached_tokens=64))
    assert state.delta_output().num_cached_tokens == 64
    state.apply(0, EngineCoreOutput("r#0", (6,), None, num_cached_tokens=128))
    # the first sequence's value once it reported; a later admission (after a preemption) changes nothing
    state.apply(0, EngineCoreOutput("r#0", (7,), None, num_cached_tokens=0))
    assert state.delta_output().num_cached_tokens == 128
    assert state.final_output().num_cached_tokens == 128


def test_the_core_loop_answers_a_reset_in_command_order() -> None:
    calls: list[str] = []

    class Core:
        def check_health(self) -> None: ...

        def has_unfinished(self) -> bool:
            return False

        def add_request(self, request: Any) -> None:
            calls.append(f"add {request.request_id}")

        def reset_prefix_cache(self) -> bool:
            calls.append("reset")
            return len(calls) > 1

        def take_errors(self) -> list:
            return []

        def stats(self) -> None:
            return None

    class Request:
        request_id = "a"

    batches = [[("reset_prefix_cache", 3), ("add", [Request()]), ("reset_prefix_cache", 4)], [("shutdown", None)]]
    emitted: list[EngineCoreOutputs] = []
    serve_core(Core(), lambda block: batches.pop(0), emitted.append)
    assert calls == ["reset", "add a", "reset"]
    assert [batch.replies for batch in emitted] == [((3, False), (4, True))]


@pytest.fixture(scope="module")
def cached_llm(tiny_dense: Path) -> LLM:
    return LLM(tiny_dense, dtype="float32", max_num_seqs=4)


@pytest.fixture(scope="module")
def uncached_llm(tiny_dense: Path) -> LLM:
    return LLM(tiny_dense, dtype="float32", max_num_seqs=4, enable_prefix_caching=False)


def generate(llm: LLM, prompt: str) -> RequestOutput:
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0]


def test_the_second_request_of_a_shared_prefix_hits_and_gives_the_same_tokens(
    cached_llm: LLM, uncached_llm: LLM
) -> None:
    stats = cached_llm.engine.stats()
    assert stats.enable_prefix_caching
    head = generate(cached_llm, "Shared: " + PROMPT)
    longer = generate(cached_llm, "Shared: " + PROMPT + MORE)
    num_head, num_longer = len(head.prompt_token_ids), len(longer.prompt_token_ids)
    assert head.num_cached_tokens == 0
    assert 0 < (num_head - 1) // 64 * 64 <= longer.num_cached_tokens <= num_head
    reference = generate(uncached_llm, "Shared: " + PROMPT + MORE)
    assert longer.outputs[0].token_ids == reference.outputs[0].token_ids
    after = cached_llm.engine.stats()
    assert after.prefix_cache_queries - stats.prefix_cache_queries == num_head + num_longer
    assert after.prefix_cache_hits - stats.prefix_cache_hits == longer.num_cached_tokens


def test_a_reset_makes_the_next_shared_prefix_request_miss(cached_llm: LLM) -> None:
    generate(cached_llm, "Reset: " + PROMPT)
    assert cached_llm.reset_prefix_cache() is True  # nothing runs between two generate() calls
    assert generate(cached_llm, "Reset: " + PROMPT + MORE).num_cached_tokens == 0
    generate(cached_llm, "Reset: " + PROMPT)
    assert generate(cached_llm, "Reset: " + PROMPT + MORE).num_cached_tokens > 0


def test_with_the_cache_off_nothing_hits_or_counts(uncached_llm: LLM) -> None:
    outputs = [generate(uncached_llm, "Off: " + PROMPT + suffix) for suffix in ("", "", MORE)]
    assert [output.num_cached_tokens for output in outputs] == [0, 0, 0]
    stats = uncached_llm.engine.stats()
    assert not stats.enable_prefix_caching
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
