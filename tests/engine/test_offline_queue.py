"""The offline LLM.enqueue / LLM.enqueue_chat / LLM.wait_for_completion (vLLM's), on the trained tiny dense checkpoint
(fp32, CPU, greedy, a few tokens).

Enqueued requests run only when waited for and give generate's / chat's tokens; the request ids are vLLM's counter
strings and the outputs come back ordered by their numeric value; a generate() after enqueue() returns the enqueued
outputs too, first (vLLM's _run_engine returns every finished request); a refused call adds nothing. Also the rest
of vLLM's offline surface: get_world_size, reset_mm_cache (nothing to clear), the methods refused by name and the
pooling methods, refused with vLLM's ValueError for a generative model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tqdm import tqdm

from deltaserve.engine.llm import LLM
from deltaserve.engine.request import RequestOutput
from deltaserve.sampling_params import BeamSearchParams, SamplingParams
from deltaserve.tiny.trained import trained_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = ["The river ran", {"prompt_token_ids": [5, 17, 99, 300, 41]}, "Once upon a time"]
CONVERSATIONS = [
    [{"role": "user", "content": "Say hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The river ran"}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(trained_model_dir("dense"), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_enqueue_then_wait_equals_generate(llm: LLM) -> None:
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ids = llm.enqueue(PROMPTS, GREEDY, use_tqdm=False)
    assert all(isinstance(i, str) for i in ids)
    assert [int(i) for i in ids] == list(range(int(ids[0]), int(ids[0]) + len(PROMPTS)))
    assert ids[0] == str(int(expected[-1].request_id) + 1)  # one counter for generate and enqueue
    assert set(llm.engine.requests) == set(ids)  # added, not run
    assert all(not state.sequences[0].token_ids for state in llm.engine.requests.values())
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids
    assert all(o.finished for o in outputs)
    assert tokens(outputs) == tokens(expected)
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in expected]
    assert_idle(llm)


def test_outputs_ordered_by_numeric_id(llm: LLM) -> None:
    """Past ten requests the string order of the ids ("10" < "2") is not theirs: vLLM sorts by int(request_id)."""
    prompts = [{"prompt_token_ids": [3 + i, 40, 41]} for i in range(12)]
    ids = llm.enqueue(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]


def test_generate_after_enqueue_returns_both(llm: LLM) -> None:
    alone = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    queued = llm.enqueue(PROMPTS[0], GREEDY, use_tqdm=False)
    outputs = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert [o.request_id for o in outputs] == [queued[0], str(int(queued[0]) + 1)]
    assert tokens(outputs) == tokens(alone)
    assert_idle(llm)


def test_enqueue_chat_equals_chat(llm: LLM) -> None:
    expected = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    ids = llm.enqueue_chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    outputs = llm.wait_for_completion(RequestOutput, use_tqdm=False)
    assert [o.request_id for o in outputs] == ids
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in expected]
    assert [o.prompt for o in outputs] == [o.prompt for o in expected]
    assert tokens(outputs) == tokens(expected)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda llm: llm.enqueue(PROMPTS, GREEDY, lora_request=object()), "lora_request"),
        (lambda llm: llm.enqueue(PROMPTS, GREEDY, tokenization_kwargs={"truncation": True}), "tokenization_kwargs"),
        (lambda llm: llm.enqueue(PROMPTS, GREEDY, mm_processor_kwargs={"fps": 1}), "mm_processor_kwargs"),
        (
            lambda llm: llm.enqueue(PROMPTS, [GREEDY]),
            r"^The lengths of prompts \(3\) and params \(1\) must be the same\.$",
        ),
        (lambda llm: llm.enqueue(PROMPTS, GREEDY, lora_request=[None, object(), None]), "lora_request"),
        (lambda llm: llm.enqueue(PROMPTS, GREEDY, priority=[1, 2, 3]), "priority"),
        (lambda llm: llm.enqueue(PROMPTS, SamplingParams(logprobs=500)), "logprobs"),
        # the engine refuses the second prompt after the first was added: the first goes too
        (lambda llm: llm.enqueue([PROMPTS[1], {"prompt_token_ids": [10**9]}], GREEDY), "out of vocabulary"),
        (lambda llm: llm.enqueue_chat(CONVERSATIONS, GREEDY, lora_request=object()), "lora_request"),
        (lambda llm: llm.enqueue_chat(CONVERSATIONS, GREEDY, tokenization_kwargs={"x": 1}), "tokenization_kwargs"),
        (lambda llm: llm.enqueue_chat(CONVERSATIONS, GREEDY, mm_processor_kwargs={"x": 1}), "mm_processor_kwargs"),
        (lambda llm: llm.chat(CONVERSATIONS, GREEDY, tokenization_kwargs={"x": 1}), "tokenization_kwargs"),
        (
            lambda llm: llm.enqueue_chat(
                CONVERSATIONS, GREEDY, add_generation_prompt=True, continue_final_message=True
            ),
            "continue_final_message",
        ),
    ],
)
def test_refused_call_adds_nothing(llm: LLM, call, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert_idle(llm)


def test_waiting_refusals_lose_nothing(llm: LLM) -> None:
    """A wrong output_type is refused before the run; beam_search refuses to run over enqueued requests (its steps'
    generate calls would return them); both leave the queue as it was."""
    ids = llm.enqueue(PROMPTS[:1], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="RequestOutput"):
        llm.wait_for_completion(int)
    with pytest.raises(RuntimeError, match="wait_for_completion"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=2))
    outputs = llm.wait_for_completion((RequestOutput, int), use_tqdm=False)
    assert [o.request_id for o in outputs] == ids and len(outputs[0].outputs[0].token_ids) == 4


def test_use_tqdm_callable_makes_the_bars(llm: LLM) -> None:
    """vLLM's use_tqdm may be a callable that makes the bar: enqueue's over the prompts, the run's over requests."""
    made: list[dict] = []

    def bar(iterable: object = None, **kwargs: object) -> tqdm:
        made.append(kwargs)
        return tqdm(iterable, disable=True, **kwargs)

    llm.enqueue(PROMPTS[:2], GREEDY, use_tqdm=bar)
    outputs = llm.wait_for_completion(use_tqdm=bar)
    assert len(outputs) == 2
    assert [kwargs.get("desc") for kwargs in made] == ["Adding requests", "Processed prompts"]
    assert made[1]["total"] == 2


def test_world_size_and_mm_cache(llm: LLM) -> None:
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    four_ranks = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(tensor_parallel_size=4)))
    assert LLM.get_world_size(four_ranks) == LLM.get_world_size(four_ranks, include_dp=False) == 4  # no DP, no PP
    before = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert llm.reset_mm_cache() is None  # no multimodal cache to clear
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == tokens(before)


@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("sleep", lambda llm: llm.sleep(level=1)),
        ("wake_up", lambda llm: llm.wake_up(tags=["weights"])),
        ("collective_rpc", lambda llm: llm.collective_rpc("get_model")),
        ("apply_model", lambda llm: llm.apply_model(lambda model: model)),
        ("start_profile", lambda llm: llm.start_profile()),
        ("stop_profile", lambda llm: llm.stop_profile()),
        ("init_weight_transfer_engine", lambda llm: llm.init_weight_transfer_engine({"init_info": {}})),
        ("start_weight_update", lambda llm: llm.start_weight_update()),
        ("start_draft_weight_update", lambda llm: llm.start_draft_weight_update()),
        ("update_weights", lambda llm: llm.update_weights({"update_info": {}})),
        ("finish_weight_update", lambda llm: llm.finish_weight_update()),
    ],
)
def test_unimplemented_methods_refused_by_name(llm: LLM, method: str, call) -> None:  # noqa: ANN001
    with pytest.raises(NotImplementedError, match=rf"LLM\.{method}: deltaserve does not implement it"):
        call(llm)


@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("encode", lambda llm: llm.encode(PROMPTS, pooling_task="embed")),
        ("encode", lambda llm: llm.embed(PROMPTS)),
        ("encode", lambda llm: llm.classify(PROMPTS[0])),
        ("score", lambda llm: llm.score("a", ["b", "c"])),
    ],
)
def test_pooling_methods_refused_as_vllm_refuses_them(llm: LLM, method: str, call) -> None:  # noqa: ANN001
    """vLLM's ValueError for a pooling method of a generative model (embed and classify run through encode)."""
    with pytest.raises(ValueError, match=rf"LLM\.{method}\(\) is only supported for pooling models"):
        call(llm)
    assert_idle(llm)
