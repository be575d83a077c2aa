"""Engine tests on the tiny models (CPU, fp32): batching invariance, chunking, preemption, aborts, sampling."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir


def make_prompts(num: int, seed: int, max_len: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randint(1, max_len))] for _ in range(num)]


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference_outputs(tiny_dense: Path) -> tuple[list[list[int]], list[list[int]]]:
    """16 mixed-length requests generated one at a time (the unbatched reference)."""
    llm = LLM(tiny_dense, dtype="float32", max_num_seqs=1)
    prompts = make_prompts(16, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return prompts, [generate_ids(llm, [p], params)[0] for p in prompts]


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "block_size"), [(2048, 16), (37, 16), (64, 4), (7, 32)]
)  # fmt: skip
def test_batched_equals_unbatched(
    tiny_dense: Path, reference_outputs: tuple[list[list[int]], list[list[int]]], max_num_batched_tokens: int,
    block_size: int,
) -> None:  # fmt: skip
    prompts, expected = reference_outputs
    llm = LLM(tiny_dense, dtype="float32", max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
              block_size=block_size)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert generate_ids(llm, prompts, params) == expected


def test_soak_with_aborts_and_preemptions(tiny_dense: Path) -> None:
    """200 random requests, random aborts (of running, waiting and once-preempted requests), forced and natural
    preemptions: everything frees, survivors match unbatched. (200 requests with aborts at 0.12 and forced
    preemptions at 0.08 a step reach every kind of abort and preemption that 500 at 0.08 / 0.05 did, at 2/5 of the
    unbatched replays that dominate the cost; the asserts on `abort_kinds` and the preemption counts keep it so.)"""
    rng = random.Random(7)
    llm = LLM(tiny_dense, dtype="float32", max_num_seqs=12, max_num_batched_tokens=48, block_size=4,
              cpu_kv_cache_bytes=600_000, max_model_len=64)  # fmt: skip
    engine = llm.engine
    scheduler = engine.scheduler
    prompts = make_prompts(200, seed=3, max_len=24)
    lengths = [rng.randint(1, 8) for _ in prompts]
    aborted: set[str] = set()
    abort_kinds: set[str] = set()
    results: dict[str, list[int]] = {}
    collected: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    num_forced_preemptions = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 6)):
            if pending:
                i = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
                engine.add_request(str(i), prompts[i], params)
        if engine.requests and rng.random() < 0.12:
            victim = rng.choice(sorted(engine.requests))
            for seq in [*scheduler.running, *scheduler.waiting]:
                if seq.seq_id == victim:
                    abort_kinds.add(seq.status.name.lower())
                    abort_kinds.update(["once preempted"] if seq.num_preemptions else [])
            engine.abort_request(victim)
            aborted.add(victim)
        if rng.random() < 0.08:
            num_forced_preemptions += scheduler.preempt_all()
        for output in engine.step(by_output_kind=False):
            collected.setdefault(output.request_id, []).extend(output.outputs[0].token_ids if output.outputs else [])
            if output.finished:
                results[output.request_id] = collected[output.request_id]
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.num_free_state_slots == stats.num_total_state_slots
    assert abort_kinds == {"running", "waiting", "once preempted"}
    # forced ones, and the scheduler's own when the KV cache runs out
    assert num_forced_preemptions > 0 and scheduler.num_preemptions_total > num_forced_preemptions
    survivors = [i for i in range(len(prompts)) if str(i) not in aborted]
    assert set(results) == {str(i) for i in survivors}
    single = LLM(tiny_dense, dtype="float32", max_num_seqs=1)
    for i in survivors:
        params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
        assert results[str(i)] == generate_ids(single, [prompts[i]], params)[0], f"request {i}"


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32", max_num_seqs=8)
    prompt = make_prompts(1, seed=11)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = generate_ids(llm, [prompt], params)[0]
    others = make_prompts(5, seed=12)
    mixed = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 5
    outputs = llm.generate([{"prompt_token_ids": p} for p in others + [prompt]], mixed + [params], use_tqdm=False)
    assert outputs[-1].outputs[0].token_ids == alone
    other_seed = generate_ids(llm, [prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))
    assert other_seed[0] != alone


def test_n_sequences_and_logprobs(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32")
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=2, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    for completion in output.outputs:
        assert len(completion.logprobs) == 6
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and 2 <= len(entry) <= 3
            assert entry[token].logprob <= 0.0


def test_minus_one_logprobs_are_the_whole_vocabulary(tiny_dense: Path) -> None:
    """vLLM's -1 for logprobs and prompt_logprobs: every token of the vocabulary at every position (the engine
    resolves it for the runner; the caller's SamplingParams keeps its -1), under LLM(max_logprobs=-1) as in vLLM
    (its default 20 refuses a count of the vocabulary)."""
    llm = LLM(tiny_dense, dtype="float32", max_logprobs=-1)
    vocab_size = llm.engine.frontend.vocab_size
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert params.logprobs == -1 and params.prompt_logprobs == -1
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == 3
    entries = output.prompt_logprobs[1:] + [entry for c in output.outputs for entry in c.logprobs]
    assert len(entries) == 2 + 2 * 2
    for entry in entries:
        assert len(entry) == vocab_size
        assert math.isclose(sum(math.exp(lp.logprob) for lp in entry.values()), 1.0, rel_tol=1e-3)
    with pytest.raises(ValueError, match="logprobs must be non-negative or -1, got -2"):
        SamplingParams(logprobs=-2)


def test_stop_string_split_across_tokens(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32")
    prompt = make_prompts(1, seed=21)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    pieces = [tokenizer.decode(full.outputs[0].token_ids[: i + 1]) for i in range(24)]
    text = full.outputs[0].text
    # a stop string that straddles a token boundary: the last char of one token and the first of the next
    boundary = next(
        i
        for i in range(3, 23)
        if len(pieces[i]) > len(pieces[i - 1]) > 0
        and text.count(text[len(pieces[i - 1]) - 1 : len(pieces[i - 1]) + 1]) == 1
    )
    stop = text[len(pieces[boundary - 1]) - 1 : len(pieces[boundary - 1]) + 1]
    (out,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )  # fmt: skip
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]
    (kept,) = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_prompt_too_long_is_rejected(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="maximum"):
        llm.generate([{"prompt_token_ids": [1] * 64}], SamplingParams(max_tokens=1), use_tqdm=False)
    # a max_tokens past the context is capped there, as vLLM's offline LLM does (its test_max_model_len)
    (output,) = llm.generate([{"prompt_token_ids": [1] * 10}], SamplingParams(max_tokens=60, ignore_eos=True),
                             use_tqdm=False)  # fmt: skip
    assert len(output.outputs[0].token_ids) == 54 and output.outputs[0].finish_reason == "length"


def _mixed_workload(llm: LLM, seed: int) -> list[list[list[int]]]:
    """Greedy and seeded requests of every kind (n > 1, penalties, logprobs, min_tokens, stop strings, eos), added
    in waves between steps while the cache is too small for all of them, with forced preemptions: token ids of every
    sequence of every request, in request order."""
    rng = random.Random(seed)
    engine = llm.engine
    prompts = make_prompts(40, seed=seed, max_len=30)
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_p": 0.9, "seed": 11},
        {"temperature": 1.0, "top_k": 20, "seed": 12, "n": 2},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2},
        {"temperature": 0.7, "seed": 13, "min_p": 0.05, "logprobs": 2},
        {"temperature": 0.0, "min_tokens": 4, "stop": ["e "]},
        {"temperature": 0.9, "seed": 14, "min_tokens": 3},
    ]
    collected: dict[str, dict[int, list[int]]] = {}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                i = pending.pop(0)
                params = SamplingParams(max_tokens=rng.randint(5, 14), **kinds[i % len(kinds)])
                engine.add_request(str(i), prompts[i], params)
        step += 1
        if step % 9 == 0:
            engine.scheduler.preempt_all()
        for output in engine.step(by_output_kind=False):
            for completion in output.outputs:
                collected.setdefault(output.request_id, {}).setdefault(completion.index, []).extend(
                    completion.token_ids
                )
    assert engine.scheduler.num_preemptions_total > 0
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.num_free_state_slots == stats.num_total_state_slots
    return [[collected[str(i)][k] for k in sorted(collected[str(i)])] for i in range(len(prompts))]


def test_async_scheduling_matches_the_synchronous_path(tiny_dense: Path) -> None:
    """Planning step N+1 before step N's tokens are known changes nothing a request sees: greedy and seeded tokens
    are identical to the synchronous path over a mixed, preempting workload."""
    config = {"dtype": "float32", "max_num_seqs": 6, "max_num_batched_tokens": 40, "block_size": 4,
              "cpu_kv_cache_bytes": 500_000, "max_model_len": 64}  # fmt: skip
    synchronous = _mixed_workload(LLM(tiny_dense, async_scheduling=False, **config), seed=5)
    asynchronous = _mixed_workload(LLM(tiny_dense, async_scheduling=True, **config), seed=5)
    assert asynchronous == synchronous
    assert sum(len(s) for request in synchronous for s in request) > 200


def test_engine_seed_seeds_unseeded_sampling(tiny_dense: Path) -> None:
    """--seed (the engine seed) drives the generator that unseeded requests share, as vLLM's does."""
    prompt = make_prompts(1, seed=31)[0]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = generate_ids(LLM(tiny_dense, dtype="float32", seed=1), [prompt], params)
    again = generate_ids(LLM(tiny_dense, dtype="float32", seed=1), [prompt], params)
    other = generate_ids(LLM(tiny_dense, dtype="float32", seed=2), [prompt], params)
    assert first == again and first != other


def test_default_max_num_seqs_is_vllms_capped_by_state_memory(tiny_dense: Path) -> None:
    roomy = LLM(tiny_dense, dtype="float32").engine.runner
    assert roomy.max_num_seqs == 256  # vLLM's default off large GPUs; the tiny state pool fits it
    slot_bytes = roomy.layout.bytes_per_slot
    tight = LLM(tiny_dense, dtype="float32", cpu_kv_cache_bytes=40 * slot_bytes, max_model_len=64).engine.runner
    assert tight.max_num_seqs == 20  # half of the budget for state slots
    # beside them, the prefix cache's checkpoint slots: a tenth of the budget (4 slots), at most max_num_seqs
    assert tight.layout.num_checkpoint_slots == 4
    assert (
        tight.layout.num_slots == 20 + 4 and tight.layout.num_blocks * tight.layout.bytes_per_block <= 20 * slot_bytes
    )


def test_gpu_memory_utilization_is_a_per_instance_share_as_in_vllm() -> None:
    """vLLM 0.26 (request_memory): utilization x total belongs to the instance whatever other processes hold, and a
    device with less than that free is refused at start-up with vLLM's message."""
    from deltaserve.runner.cache import requested_bytes

    total = 100 * 2**30
    # another engine already holds 45 %: a second one at 0.45 still gets its whole 45 % (the old rule left ~0)
    assert requested_bytes(total, 55 * 2**30, 0.45) == math.ceil(total * 0.45)
    with pytest.raises(ValueError, match="less than desired GPU memory utilization") as excinfo:
        requested_bytes(total, 55 * 2**30, 0.9)
    assert "(0.9, 90.00 GiB)" in str(excinfo.value) and "55.00/100.00 GiB" in str(excinfo.value)


def test_serving_model_runs_each_gdn_layers_input_projections_as_one_gemm(tiny_next: Path) -> None:
    """GatedDeltaNet.fuse_in_proj (the runner calls it after loading): one [qkvz | ba] weight, the old names as views
    of its rows; the gates' fp32 STRICT runs check the tokens through it."""
    model = LLM(tiny_next, dtype="float32").engine.runner.model
    names = {name for name, _ in model.named_parameters()}
    layers = [layer.linear_attn for layer in model.layers if not layer.is_full_attention]
    assert layers and not any("in_proj_qkvz" in n or "in_proj_ba" in n for n in names)
    for gdn in layers:
        fused, rows = gdn.in_proj, gdn.in_proj_qkvz.shape[0]
        assert fused.shape[0] == rows + 2 * gdn.num_v_heads
        assert gdn.in_proj_qkvz.data_ptr() == fused.data_ptr()
        assert gdn.in_proj_ba.data_ptr() == fused[rows:].data_ptr()
        gdn.fuse_in_proj()  # idempotent
        assert gdn.in_proj is fused


def test_a_step_that_raises_leaves_no_request_behind(tiny_dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model error mid-step reaches the caller; its requests are aborted (blocks and slots freed), so the next
    generate call serves instead of waiting forever on a request no step will ever advance."""
    llm = LLM(tiny_dense, dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    (before,) = llm.generate(["Hello there"], params, use_tqdm=False)
    runner = llm.engine.core.runner
    execute = runner.execute
    calls = {"n": 0}

    def failing(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:  # the second step: one has launched, one is in flight when it fails
            raise RuntimeError("injected model error")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["Hello there", "Another prompt"], params, use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.core.sequences  # aborted (a launched step may still drain)
    monkeypatch.setattr(runner, "execute", execute)
    (after,) = llm.generate(["Hello there"], params, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_generate_takes_vllms_keywords_and_the_checkpoints_defaults() -> None:
    """vLLM's LLM.generate keywords: lora_request / tokenization_kwargs / mm_processor_kwargs as None run (lm-eval
    passes lora_request=None), set they are refused by name; sampling_params None is get_default_sampling_params(),
    the checkpoint's generation_config.json (the trained dense one: temperature 0.6, top_p 0.95, top_k 20)."""
    llm = LLM(trained_model_dir("dense"), dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    (out,) = llm.generate("hello", params, use_tqdm=False, lora_request=None, tokenization_kwargs=None,
                          mm_processor_kwargs=None)  # fmt: skip
    assert len(out.outputs[0].token_ids) == 3
    for keyword, value in (("lora_request", object()), ("tokenization_kwargs", {"truncation": True}),
                           ("mm_processor_kwargs", {"fps": 2})):  # fmt: skip
        with pytest.raises(ValueError, match=keyword):
            llm.generate("hello", params, use_tqdm=False, **{keyword: value})
    assert not llm.engine.has_unfinished()
