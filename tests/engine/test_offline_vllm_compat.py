"""The offline LLM / SamplingParams / RequestOutput as a vLLM 0.26 script uses them, on the trained tiny dense
checkpoint (fp32, CPU, greedy, a few tokens): the forms vLLM takes and the values and attributes it gives.

Prompts: vLLM's prompt_to_seq / parse_dec_only_prompt take a bare list of token ids as one prompt and a list of such
lists as a batch (vllm/renderers/inputs/preprocess.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import RequestOutputKind, SamplingParams
from deltaserve.tiny.trained import trained_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
IDS = [[5, 17, 99, 300, 41], [7, 8, 9]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(trained_model_dir("dense"), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4)


def tokens(outputs: list) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_token_id_lists_are_prompts(llm: LLM) -> None:
    """[1, 2, 3] is one prompt and [[...], [...]] a batch, as {"prompt_token_ids": ...} would be."""
    expected = llm.generate([{"prompt_token_ids": ids} for ids in IDS], GREEDY, use_tqdm=False)
    (single,) = llm.generate(IDS[0], GREEDY, use_tqdm=False)
    assert single.prompt_token_ids == IDS[0] and single.prompt is None
    assert tokens([single]) == tokens(expected[:1])
    batch = llm.generate(IDS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in batch] == IDS and tokens(batch) == tokens(expected)
    mixed = llm.generate([IDS[0], "hello", {"prompt_token_ids": IDS[1]}], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in mixed][::2] == IDS
    with pytest.raises(TypeError, match="Token prompt should be a list of integers"):
        llm.generate([[1, "x"]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="Prompt text should be a string"):
        llm.generate({"prompt": [1, 2]}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_output_fields_as_vllms(llm: LLM) -> None:
    """vLLM's CompletionOutput.finished() is a method; cumulative_logprob is None unless logprobs were asked for
    (vLLM's LogprobsProcessor); the fields for LoRA, routed experts, encoder prompts and KV / encoder-cache transfer
    exist and are None, as vLLM gives them for this model."""
    (plain,) = llm.generate("hello", GREEDY, use_tqdm=False)
    completion = plain.outputs[0]
    assert completion.finished() is True and completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.cumulative_logprob is None and completion.logprobs is None
    assert completion.lora_request is None and completion.routed_experts is None
    for name in ("lora_request", "encoder_prompt", "encoder_prompt_token_ids", "kv_transfer_params",
                 "ec_transfer_params", "prompt_logprobs"):  # fmt: skip
        assert getattr(plain, name) is None, name
    (scored,) = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1),
                             use_tqdm=False)  # fmt: skip
    entries = scored.outputs[0].logprobs
    chosen = sum(entry[token].logprob for entry, token in zip(entries, scored.outputs[0].token_ids, strict=True))
    assert isinstance(scored.outputs[0].cumulative_logprob, float)
    assert scored.outputs[0].cumulative_logprob == pytest.approx(chosen)


def test_sampling_params_normalised_as_vllms(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's SamplingParams.__post_init__: None is an empty stop / stop_token_ids / bad_words (TypeError here
    before), seed -1 is no seed, logprobs=True is 1, and a temperature in (0, 0.01) is raised to 0.01 with a warning
    (below that it sampled at the caller's temperature)."""
    params = SamplingParams(stop=None, stop_token_ids=None, bad_words=None, seed=-1, logprobs=True,
                            prompt_logprobs=True, max_tokens=2)  # fmt: skip
    assert (params.stop, params.stop_token_ids, params.bad_words, params.seed) == ([], [], [], None)
    assert params.logprobs == 1 and params.prompt_logprobs == 1 and type(params.logprobs) is int
    (out,) = llm.generate("hello", params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2 and len(out.outputs[0].logprobs[0]) <= 2
    with caplog.at_level("WARNING", logger="deltaserve.sampling_params"):
        assert SamplingParams(temperature=0.001).temperature == 0.01
    assert "maxed it out to 0.01" in caplog.text
    assert SamplingParams(temperature=0.0).temperature == 0.0 and SamplingParams(seed=-2).seed == -2


def test_vllms_other_sampling_keywords(llm: LLM) -> None:
    """detokenize=False gives the same tokens with no text (vLLM's output processor drops the tokenizer: text "",
    decoded_token None) and refuses stop strings as vLLM does; output_kind, extra_args and skip_clone are taken (the
    offline LLM returns final outputs whatever output_kind says, as vLLM's sets FINAL_ONLY); clone() and
    from_optional() are vLLM's. These keywords raised TypeError before."""
    scored = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, "logprobs": 1, "prompt_logprobs": 1}
    (text,) = llm.generate("hello", SamplingParams(**scored), use_tqdm=False)
    (ids_only,) = llm.generate("hello", SamplingParams(detokenize=False, **scored), use_tqdm=False)
    assert ids_only.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert ids_only.outputs[0].text == "" and ids_only.outputs[0].finish_reason == "length"
    assert all(lp.decoded_token is None for entry in ids_only.outputs[0].logprobs for lp in entry.values())
    assert all(lp.decoded_token is None for entry in ids_only.prompt_logprobs[1:] for lp in entry.values())
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(detokenize=False, stop=["x"])
    kinds = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    params = [SamplingParams(output_kind=kind, extra_args={"plugin": 1}, **scored) for kind in kinds]
    assert tokens(llm.generate(["hello"] * 3, params, use_tqdm=False)) == tokens([text]) * 3
    original = SamplingParams(stop=["a"], logit_bias={"5": 300})
    deep, shallow = original.clone(), SamplingParams(stop=["a"], skip_clone=True).clone()
    assert deep == original and deep.stop is not original.stop and deep.logit_bias == {5: 100.0}
    assert shallow.stop == ["a"] and shallow.skip_clone
    optional = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None, top_k=5)
    assert (optional.n, optional.temperature, optional.top_p, optional.presence_penalty, optional.top_k) == (
        1, 1.0, 1.0, 0.0, 5,
    )  # fmt: skip


def test_vllms_names_for_the_engine_and_prompts(llm: LLM) -> None:
    """`from vllm import TokensPrompt, TextPrompt` and `llm.llm_engine.get_tokenizer()` as vLLM scripts write them."""
    from deltaserve import RequestOutputKind as Kind
    from deltaserve import TextPrompt, TokensPrompt

    assert Kind is RequestOutputKind
    prompts = [TokensPrompt(prompt_token_ids=IDS[0]), TextPrompt(prompt="hello")]
    assert prompts[0] == {"prompt_token_ids": IDS[0]}
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outputs[0].prompt_token_ids == IDS[0] and outputs[1].prompt == "hello"
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    llm.enqueue(IDS[0], SamplingParams(n=2, max_tokens=2, seed=1), use_tqdm=False)
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 2  # vLLM counts the n
    assert len(llm.wait_for_completion(use_tqdm=False)[0].outputs) == 2
    assert engine.get_num_unfinished_requests() == 0


def test_per_prompt_lora_list_of_none_runs(llm: LLM) -> None:
    """vLLM takes lora_request as one per prompt; a list of None asks for no adapter and runs."""
    outputs = llm.generate(IDS, GREEDY, use_tqdm=False, lora_request=[None, None])
    assert [o.prompt_token_ids for o in outputs] == IDS
    assert len(llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, lora_request=(None,))) == 1


def test_stop_reason_of_each_eos_as_vllms(llm: LLM) -> None:
    """vLLM stops on the tokenizer's eos with stop_reason None and on generation_config's other eos ids as stop token
    ids, whose stop_reason is the id (update_from_generation_config adds them to stop_token_ids); a stop token id's
    stop_reason is the id, a stop string's the string, max_tokens' None with finish_reason "length"."""
    tokenizer = llm.get_tokenizer()
    primary, end_of_text = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert primary != end_of_text and end_of_text in llm.engine.eos_token_ids  # generation_config's [im_end, eot]

    def finish(**params: object) -> tuple:
        (out,) = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=4, **params), use_tqdm=False)
        return out.outputs[0].finish_reason, out.outputs[0].stop_reason, out.outputs[0].token_ids, out.outputs[0].text

    assert finish(logit_bias={primary: 100}) == ("stop", None, [primary], "")
    assert finish(logit_bias={end_of_text: 100}) == ("stop", end_of_text, [end_of_text], "")
    assert finish(logit_bias={end_of_text: 100}, ignore_eos=True)[:2] == ("length", None)
    first = finish(ignore_eos=True)[2][0]
    assert finish(stop_token_ids=[first]) == ("stop", first, [first], "")
    word = tokenizer.decode([first])
    assert finish(stop=[word], include_stop_str_in_output=True)[:2] == ("stop", word)


def test_vllms_engine_keywords_as_the_servers_flags(caplog: pytest.LogCaptureFixture) -> None:
    """LLM(model, trust_remote_code=True, ...) as vLLM scripts build it: the keywords of the server's vLLM flags that
    deltaserve does not implement are logged or refused by name, by the same table (vllm_flags.py); they raised
    TypeError. A name vLLM does not have either is still a TypeError."""
    settings = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "max_num_seqs": 1}
    with caplog.at_level("INFO", logger="deltaserve.vllm_flags"):
        llm = LLM(trained_model_dir("dense"), trust_remote_code=True, swap_space=4, enable_chunked_prefill=True,
                  kv_cache_dtype="auto", tokenizer_mode="auto", hf_overrides=None, **settings)  # fmt: skip
    assert "ignoring trust_remote_code=True" in caplog.text and "ignoring swap_space=4" in caplog.text
    assert len(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3
    for keyword, value in (("hf_overrides", {"num_hidden_layers": 1}), ("tokenizer_mode", "mistral"),
                           ("enable_lora", True), ("skip_tokenizer_init", True)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{keyword}=.*: not supported by deltaserve"):
            LLM(trained_model_dir("dense"), **{keyword: value}, **settings)
    with pytest.raises(TypeError, match="no_such_engine_arg"):
        LLM(trained_model_dir("dense"), no_such_engine_arg=1, **settings)


def test_chat_takes_vllms_conversation_forms(llm: LLM) -> None:
    """vLLM's conversation_to_seq: one conversation (a list of message dicts), a list or tuple of them, or [] (no
    conversation: an empty result, where a ValueError was raised)."""
    conversation = [{"role": "user", "content": "hi"}]
    assert llm.chat([], GREEDY, use_tqdm=False) == []
    (one,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    both = llm.chat((conversation, conversation), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in both] == [one.prompt_token_ids] * 2


def test_llm_engine_add_request_takes_vllms_prompts(llm: LLM) -> None:
    """vLLM's LLMEngine loop (`engine.add_request(id, prompt, params)`, `engine.step()` until
    `has_unfinished_requests()` is false): a string, a TokensPrompt and a TextPrompt give generate()'s tokens, each
    step's output as its output_kind asks (cumulative by default, deltas, or the final output only); the id comes
    back; vLLM's refusal of a non-string id, and deltaserve's of lora_request / tokenization_kwargs."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (expected,) = llm.generate("hello there", params, use_tqdm=False)
    engine = llm.llm_engine
    ids = llm.get_tokenizer().encode("hello there")
    prompts = {"text": "hello there", "tokens": {"prompt_token_ids": ids}, "dict": {"prompt": "hello there"}}
    assert [engine.add_request(name, prompt, params) for name, prompt in prompts.items()] == list(prompts)
    want = list(expected.outputs[0].token_ids)
    seen: dict[str, list[list[int]]] = {name: [] for name in prompts}
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():  # cumulative: vLLM's default output_kind
            seen[output.request_id].append(list(output.outputs[0].token_ids))
            if output.finished:
                finished[output.request_id] = output
    assert {name: lists[-1] for name, lists in seen.items()} == dict.fromkeys(prompts, want)
    assert all(lists == [want[: len(t)] for t in lists] and len(lists) > 1 for lists in seen.values())
    assert finished["text"].prompt == "hello there" and finished["tokens"].prompt is None
    assert finished["text"].outputs[0].text == expected.outputs[0].text
    # DELTA: what is new each step; FINAL_ONLY: one output, the whole one, once finished
    kinds = {"delta": RequestOutputKind.DELTA, "final": RequestOutputKind.FINAL_ONLY}
    for name, kind in kinds.items():
        engine.add_request(name, "hello there", dataclasses.replace(params, output_kind=kind))
    by_kind: dict[str, list] = {name: [] for name in kinds}
    while engine.has_unfinished_requests():
        for output in engine.step():
            by_kind[output.request_id].append(output)
    assert [t for out in by_kind["delta"] for t in out.outputs[0].token_ids] == want and len(by_kind["delta"]) > 1
    assert [(out.finished, list(out.outputs[0].token_ids)) for out in by_kind["final"]] == [(True, want)]
    with pytest.raises(TypeError, match="request_id must be a string, got <class 'int'>"):
        engine.add_request(7, "hello", params)
    with pytest.raises(ValueError, match="lora_request"):
        engine.add_request("lora", "hello", params, lora_request=object())
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        engine.add_request("tok", "hello", params, tokenization_kwargs={"truncation": True})
    assert not engine.has_unfinished_requests()
