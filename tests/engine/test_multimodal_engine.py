"""Images and video through the whole engine, fp32 on the CPU: the request path (multi_modal_data in the offline
API -> the front end -> the step plan's spans -> the runner's encoder and its per-row cache), chunked prefill with
a tight token budget (images straddle chunk boundaries and share steps with other requests), against transformers'
generate on both tiny vision variants: STRICT 32/32 per prompt. The four-op preamble and --language-model-only
refuse such requests up front."""

from __future__ import annotations

import pytest

from deltaserve.engine.frontend import RequestError
from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from tests.support.vision import MAX_TOKENS, PROMPTS, case_for, generate_together


@pytest.mark.parametrize("variant", ["dense-vl", "moe-vl"])
def test_image_and_video_prompts_match_transformers_through_the_engine(variant: str) -> None:
    case = case_for(variant)
    prompts = {name: case.prompt(name) for name in PROMPTS}
    expected = {name: case.reference_generate(ids, mm) for name, (ids, mm) in prompts.items()}
    # a budget of 40 tokens: every prompt is prefilled in several chunks, several images are cut in two
    llm = LLM(case.model_dir, dtype="float32", max_num_batched_tokens=40, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = generate_together(llm, {**prompts, "text": ([5, 6, 7, 8], None)}, params)
    for name in PROMPTS:
        got, want = outputs[name], expected[name]
        num_exact = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), MAX_TOKENS)
        assert got == want, f"{variant} {name}: STRICT {num_exact}/{MAX_TOKENS}"
    table = llm.engine.runner.table
    assert all(not cache for cache in table.encoder_outputs), "encoder outputs outlived their spans"


def test_offline_multi_modal_data_is_vllms_spelling() -> None:
    case = case_for("dense-vl")
    ids, mm = case.prompt("image")
    image = case_image = None
    del case_image
    from tests.multimodal.synthetic import synthetic_image

    height, width, seed = PROMPTS["image"]["images"][0]
    image = synthetic_image(height, width, seed)
    text = case.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": PROMPTS["image"]["text"][0]}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    llm = LLM(case.model_dir, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], params, use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == case.reference_generate(ids, mm)[:8]


def test_multimodal_requests_are_refused_by_the_four_op_preamble_and_text_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = case_for("dense-vl")
    ids, mm = case.prompt("video")
    params = SamplingParams(max_tokens=2)
    text_only = LLM(case.model_dir, dtype="float32", language_model_only=True)
    assert text_only.engine.runner.model.visual is None
    with pytest.raises(RequestError, match="text only"):
        text_only.engine.add_request("v", ids, params, mm_input=mm)
    llm = LLM(case.model_dir, dtype="float32")
    monkeypatch.setenv("DELTASERVE_FUSE_ATTN_PREAMBLE", "0")
    with pytest.raises(RequestError, match="DELTASERVE_FUSE_ATTN_PREAMBLE"):
        llm.engine.add_request("v", ids, params, mm_input=mm)
    assert not llm.engine.has_unfinished()
