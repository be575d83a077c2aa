"""Model-level exactness of images and video, fp32 on the CPU: deltaserve's model (vision tower, embedding
replacement, 3-D MRoPE positions through the fused preamble, paged KV cache and GDN state) against transformers'
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration `generate`, on both tiny vision variants:
STRICT 32/32 greedy tokens per prompt, full-sequence logits within 1e-4 relative, the MRoPE table and delta
equal to transformers' get_rope_index, and a prompt whose image straddles a prefill chunk boundary (the encoder
output consumed across two chunks) giving the same logits as one prefill. The four-op preamble refuses the
same prompts with an error naming DELTASERVE_FUSE_ATTN_PREAMBLE.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from deltaserve.kernels.preamble import MRopeUnsupportedError
from tests.support.threads import one_thread  # noqa: F401 (module-scoped autouse fixture)
from tests.support.vision import MAX_TOKENS, PROMPTS, case_for, reference_inputs

LOGIT_TOLERANCE = 1e-4
# Two prefill chunks move GDN's chunk boundaries: a rounding-level change that these random tiny models amplify
# to ~2e-5; a chunk that misses or misplaces its encoder rows moves the logits by > 1e-2 (checked below).
SPLIT_TOLERANCE = 1e-4


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("variant", ["dense-vl", "moe-vl"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_strict_greedy_and_logits_against_transformers(variant: str, name: str) -> None:
    case = case_for(variant)
    ids, mm_input = case.prompt(name)
    ours, _ = case.driver.generate(ids, mm_input, MAX_TOKENS)
    reference = case.reference_generate(ids, mm_input)
    assert len(reference) == MAX_TOKENS
    num_exact = next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), MAX_TOKENS)
    assert ours == reference, f"STRICT {num_exact}/{MAX_TOKENS}: first divergence at output position {num_exact}"
    # one prefill of prompt + generated tokens, against transformers' forward of the same sequence
    full = ids + reference
    _, logits = case.driver.generate(full, mm_input, 1)
    assert rel_error(logits, case.reference_logits(ids, reference, mm_input)) <= LOGIT_TOLERANCE
    # the positions are transformers' own get_rope_index, exactly
    kwargs = reference_inputs(ids, mm_input, case.driver.config)
    positions, delta = case.reference.model.get_rope_index(
        kwargs["input_ids"], kwargs["mm_token_type_ids"], kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw")
    )
    np.testing.assert_array_equal(mm_input.mrope_positions, positions[:, 0].numpy())
    assert mm_input.mrope_delta == int(delta)
    assert (mm_input.mrope_positions[1] != mm_input.mrope_positions[0]).any(), "the prompt must exercise MRoPE"


@pytest.mark.parametrize("variant", ["dense-vl", "moe-vl"])
def test_image_straddling_a_prefill_chunk_boundary(variant: str) -> None:
    case = case_for(variant)
    ids, mm_input = case.prompt("multi-image")
    first, count = mm_input.items[1].embed_runs[0]
    boundary = first + count // 3  # inside the second image's pad run
    assert mm_input.items_in_window(0, boundary) == [0, 1] and mm_input.items_in_window(boundary, len(ids)) == [1]
    chunks = [boundary, len(ids) - boundary]
    tokens_one, logits_one = case.driver.generate(ids, mm_input, 8)
    tokens_two, logits_two = case.driver.generate(ids, mm_input, 8, chunks=chunks)
    assert tokens_one == tokens_two
    assert rel_error(logits_two, logits_one) <= SPLIT_TOLERANCE
    # negative control: the second chunk taking the item's rows from the start again (as if it re-sliced the
    # encoder output per chunk) is far outside the tolerance
    original = mm_input.embed_slices

    def restarted(start: int, end: int) -> list:
        return [replace(s, src_start=0, src_end=s.src_end - s.src_start) if start else s for s in original(start, end)]

    object.__setattr__(mm_input, "embed_slices", restarted)
    _, logits_bad = case.driver.generate(ids, mm_input, 8, chunks=chunks)
    assert rel_error(logits_bad, logits_one) > 100 * SPLIT_TOLERANCE


@pytest.mark.parametrize("name", ["image", "video"])
def test_four_op_preamble_refuses_multimodal_positions(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = case_for("dense-vl")
    ids, mm_input = case.prompt(name)
    monkeypatch.setenv("DELTASERVE_FUSE_ATTN_PREAMBLE", "0")
    with pytest.raises(MRopeUnsupportedError, match="DELTASERVE_FUSE_ATTN_PREAMBLE"):
        case.driver.generate(ids, mm_input, 1)
