"""Prefix-cache hits keep MTP drafts exact (docs/prefix-caching.md#with-mtp): with speculation on (the trained tiny
dense / MoE / Next MTP heads, k = 1 and 3, fp32 on the CPU), greedy tokens AND the speculative-decoding counters
(drafts, draft tokens, accepted per position) with the cache on equal those with it off, case by case, so the drafts
themselves are the same. The cases hit a prompt-end checkpoint on a block boundary (the MTP entry at P - 1 lies in
the last full block, copied, not shared) and inside a block, two sequences that hit one checkpoint in the same step
with different tokens at P, and a multi-turn follow-up that hits the first turn's generation-end checkpoint; once
more with async verify (docs/speculative-decoding.md#async-verify) on both sides.

Without the rewrite of the MTP entry at P - 1 (runner/mtp_resume.py) the drafts after a hit read the K/V the
checkpoint's writer paired with its own token at P, and the counters differ.
"""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.mtp import corpus_split
from deltaserve.tiny.trained import trained_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens_per_pos")


def make_llm(variant: str, k: int, is_on: bool, is_async: bool = False) -> tuple[LLM, list]:
    """An engine drafting with its MTP layer (is_async: with async verify), and the list its verify steps append
    their drafts to: (table row, draft tokens) in plan order."""
    llm = LLM(
        trained_model_dir(variant), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
        enable_prefix_caching=is_on,
        speculative_config={"method": "mtp", "num_speculative_tokens": k, "async_verify": is_async},
    )  # fmt: skip
    spec = llm.engine.core.runner.spec
    drafts: list[tuple[int, list[int]]] = []
    fill = spec.fill_draft_inputs

    def recording_fill(input_ids, layout):  # noqa: ANN001, ANN202 (SpecDecoder's own signature)
        tokens = spec.draft_tokens[layout.draft_rows, layout.draft_cols].tolist()
        drafts.extend(zip(layout.draft_rows.tolist(), tokens, strict=True))
        return fill(input_ids, layout)

    spec.fill_draft_inputs = recording_fill
    return llm, drafts


def run(llm: LLM, requests: dict[str, list[int]]) -> tuple[dict[str, list[int]], tuple, int]:
    """Runs the requests together: name -> token ids, the spec-decode counters they added, the tokens they hit."""
    engine = llm.engine
    before = engine.stats()
    hits = engine.scheduler.prefix_cache_hits
    for name, ids in requests.items():
        engine.add_request(name, ids, GREEDY)
    states = {name: engine.requests[name] for name in requests}
    while engine.has_unfinished():
        engine.step()
    after = engine.stats()
    counters = []
    for field in COUNTERS:
        old, new = getattr(before, field), getattr(after, field)
        counters.append(tuple(a - b for a, b in zip(new, old, strict=True)) if isinstance(new, tuple) else new - old)
    outputs = {name: list(state.final_output().outputs[0].token_ids) for name, state in states.items()}
    return outputs, tuple(counters), engine.scheduler.prefix_cache_hits - hits


def scenario(variant: str, k: int, is_on: bool, is_async: bool = False) -> list[tuple[str, dict, tuple, int, list]]:
    """Each case: its name, outputs, counters, hit tokens and the drafts its verify steps checked. The prompts are
    training paragraphs (the tiny heads draft them best), and a follow-up continues with another paragraph, so its
    token at P differs from the one the checkpoint's writer had there."""
    llm, drafts = make_llm(variant, k, is_on, is_async)
    paragraphs = [p for p in corpus_split()[0].split("\n\n") if p.strip()]
    para = [ids for ids in map(llm.engine.tokenizer.encode, paragraphs[:40]) if len(ids) >= 48][:20]
    cases = []

    def case(name: str, requests: dict[str, list[int]]) -> dict[str, list[int]]:
        drafts.clear()
        outputs, counters, hits = run(llm, requests)
        cases.append((name, outputs, counters, hits, list(drafts)))
        return outputs

    for name, (a, b, at) in {"boundary": (12, 13, 32), "in-block": (11, 14, 24), "short": (13, 15, 16)}.items():
        first = case(name + "/first", {"first": para[a][:at]})["first"]  # checkpoints at `at` and its generation end
        case(name, {name: para[a][:at] + para[b][:8]})  # hits the prompt end
        # the first request's conversation goes on: it hits the generation end, and reads the MTP entry at `at` - 1
        # the first request wrote (had the follow-up rewritten it in a shared block, this one would read that)
        case(name + "/turn2", {"turn2": para[a][:at] + first + para[b][20:28]})
    # two sequences hit one checkpoint on a block boundary in the same step, each with its own token at P
    case("pair", {"a": para[13][:16] + para[16][:8], "b": para[13][:16] + para[17][5:17]})
    turn1 = case("turn1", {"turn1": para[0][:40]})["turn1"]
    case("turn2", {"turn2": para[0][:40] + turn1 + para[1][:8]})  # hits turn 1's generation end
    return cases


@pytest.fixture(scope="module", params=[("dense", 1, False), ("dense", 3, False), ("moe", 3, False),
                                        ("next", 1, False), ("moe", 3, True)],
                ids=["dense-k1", "dense-k3", "moe-k3", "next-k1", "moe-k3-async-verify"])  # fmt: skip
def results(request: pytest.FixtureRequest) -> tuple:
    variant, k, is_async = request.param
    return scenario(variant, k, False, is_async), scenario(variant, k, True, is_async)


def test_drafts_with_the_cache_equal_drafts_without(results: tuple) -> None:
    off, on = results
    for (name, off_out, off_counts, off_hits, off_drafts), (_, on_out, on_counts, _, on_drafts) in zip(
        off, on, strict=True
    ):
        assert off_hits == 0
        assert on_out == off_out, name
        assert on_counts == off_counts, name
        assert on_drafts == off_drafts, name
        assert off_counts[0] > 0, name  # every case drafted
    hits = {name: hit for name, _, _, hit, _ in on}
    assert hits["boundary"] == 32 and hits["in-block"] == 24 and hits["short"] == 16 and hits["pair"] == 2 * 16
    assert hits["turn2"] == 40 + GREEDY.max_tokens - 1
