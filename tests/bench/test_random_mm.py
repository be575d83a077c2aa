"""Image traffic in the harness: the random-mm dataset (vLLM's sampling order and rules), the client's openai-chat
path against the fake server, the registry's image-traffic launch and note, and the grid's [dataset] table with
benchmarks/grids/h200_image.toml (fast stand-ins; test_image_grid_cpu.py runs the real servers)."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from deltaserve.bench import grid as grid_module
from deltaserve.bench import registry, registry_rules, registry_types
from deltaserve.bench.dataset_mm import (
    MmOptions,
    format_bucket_config,
    item_count_bounds,
    parse_bucket_config,
    sample_random_mm,
)
from deltaserve.bench.grid_config import load_config, resolve
from deltaserve.bench.grid_launch import client_argv
from deltaserve.bench.serve_cli import parse_bench_args, run_bench

from .bench_helpers import WordTokenizer, serve_in_thread
from .fake_server import CHAT_BODIES, FAKE_IMAGE_TOKENS, build_app

REPO = grid_module.REPO_ROOT
IMAGE_GRID = REPO / "benchmarks/grids/h200_image.toml"


def dummy_models() -> Any:
    spec = importlib.util.spec_from_file_location("make_dummy_models", REPO / "benchmarks/oracle/make_dummy_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The image-traffic dummy's tokenizer format (word-level, Qwen's added tokens) at a 1024-id vocabulary, loaded
    as transformers 5.17 loads the dummy (TokenizersBackend: the declared PreTrainedTokenizerFast)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    folder = tmp_path_factory.mktemp("mmtok")
    dummy_models().write_multimodal_tokenizer(str(folder), 1024, 1024 - 276)
    return TokenizersBackend.from_pretrained(folder)


def decoded(url: str) -> Image.Image:
    header, data = url.split(",", 1)
    assert header == "data:image/jpeg;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_random_mm_follows_vllms_rng_order(mm_tokenizer: Any) -> None:
    """Restates vLLM's order with a fresh generator: lengths, output lengths, offsets; then per request its text
    (exact here: the word tokenizer round-trips, no retries), its item count, and per item bucket then pixels."""
    buckets = {(32, 48, 1): 0.25, (16, 16, 1): 0.75, (8, 8, 1): 0.0}
    options = MmOptions(2, 0.5, {"image": 3}, buckets)
    requests = sample_random_mm(mm_tokenizer, 5, options, input_len=12, output_len=6, range_ratio=0.25, seed=11)

    rng = np.random.default_rng(11)
    input_lens = rng.integers(9, 16, size=5)  # [floor(12 * 0.75), ceil(12 * 1.25)]
    output_lens = rng.integers(4, 9, size=5)
    offsets = rng.integers(0, 1024, size=5)
    special = set(range(748, 748 + 14))
    allowed = np.array([i for i in range(1024) if i not in special])
    kept = {(32, 48, 1): 0.25, (16, 16, 1): 0.75}
    for i, request in enumerate(requests):
        ids = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        assert request.prompt == mm_tokenizer.decode(ids) and request.prompt_len == input_lens[i]
        assert request.expected_output_len == output_lens[i]
        count = int(rng.integers(1, 4))  # [floor(2 * 0.5), min(3, ceil(2 * 1.5))]
        assert len(request.mm_content) == count
        for part in request.mm_content:
            row = rng.choice(list(kept), p=list(kept.values()))
            pixels = rng.integers(0, 256, (int(row[0]), int(row[1]), 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG")
            url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
            assert part == {"type": "image_url", "image_url": {"url": url}}


def test_random_mm_text_never_carries_a_special_token(mm_tokenizer: Any) -> None:
    requests = sample_random_mm(mm_tokenizer, 40, MmOptions(bucket_config={(16, 16, 1): 1.0}), input_len=200, seed=3)
    ids = [i for request in requests for i in mm_tokenizer.encode(request.prompt, add_special_tokens=False)]
    assert len(ids) == 40 * 200
    assert not set(ids) & set(range(748, 748 + 14))
    # the plain added tokens (<think>, <tool_call>, ...) are ordinary text to vLLM's rule, so they may appear
    assert set(range(748 + 14, 748 + 26)) & set(ids)


def test_random_mm_same_seed_same_bytes_and_limits(mm_tokenizer: Any) -> None:
    options = MmOptions(3, 1.0, {"image": 2, "video": 0}, {(24, 40, 1): 2.0, (40, 24, 1): 1.0})
    first = sample_random_mm(mm_tokenizer, 30, options, input_len=8, output_len=2, seed=5)
    assert first == sample_random_mm(mm_tokenizer, 30, options, input_len=8, output_len=2, seed=5)
    assert first != sample_random_mm(mm_tokenizer, 30, options, input_len=8, output_len=2, seed=6)
    counts = [len(r.mm_content) for r in first]
    # [floor(3 * 0), ceil(3 * 2)] clamped to the image limit 2: every count 0..2 occurs in 30 draws
    assert set(counts) == {0, 1, 2}
    sizes = {decoded(p["image_url"]["url"]).size for r in first for p in r.mm_content}
    assert sizes == {(40, 24), (24, 40)}  # PIL sizes are (width, height) of buckets (height, width)


def test_bucket_config_and_bounds() -> None:
    buckets = parse_bucket_config("{(512, 512, 1): 1.0, '(256, 128, 1)': 0}")
    assert buckets == {(512, 512, 1): 1.0, (256, 128, 1): 0.0}
    assert parse_bucket_config(format_bucket_config(buckets)) == buckets
    assert item_count_bounds(MmOptions(1, 0.0, {"image": 1, "video": 0}, buckets)) == (
        1, 1, {"image": 1}, {(512, 512, 1): 1.0},
    )  # fmt: skip
    with pytest.raises(ValueError, match="video buckets"):
        item_count_bounds(MmOptions(bucket_config={(64, 64, 4): 1.0}))
    with pytest.raises(ValueError, match="non-negative"):
        item_count_bounds(MmOptions(bucket_config={(64, 64, 1): -1.0}))
    with pytest.raises(ValueError, match="not in limit_mm_per_prompt"):
        item_count_bounds(MmOptions(limit_mm_per_prompt={"video": 1}, bucket_config={(64, 64, 1): 1.0}))
    with pytest.raises(ValueError, match="invalid bucket key"):
        parse_bucket_config("{(64, 64): 1.0}")


@pytest.fixture
def chat_server(word_model: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    app = build_app(word_model, ttft_ms=2.0, itl_ms=1.0)
    for url in serve_in_thread(app):
        yield url, app[CHAT_BODIES]


def test_client_sends_images_on_chat_and_counts_the_servers_tokens(
    patch_tokenizer: WordTokenizer, chat_server: tuple[str, list[dict[str, Any]]]
) -> None:
    url, bodies = chat_server
    argv = ["--base-url", url, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
    argv += ["--dataset-name", "random-mm", "--random-mm-bucket-config", "{(32, 32, 1): 1.0}"]
    argv += ["--random-input-len", "10", "--random-output-len", "3", "--num-prompts", "4", "--num-warmups", "1"]
    argv += ["--max-concurrency", "2", "--temperature", "0", "--disable-tqdm", "--save-detailed"]
    record = run_bench(parse_bench_args(argv))
    assert record["completed"] == 4 and record["failed"] == 0
    # the server's usage.prompt_tokens: 10 text tokens + one image each
    assert record["input_lens"] == [10 + FAKE_IMAGE_TOKENS] * 4
    assert record["total_input_tokens"] == 4 * (10 + FAKE_IMAGE_TOKENS) and record["total_text_prompt_tokens"] == 40
    assert record["total_mm_items"] == 4 and record["mm_items_per_request"] == [1, 1, 1, 1]
    assert record["dataset_name"] == "random-mm" and record["random_mm_bucket_config"] == "{(32, 32, 1): 1.0}"
    assert record["is_server_tokenize_aligned"] is False  # vLLM aligns only the text-only random dataset
    assert len(bodies) == 5  # one warm-up, four requests
    for body in bodies:
        text, image = body["messages"][0]["content"]
        assert body["messages"][0]["role"] == "user" and text["type"] == "text" and image["type"] == "image_url"
        assert decoded(image["image_url"]["url"]).size == (32, 32)
        assert body["max_completion_tokens"] == 3 and body["ignore_eos"] is True and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True} and "prompt" not in body
    assert bodies[0] == bodies[1]  # the warm-up is request 0
    assert record["generated_texts"][0] == " t1 t2"  # delta.content, the role chunk's "" first
    # vLLM's chat timing: the role chunk is the first token; the usage event ends the latency
    assert all(len(itl) == 2 for itl in record["itls"]) and all(ttft > 0 for ttft in record["ttfts"])


def test_random_mm_needs_the_chat_backend(patch_tokenizer: WordTokenizer) -> None:
    with pytest.raises(ValueError, match="only supported on 'openai-chat'"):
        run_bench(parse_bench_args(["--dataset-name", "random-mm", "--base-url", "http://127.0.0.1:9"]))
    argv = ["--backend", "openai-chat", "--base-url", "http://127.0.0.1:9"]
    with pytest.raises(ValueError, match="must end with chat/completions"):
        run_bench(parse_bench_args(argv))


def multimodal_config(folder: Path, is_multimodal: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    architectures = ["Qwen3_5MoeForConditionalGeneration"]
    config: dict[str, Any] = {"architectures": architectures, "text_config": {"num_experts": 8}}
    if is_multimodal:
        config["vision_config"] = {}
    else:
        config = {"architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 8}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_registry_keeps_the_vision_tower_for_image_traffic(tmp_path: Path) -> None:
    model = str(multimodal_config(tmp_path / "mm"))
    text = registry.vllm_launch(model, 1024)
    images = registry.vllm_launch(model, 1024, serves_media=True)
    assert "--language-model-only" in text.argv and "--language-model-only" not in images.argv
    assert [w for w in text.argv if w != "--language-model-only"] == images.argv
    assert images.exemption is None and images.reasons[0] == registry_types.MEDIA_REASON
    assert images.denominator_note.startswith(registry_types.MEDIA_TRAFFIC_NOTE)
    assert (text.denominator_note or "") in images.denominator_note  # the site's deviations are still noted
    online = registry.vllm_launch(model, 1024, site="online", serves_media=True)
    assert online.deviations == [] and online.denominator_note == registry_types.MEDIA_TRAFFIC_NOTE
    assert registry_rules.check_vllm_argv(images.argv, serves_media=True) == []
    assert "--language-model-only: drops the vision tower" in " ".join(
        registry_rules.check_vllm_argv(text.argv, serves_media=True)
    )
    with pytest.raises(ValueError, match="drops the vision tower"):
        registry.vllm_launch(model, 1024, serves_media=True, extra_args=["--language-model-only"])
    with pytest.raises(ValueError, match="nothing to drop"):
        registry.vllm_launch(model, 1024, serves_media=True, drop_flags=["--language-model-only"], exemption="x")
    with pytest.raises(ValueError, match="cannot serve image traffic"):
        registry.vllm_launch(str(multimodal_config(tmp_path / "text", False)), 1024, serves_media=True)


def test_image_grid_file_resolves_an_image_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    multimodal_config(tmp_path / "q35-35b-a3b-mm")
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(IMAGE_GRID)
    assert config.dataset.serves_media and config.concurrencies == [1, 8, 32] and config.lengths == [(1024, 128)]
    ours, peer = config.arms
    vllm = resolve(peer, config.models[0], config)
    assert "--language-model-only" not in vllm.argv and vllm.exemption is None
    assert "vision-tower-kept" in vllm.denominator_note and "gdn-prefill-triton" not in vllm.denominator_note
    argv = client_argv(resolve(ours, config.models[0], config), config, 1024, 128, 8, "x")
    args = parse_bench_args(argv)
    assert (args.backend, args.endpoint, args.dataset_name) == ("openai-chat", "/v1/chat/completions", "random-mm")
    assert args.random_mm_bucket_config == {(512, 512, 1): 1.0} and args.random_mm_limit_mm_per_prompt["image"] == 1
    assert args.random_mm_base_items_per_request == 1 and args.num_prompts == 40
    # the whole grid fits one device call: every launch's estimate, plus the drift re-run, under the deadline
    # a one-call image grid keeps to (505 s), and a hung vLLM start is cut before it too
    total = sum(a.expected_startup_s + len(config.concurrencies) * a.expected_run_s for a in config.arms)
    total += ours.expected_startup_s + ours.expected_run_s
    assert total <= 505 and peer.startup_timeout_s + ours.expected_startup_s + 3 * 20 + 3 * peer.expected_run_s <= 505


def test_text_grids_keep_their_client_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    multimodal_config(tmp_path / "q35-35b-a3b")
    config = load_config(REPO / "benchmarks/grids/h200_core2.toml")
    assert not config.dataset.serves_media
    argv = client_argv(resolve(config.arms[0], config.models[0], config), config, 1024, 128, 1, "x")
    assert argv[4:6] == ["--dataset-name", "random"] and "--backend" not in argv and "--endpoint" not in argv
    assert "--language-model-only" in resolve(config.arms[1], config.models[0], config).argv


def test_dataset_table_is_validated(tmp_path: Path) -> None:
    base = '[[models]]\nname="m"\npath="p"\n[[arms]]\nname="a"\ncommand=["x"]\n'
    path = tmp_path / "g.toml"
    for table, message in (
        ('[dataset]\nname="sharegpt"\n', "name must be one of"),
        ('[dataset]\nname="random-mm"\ncolour="red"\n', "unknown keys"),
        ('[dataset]\nname="random"\nrandom_mm_base_items_per_request=2\n', "apply to random-mm only"),
        ('[dataset]\nname="random-mm"\nrandom_mm_bucket_config="{(1, 2): 1}"\n', "invalid bucket key"),
    ):
        path.write_text(table + base)
        with pytest.raises(ValueError, match=message):
            load_config(path)


def test_make_dummy_models_lists_the_image_folder() -> None:
    module = dummy_models()
    vision = module.VISION_35B_A3B
    assert (vision["depth"], vision["hidden_size"], vision["intermediate_size"], vision["num_heads"]) == (
        27, 1152, 4304, 16,
    )  # fmt: skip
    ids = module.added_token_ids(module.FIRST_ADDED_ID)
    assert (ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|video_pad|>"], ids["</think>"]) == (
        248053, 248056, 248057, 248069,
    )  # fmt: skip
    assert math.isqrt(vision["num_position_embeddings"]) == 48
