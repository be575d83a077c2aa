"""The image grid dry run on the CPU: benchmarks/grids/h200_image.toml itself (its arms, dataset table and client
flags), shrunk to CPU sizes, against two real `deltaserve serve` servers on a scaled-down copy of the image dummy
(make_dummy_models.write_multimodal(scaled=True): the same config fields and files, --load-format dummy). The peer is
the registry's vLLM arm: its exact command line runs a stand-in `vllm` package (tests/bench/fake_vllm) that hands
the argv to deltaserve, so a --language-model-only left in the image-traffic launch would refuse every image.

Checked: both launches serve every request; the images were sent and counted (each request's server-side prompt
tokens are its chat template, text and 64 image tokens per 64x64 image, resized up to transformers' 256x256 floor);
the record carries the dataset, the peer's launch without --language-model-only and its denominator note, and the
report shows both.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from deltaserve.bench import registry_types, report_cells, report_record
from deltaserve.bench.dataset_mm import parse_bucket_config
from deltaserve.bench.grid import REPO_ROOT, Grid
from deltaserve.bench.grid_config import Model, load_config
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

FAKE_VLLM = Path(__file__).parent / "fake_vllm"
IMAGE_TOKENS = 64  # a 64x64 image: smart_resize up to 256x256 (min_pixels 65536) -> 16x16 patches -> 8x8 merged


def test_image_grid_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_dummy_models", REPO_ROOT / "benchmarks/oracle/make_dummy_models.py"
    )
    assert spec is not None and spec.loader is not None
    dummy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dummy)
    model_dir = tmp_path / "q35-35b-a3b-mm-scaled"
    dummy.write_multimodal(str(model_dir), scaled=True)

    config = load_config(REPO_ROOT / "benchmarks/grids/h200_image.toml")
    ours, peer = config.arms
    assert ours.command and peer.oracle == "vllm" and peer.site == "h200-offline"
    config.models = [Model("mm-scaled", str(model_dir))]
    config.lengths, config.concurrencies = [(24, 4)], [1, 2]
    config.prompts_per_concurrency, config.min_prompts, config.num_warmups = 2, 2, 1
    config.port = free_port()
    config.dataset = replace(config.dataset, mm={**config.dataset.mm, "random_mm_bucket_config": "{(64, 64, 1): 1.0}"})
    config.arms = [
        replace(ours, env={"PYTHONPATH": "{repo}"}, startup_timeout_s=180),
        # the online site forces no deviation (no GDN backend flag), so the note is the image-traffic one alone
        replace(peer, site="online", env={"PYTHONPATH": f"{{repo}}:{FAKE_VLLM}"}, startup_timeout_s=180),
    ]
    record = Grid(config, tmp_path / "results", record_name="image-cpu", is_drift_enabled=False).run()

    assert record["is_complete"] and record["dataset"]["name"] == "random-mm"
    assert parse_bucket_config(record["dataset"]["random_mm_bucket_config"]) == {(64, 64, 1): 1.0}
    assert [(e["arm"], e["error"], e["is_port_freed"]) for e in record["launches"]] == [
        ("deltaserve", None, True),
        ("vllm", None, True),
    ]

    from transformers import AutoTokenizer

    from deltaserve.bench.dataset_mm import MmOptions, sample_random_mm
    from deltaserve.bench.grid_launch import run_seed

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    options = MmOptions(1, 0.0, {"image": 1, "video": 0}, {(64, 64, 1): 1.0})
    by_point: dict[int, set[int]] = {}
    for run in record["runs"]:
        metrics = run["metrics"]
        assert run["error"] is None and metrics["failed"] == 0, run
        num = max(2, 2 * run["concurrency"])
        assert metrics["completed"] == num and metrics["total_mm_items"] == num
        assert metrics["dataset_name"] == "random-mm" and metrics["endpoint"] == "/v1/chat/completions"
        # what the server must have counted: the chat template over [text, image], one placeholder -> 64 tokens
        expected = 0
        seed = run_seed(config, 24, 4, run["concurrency"])  # each point its own prompts
        for request in sample_random_mm(tokenizer, num, options, input_len=24, output_len=4, seed=seed):
            content = [{"type": "text", "text": request.prompt}, *request.mm_content]
            messages = [{"role": "user", "content": content}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 1
            expected += len(ids) - 1 + IMAGE_TOKENS
        assert metrics["total_input_tokens"] == expected, run["arm"]
        assert metrics["total_input_tokens"] > metrics["total_text_prompt_tokens"] + num * IMAGE_TOKENS
        by_point.setdefault(run["concurrency"], set()).add(metrics["total_input_tokens"])
    assert all(len(totals) == 1 for totals in by_point.values())  # both arms got the same requests
    vllm_argv = record["launches"][1]["argv"]
    assert vllm_argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and "--language-model-only" not in vllm_argv
    assert record["arms"]["vllm"]["denominator_note"] == registry_types.MEDIA_TRAFFIC_NOTE
    assert record["launches"][1]["engine_version"]
    assert {(r["subject"], r["peer"], r["concurrency"]) for r in record["ratios"]} == {
        ("deltaserve", "vllm", 1),
        ("deltaserve", "vllm", 2),
    }
    notes = report_cells.Notes()  # the denominator note is printed once, under Notes, and marked on the vLLM arm
    text = "\n".join(report_record.render_record("image-cpu", record, None, notes) + notes.render())
    assert "- dataset: random-mm (" in text and "bucket_config={(64, 64, 1): 1.0}" in text
    assert "vision-tower-kept" in text and "deltaserve / vllm [*1](#note-1)" in text
