"""Engine-level checks of the constraints: grammars under async and sync scheduling give the same tokens, an
unconstrained request's greedy tokens do not change when constrained requests share its batch, the static
controls steer tokens, and prompt logprobs equal the log-softmax of the full forward's logits (chunked prefill)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "boolean"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def engines(tiny_dense: Path) -> dict[str, LLM]:
    # small batches force chunked prefill of the longer prompt below
    kwargs = {"device": "cpu", "max_model_len": 256, "max_num_batched_tokens": 16}
    return {"async": LLM(tiny_dense, async_scheduling=True, **kwargs),
            "sync": LLM(tiny_dense, async_scheduling=False, **kwargs)}  # fmt: skip


def constrained_batch() -> list[SamplingParams]:
    def so(**kw: object) -> StructuredOutputsParams:
        return StructuredOutputsParams(**kw)

    return [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, structured_outputs=so(choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=0, max_tokens=12, bad_words=["the", "a b"]),
    ]


def texts(llm: LLM, params: list[SamplingParams]) -> list[tuple[str, tuple[int, ...]]]:
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, tuple(o.outputs[0].token_ids)) for o in outs]


def test_constraints_hold_and_async_equals_sync(engines: dict[str, LLM]) -> None:
    results = {mode: texts(llm, constrained_batch()) for mode, llm in engines.items()}
    assert results["async"] == results["sync"]
    free, as_json, as_regex, as_choice, _ = (text for text, _ in results["async"])
    value = json.loads(as_json)
    assert set(value) == {"name", "n"} and isinstance(value["n"], bool) and len(value["name"]) <= 6
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", as_regex)
    assert as_choice in ("yes", "no", "maybe")
    # the unconstrained row's greedy tokens are the same alone as beside the constrained rows
    alone = texts(engines["async"], [SamplingParams(temperature=0, max_tokens=12)])
    assert alone[0] == results["async"][0]


def test_bad_words_ban_the_greedy_continuation(engines: dict[str, LLM]) -> None:
    llm = engines["async"]
    tokenizer = llm.get_tokenizer()
    ((text, ids),) = texts(llm, [SamplingParams(temperature=0, max_tokens=8)])
    word = tokenizer.decode(ids[1:3])  # a two-token word the model writes unconstrained
    ((banned_text, banned_ids),) = texts(llm, [SamplingParams(temperature=0, max_tokens=8, bad_words=[word])])
    sequence = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    assert banned_ids[:1] == ids[:1]
    windows = {tuple(banned_ids[i : i + len(sequence)]) for i in range(len(banned_ids))}
    assert tuple(sequence) not in windows and banned_ids != ids


def test_static_controls_steer_tokens(engines: dict[str, LLM]) -> None:
    llm = engines["sync"]
    biased_params = SamplingParams(temperature=0, max_tokens=6, logit_bias={300: 100.0})
    allowed_params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=[400, 401, 1300])
    biased, allowed = texts(llm, [biased_params, allowed_params])
    assert set(biased[1]) == {300}
    assert set(allowed[1]) <= {400, 401, 1300}
    # ids past the tokenizer's length but inside config vocab_size are valid (the tiny model pads its vocabulary)
    assert len(llm.get_tokenizer()) <= 1300 < llm.engine.frontend.vocab_size


def test_prompt_logprobs_equal_full_forward(engines: dict[str, LLM]) -> None:
    llm = engines["async"]
    prompt_ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog, then the cat naps again.")
    assert len(prompt_ids) > 16  # more than one prefill chunk
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    reported = out.prompt_logprobs
    assert reported[0] is None and len(reported) == len(prompt_ids)
    # the same 16-token chunks the scheduler ran (max_num_batched_tokens), one forward pass of logits each
    chunks = [16] * (len(prompt_ids) // 16) + ([len(prompt_ids) % 16] if len(prompt_ids) % 16 else [])
    logprobs = llm.prefill_logits(prompt_ids, prefill_chunks=chunks).float().log_softmax(dim=-1)  # [L, V]
    for position in range(1, len(prompt_ids)):
        entry = reported[position]
        target = prompt_ids[position]
        expected = logprobs[position - 1]
        assert abs(entry[target].logprob - expected[target].item()) < 1e-4
        assert entry[target].rank == int((expected >= expected[target]).sum())
        top = torch.topk(expected, 3)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(entry[token_id].logprob - value) < 1e-4


def test_prompt_logprobs_of_n_sequences_are_computed_once(engines: dict[str, LLM]) -> None:
    """n > 1: only the first core request asks the runner for the prompt's logprobs (issue 39); the request still
    reports them, equal to what n = 1 reports."""
    llm = engines["async"]
    prompt_ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog.")
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=2, prompt_logprobs=3, n=3)
    frontend = llm.engine.frontend
    core_requests = frontend.new_request("prompt-logprobs-once", prompt_ids, params)
    frontend.processor.abort("prompt-logprobs-once")  # registered only to be inspected, never submitted
    assert [request.sampling.prompt_logprobs for request in core_requests] == [3, None, None]
    (many,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    (one,) = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=2,
                          prompt_logprobs=3), use_tqdm=False)  # fmt: skip
    assert len(many.outputs) == 3 and len(many.prompt_logprobs) == len(one.prompt_logprobs) == len(prompt_ids)
    assert many.prompt_logprobs[0] is None and one.prompt_logprobs[0] is None
    # a batch of three rows rounds a little differently from one row on the CPU
    for got, want in zip(many.prompt_logprobs[1:], one.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()
        for token_id, logprob in got.items():
            assert abs(logprob.logprob - want[token_id].logprob) < 1e-4
            assert logprob.decoded_token == want[token_id].decoded_token


def test_two_ranks_keep_constraints_and_prompt_logprobs(tiny_dense: Path, engines: dict[str, LLM]) -> None:
    """Tensor parallelism: rank 0 samples the deferred steps and broadcasts the tokens; the prompt-logprob slices
    run their logits gather on every rank. Same tokens and prompt logprobs as one rank."""
    params = [*constrained_batch(), SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)]
    one = engines["async"].generate([PROMPT] * len(params), params, use_tqdm=False)
    llm = LLM(tiny_dense, device="cpu", max_model_len=256, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        two = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    got, want = two[-1].prompt_logprobs, one[-1].prompt_logprobs
    assert len(got) == len(want) and got[0] is None
    for a, b in zip(got[1:], want[1:], strict=True):
        # the row-parallel all-reduces sum in another order: fp32 logprobs agree to ~1e-4, not bit for bit
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a), (a, b)


@pytest.mark.gpu
def test_constraints_through_decode_graphs_async_equals_sync(tiny_dense: Path) -> None:
    """On the GPU: constrained decodes run the CUDA graphs with deferred sampling (the bitmask applies outside the
    graph, on its logits buffer); async and sync scheduling give the same tokens and the JSON parses."""
    import gc

    config = {"dtype": "float32", "max_num_seqs": 16, "max_model_len": 256, "gpu_memory_utilization": 0.3}
    results = {}
    for is_async in (False, True):
        llm = LLM(tiny_dense, async_scheduling=is_async, **config)
        assert llm.engine.runner.graphs is not None
        results[is_async] = texts(llm, constrained_batch() * 3)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results[True] == results[False]
    value = json.loads(results[True][1][0])
    assert set(value) == {"name", "n"}


def test_offline_request_whose_constraint_cannot_be_followed_raises(engines: dict[str, LLM]) -> None:
    """choice ["yes"] with allowed_token_ids holding none of its tokens: generate raises naming the grammar (the
    constraint is never dropped silently), leaves nothing scheduled, and the next call is served."""
    from deltaserve.engine.frontend import RequestError

    llm = engines["sync"]
    no = llm.get_tokenizer().encode("no", add_special_tokens=False)
    choice = StructuredOutputsParams(choice=["yes"])
    with pytest.raises(RequestError, match="grammar rejected sampled token"):
        llm.generate(["Say it"], SamplingParams(temperature=0, max_tokens=4, structured_outputs=choice,
                                                allowed_token_ids=no), use_tqdm=False)  # fmt: skip
    assert not llm.engine.has_unfinished()
    (ok,) = llm.generate(["Say it"], SamplingParams(temperature=0, max_tokens=4, structured_outputs=choice),
                         use_tqdm=False)  # fmt: skip
    assert ok.outputs[0].text == "yes"


def test_a_mask_that_admits_no_token_is_named(tmp_path: Path) -> None:
    """When the last mask filled admitted no token (a tokenizer that cannot spell the grammar: e.g. a word-level
    tokenizer against a JSON schema), the failure says so rather than blaming the sampled token."""
    from deltaserve.engine.grammar import StructuredOutputsConfig
    from deltaserve.engine.structured import ConstraintState, StructuredOutputManager

    class Rejecting:
        is_terminated = False

        def accept(self, token_id: int) -> bool:
            return False

    manager = StructuredOutputManager(tmp_path, None, 64, StructuredOutputsConfig.parse(None))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"]))
    manager.states["r"] = ConstraintState(params, matcher=Rejecting(), last_mask=torch.zeros(2, dtype=torch.int32))
    assert "admits no token of this model's vocabulary at output position 0" in manager.accept("r", [0])
    manager.states["r"] = ConstraintState(params, matcher=Rejecting())
    assert "rejected sampled token 5 at output position 0" in manager.accept("r", [5])


def test_one_compile_a_grammar_and_its_result_outlives_the_requests_that_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests with the same grammar share one compile; when all of them abort while it runs (a compile cannot be
    stopped once started), its result still goes to the cache, so a retry starts at once instead of compiling again
    behind whatever else the two compile threads hold."""
    import threading

    from deltaserve.engine.grammar import StructuredOutputsConfig
    from deltaserve.engine.structured import StructuredOutputManager

    manager = StructuredOutputManager(tmp_path, None, 64, StructuredOutputsConfig.parse(None))
    started, release, compiled = threading.Event(), threading.Event(), []

    def slow_compile(key: str, params: SamplingParams, stop_token_ids: frozenset[int]) -> object:
        started.set()
        release.wait(10)
        compiled.append(key)
        return object()

    class Backend:
        def matcher(self, grammar: object) -> object:
            return ("matcher of", grammar)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    manager._backend = Backend()  # type: ignore[assignment]
    monkeypatch.setattr(manager, "_get_backend", lambda stop_token_ids: manager._backend)
    big = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert not manager.add("r1", big, frozenset()) and not manager.add("r2", big, frozenset())
    assert started.wait(10) and len(manager._inflight) == 1  # one compile for both
    manager.remove("r1")
    manager.remove("r2")  # both gone while it runs
    release.set()
    next(iter(manager._inflight.values())).result(10)  # the compile finishes with no request left
    assert manager.take_ready() == ([], [])  # nobody waits for it now
    assert compiled == [next(iter(manager._cache))]  # but it is cached
    assert manager.add("r3", big, frozenset())  # the retry: ready at once, no second compile
    assert len(compiled) == 1 and manager.states["r3"].matcher[0] == "matcher of"
    manager.shutdown()
