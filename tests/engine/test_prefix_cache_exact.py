"""Hybrid prefix caching is exact (docs/prefix-caching.md): greedy tokens with the cache on equal those with it off,
fp32 on the CPU, on the trained tiny dense / moe / next, for prefixes shared up to inside a block, a block boundary,
a 64-token checkpoint and inside a chunk, under chunked prefill (a 96-token budget), preemption (forced, in a small
KV pool), async scheduling on and off, n = 2, a multi-turn follow-up (it hits the first turn's whole
history), prompt logprobs (computed, never read from the cache, the same bits) and images (another image never hits
past it). On the GPU, lm-eval's scoring traffic in bf16: prompt logprobs of continuations of one context, the same
bits with the cache on and off (docs/lm-eval.md).
"""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.multimodal.offline import loaded_media
from deltaserve.runner.cache import bytes_per_block, bytes_per_slot
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.multimodal.synthetic import synthetic_image, synthetic_video

CORPUS = (Path(__file__).parents[2] / "deltaserve" / "tiny" / "corpus.txt").read_text()
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NUM_BLOCKS = 28  # a small pool: checkpoints are evicted for running sequences


def make_llm(model_dir: Path, is_on: bool, is_async: bool) -> LLM:
    config = ModelConfig.from_pretrained(model_dir)
    budget = NUM_BLOCKS * bytes_per_block(config, 16, torch.float32) + 8 * bytes_per_slot(config, torch.float32)
    return LLM(
        model_dir, dtype="float32", device="cpu", max_model_len=400, max_num_seqs=4, max_num_batched_tokens=96,
        cpu_kv_cache_bytes=budget, enable_prefix_caching=is_on, async_scheduling=is_async,
        prefix_cache_checkpoint_interval=128,
    )  # fmt: skip


def run(
    llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]], mm: dict | None = None, preempt_at: int = -1
) -> dict[str, list]:
    """Runs the requests together (every running one preempted after step preempt_at); name -> the token ids of each
    of its completions (name/prompt: its prompt logprobs)."""
    engine = llm.engine
    states = {}
    for name, (ids, params) in requests.items():
        engine.add_request(name, ids, params, mm_input=(mm or {}).get(name))
        states[name] = engine.requests[name]
    for step in itertools.count():
        if not engine.has_unfinished():
            break
        if step == preempt_at:
            engine.scheduler.preempt_all()
        engine.step()
    outputs: dict[str, list] = {}
    for name, state in states.items():
        final = state.final_output()
        outputs[name] = [list(c.token_ids) for c in final.outputs]
        if final.prompt_logprobs:
            outputs[name + "/prompt"] = final.prompt_logprobs
    return outputs


def hits_of(llm: LLM, requests: dict, mm: dict | None = None, preempt_at: int = -1) -> tuple[dict[str, list], int]:
    """run(), and the tokens the scheduler served from the cache meanwhile."""
    before = llm.engine.scheduler.prefix_cache_hits
    outputs = run(llm, requests, mm, preempt_at)
    return outputs, llm.engine.scheduler.prefix_cache_hits - before


def scenario(llm: LLM) -> tuple[dict[str, list], dict[str, int]]:
    tokens = llm.engine.tokenizer.encode(CORPUS)
    base, other = tokens[:200], tokens[300:]
    outputs, hits = {}, {}
    outputs |= run(llm, {"base": (base, GREEDY)})
    # one token past the base prompt's end checkpoint: the resumed prefill is a single token (planned like a decode)
    out, hits["one-more"] = hits_of(llm, {"one-more": (base + other[:1], GREEDY)})
    outputs |= out
    for wave in range(2):  # the first wave leaves branch checkpoints, the second hits them
        suffix = other[40 * wave : 40 * wave + 20]
        cut = {"mid-block": 150, "block": 160, "grid": 128, "in-chunk": 100, "whole": 200}
        wave_out, hits[f"wave{wave}"] = hits_of(
            llm, {f"{name}{wave}": (base[:at] + suffix, GREEDY) for name, at in cut.items()}, preempt_at=6
        )
        outputs |= wave_out
    n2 = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)  # seeded: greedy n > 1 is refused
    outputs |= run(llm, {"n2": (base[:180] + other[:5], n2)})
    # a conversation: turn 2 re-sends turn 1's prompt and answer, and hits the state its generation ended with
    turn1 = other[200:330]
    outputs |= run(llm, {"turn1": (turn1, GREEDY)})
    turn2 = turn1 + outputs["turn1"][0] + other[400:420]
    out, hits["turn2"] = hits_of(llm, {"turn2": (turn2, GREEDY)})
    outputs |= out
    logprobs = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    out, hits["prompt_logprobs"] = hits_of(llm, {"lp": (turn2 + other[:3], logprobs)})
    outputs |= out
    hits["turn1_len"] = len(turn1) + len(outputs["turn1"][0])
    return outputs, hits


@pytest.fixture(scope="module", params=[("dense", True), ("dense", False), ("moe", True), ("next", True)],
                ids=["dense-async", "dense-sync", "moe-async", "next-async"])  # fmt: skip
def results(request: pytest.FixtureRequest) -> tuple:
    variant, is_async = request.param
    model_dir = trained_model_dir(variant)
    off = make_llm(model_dir, False, is_async)
    on = make_llm(model_dir, True, is_async)
    return scenario(off), scenario(on), on.engine.scheduler


def test_greedy_tokens_with_the_cache_equal_tokens_without(results: tuple) -> None:
    (off, off_hits), (on, on_hits), scheduler = results
    assert off_hits["wave0"] == off_hits["wave1"] == 0
    prompt_lp_off, prompt_lp_on = off.pop("lp/prompt"), on.pop("lp/prompt")
    assert on.keys() == off.keys() and len(on["n2"]) == 2
    for name in off:
        assert on[name] == off[name], name
    # prompt logprobs are computed (the request reads no cache), in the chunks the cache-off run cuts (no branch or
    # periodic checkpoint cuts them): the same bits
    assert prompt_lp_on == prompt_lp_off
    assert scheduler.num_preemptions_total > 0


def test_hits_where_the_prefixes_are_shared(results: tuple) -> None:
    _, (_, hits), scheduler = results
    # wave 1: every request hits at least the 64-token checkpoints its prefix shares with the base prompt (wave 0
    # hits too: its preempted requests resume from their own checkpoints)
    assert hits["wave1"] >= 4 * 64 and hits["wave0"] > 0
    # turn 2 resumes where turn 1's generation ended: its prompt and every answer token but the last one
    assert hits["turn2"] == hits["turn1_len"] - 1
    assert hits["prompt_logprobs"] == 0 and hits["one-more"] == 200
    assert scheduler.prefix_cache_queries > scheduler.prefix_cache_hits > 0


@pytest.mark.parametrize("modality", ["image", "video"])
def test_another_item_never_hits_past_it_and_the_same_item_does(modality: str) -> None:
    """The same text with another image (or video) hits nothing past the item's placeholder; the same item hits the
    checkpoint a sibling request left past it. The items come as the offline API's arrays (multimodal/offline.py:
    each item's identity is its shape and bytes)."""
    from tests.support.vision import case_for

    case = case_for("dense-vl")
    if modality == "image":
        arrays = {seed: synthetic_image(96, 128, seed) for seed in (1, 5)}
    else:
        arrays = {seed: (synthetic_video(4, 96, 128, seed), 3.0) for seed in (1, 5)}

    def prompt(text: str, seed: int) -> tuple[list[int], object]:
        part = {"type": f"{modality}_url", f"{modality}_url": {"url": "unused"}}
        content = [part, {"type": "text", "text": text}]
        chat = case.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)  # fmt: skip
        items = loaded_media({modality: [arrays[seed]]}, 2.0)
        return case.processor.process_loaded(case.tokenizer.encode(chat, add_special_tokens=False), items)

    texts = {
        "first": ("Describe the lighthouse keeper's notebook and the colour of the sea in detail.", 1),
        "second": ("Describe the lighthouse keeper's notebook and the wind.", 1),
        "same": ("Describe the lighthouse keeper's notebook and the ships.", 1),
        "other": ("Describe the lighthouse keeper's notebook and the ships.", 5),
    }
    prompts = {name: prompt(text, seed) for name, (text, seed) in texts.items()}
    assert prompts["same"][0] == prompts["other"][0]  # the same token ids: only the item differs
    item_offset = prompts["other"][1].items[0].offset
    per_engine = []
    for is_on in (False, True):
        llm = LLM(case.model_dir, dtype="float32", device="cpu", max_model_len=512, enable_prefix_caching=is_on)
        outputs, hits = {}, {}
        for name, (ids, mm) in prompts.items():
            out, hits[name] = hits_of(llm, {name: (ids, GREEDY)}, {name: mm})
            outputs |= out
        per_engine.append((outputs, hits))
    (off, _), (on, hits) = per_engine
    assert on == off
    assert hits["same"] >= 64 > item_offset  # the branch checkpoint "second" left past the item
    assert hits["other"] <= item_offset


def test_array_items_of_equal_bytes_and_another_shape_are_other_items() -> None:
    """Two solid images of swapped sides (the same bytes, and the same token count) are two items, and two equal
    videos at another frame rate too: the prefix cache never takes one's KV for the other's."""
    wide, tall = np.zeros((32, 64, 3), np.uint8), np.zeros((64, 32, 3), np.uint8)
    assert wide.tobytes() == tall.tobytes()
    (a,), (b,) = loaded_media({"image": [wide]}, 2.0), loaded_media({"image": [tall]}, 2.0)
    assert a.digest != b.digest
    (c,), (d,) = loaded_media({"image": [wide.copy()]}, 2.0), loaded_media({"image": [wide]}, 2.0)
    assert c.digest == a.digest == d.digest
    frames = synthetic_video(4, 32, 64, 1)
    one, two = loaded_media({"video": [(frames, 3.0), (frames, 6.0)]}, 2.0)
    assert one.digest != two.digest
    (flat,) = loaded_media({"video": [(frames.reshape(4, 64, 32, 3), 3.0)]}, 2.0)
    assert flat.digest != one.digest


def scoring_prompt_logprobs(variant: str, device: str, dtype: str, is_on: bool) -> list:
    """lm-eval's loglikelihood traffic (docs/lm-eval.md): three continuations of one 150-token context, each asking
    for its prompt's logprobs with max_tokens 1, one at a time; their prompt logprobs."""
    options = {"gpu_memory_utilization": 0.3} if device == "cuda" else {}
    llm = LLM(trained_model_dir(variant), dtype=dtype, device=device, max_model_len=256, max_num_seqs=2,
              enable_prefix_caching=is_on, **options)  # fmt: skip
    tokens = llm.engine.tokenizer.encode(CORPUS[:4000])
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    prompts = [tokens[:150] + tokens[400 + 12 * i : 412 + 12 * i] for i in range(3)]
    found = [run(llm, {f"c{i}": (prompt, params)})[f"c{i}/prompt"] for i, prompt in enumerate(prompts)]
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_scoring_prompt_logprobs_are_the_same_bits_with_the_cache_on_and_off_in_bf16_on_the_gpu(variant: str) -> None:
    off = scoring_prompt_logprobs(variant, "cuda", "bfloat16", False)
    assert scoring_prompt_logprobs(variant, "cuda", "bfloat16", True) == off
