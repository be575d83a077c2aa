"""Speculative decoding through the real server, driven by the `openai` client: a real engine on the trained tiny
dense checkpoint with `speculative_config` (MTP, k = 2) answers greedy completions with the tokens of an engine
without it, and /metrics then reports the drafts and accepted tokens the engine core counted (vLLM's names)."""

from __future__ import annotations

import httpx
import openai

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.tiny.mtp import corpus_split
from deltaserve.tiny.trained import trained_model_dir

from .server_thread import serve
from .test_api_metrics import scrape, value

# the starts of corpus paragraphs the tiny checkpoints were trained on (tests/engine/test_spec_decode.py says why)
PARAGRAPHS = [p for p in corpus_split()[0].split("\n\n") if p.strip()]
PROMPTS = [PARAGRAPHS[i][:100] for i in (0, 7, 14)]


def completions(speculative_config: dict | None) -> tuple[list[str], dict]:
    config = EngineConfig(model=str(trained_model_dir("dense")), device="cpu", dtype="float32", max_model_len=128,
                          max_num_seqs=4, speculative_config=speculative_config)  # fmt: skip
    server = serve(AsyncEngine.from_config(config, multiprocess=False))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts = []
        for prompt in PROMPTS:
            out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=24,
                                            temperature=0.0)  # fmt: skip
            texts.append(out.choices[0].text)
        with httpx.Client(base_url=server.base_url) as http:
            families = scrape(http)
    finally:
        server.stop()
    return texts, families


def test_mtp_completions_equal_plain_ones_and_metrics_count_them() -> None:
    plain, _ = completions(None)
    texts, families = completions({"method": "mtp", "num_speculative_tokens": 2})
    assert texts == plain
    drafts = value(families, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total")
    draft_tokens = value(families, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total")
    accepted = value(families, "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total")
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    per_pos = [value(families, name, name + "_total", position=str(p)) for p in range(2)]
    assert drafts > 0 and drafts <= draft_tokens <= 2 * drafts
    assert 0 < accepted <= draft_tokens and sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
