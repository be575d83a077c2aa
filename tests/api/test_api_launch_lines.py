"""The launch commands users copy for Qwen3.5 / Qwen3.6 / Qwen3-Next (the model cards, vLLM's recipes, blog posts;
docs/compatibility.md#launch-commands lists them with their sources) read by `deltaserve serve` as vLLM 0.26 reads
them: each starts with its unimplemented flags logged, or is refused with one message naming the flag; and the ways
of writing a flag vLLM's parser takes (short aliases, dotted JSON keys) read the same here."""

from __future__ import annotations

import argparse
import json
import logging
import shlex

import pytest

from deltaserve.api import cli
from deltaserve.api.compat import check_compat

# (source, the command line after `vllm serve`) of the launch lines that start on deltaserve
STARTING = [
    ("HF card Qwen3.5", "Qwen/Qwen3.5-9B --port 8000 --tensor-parallel-size 1 --max-model-len 262144 "
     "--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder"),
    ("HF card Qwen3.5 MTP", "Qwen/Qwen3.5-9B --port 8000 --tensor-parallel-size 1 --max-model-len 262144 "
     "--reasoning-parser qwen3 --speculative-config '{\"method\":\"qwen3_next_mtp\",\"num_speculative_tokens\":2}'"),
    ("HF card Qwen3.5 text only", "Qwen/Qwen3.5-9B --max-model-len 262144 --reasoning-parser qwen3 "
     "--language-model-only"),
    ("vLLM recipe Qwen3.5", "Qwen/Qwen3.5-397B-A17B-FP8 -tp 8 --enable-expert-parallel --language-model-only "
     "--reasoning-parser qwen3 --enable-prefix-caching"),
    ("vLLM recipe Qwen3.5 multimodal", "Qwen/Qwen3.5-397B-A17B-FP8 --tensor-parallel-size 8 --mm-encoder-tp-mode data "
     "--mm-processor-cache-type shm --limit-mm-per-prompt.video 0 --reasoning-parser qwen3"),
    ("vLLM recipe Qwen3.6", "Qwen/Qwen3.6-35B-A3B --tensor-parallel-size 8 --max-model-len 262144 "
     "--reasoning-parser qwen3 --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'"),
    ("vLLM recipe Qwen3-Next", "Qwen/Qwen3-Next-80B-A3B-Instruct --tokenizer-mode auto --gpu-memory-utilization 0.8 "
     "--speculative-config '{\"method\": \"qwen3_next_mtp\", \"num_speculative_tokens\": 2}' --tensor-parallel-size 4 "
     "--no-enable-chunked-prefill -cc.cudagraph_mode=PIECEWISE"),
    ("vLLM-Ascend Qwen3.6-27B", "/mnt/weight/Qwen3.6-27B --host 0.0.0.0 --port 8000 --data-parallel-size 1 "
     "--tensor-parallel-size 2 --seed 1024 --served-model-name qwen3.6-27b --max-num-seqs 32 --max-model-len 133000 "
     "--max-num-batched-tokens 8096 --trust-remote-code --reasoning-parser qwen3 --gpu-memory-utilization 0.90 "
     "--no-enable-prefix-caching --speculative_config '{\"method\":\"qwen3_next_mtp\",\"num_speculative_tokens\":2,"
     "\"disable_padded_drafter_batch\":false}' --compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}' "
     "--additional-config '{\"enable_cpu_binding\":true}'"),
    ("HF discussion (KAT-Coder NVFP4)", "m --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 3, "
     "\"disable_padded_drafter_batch\": true}' --language-model-only --skip-mm-profiling --enable-prefix-caching "
     "--enable-cumem-allocator --no-disable-cascade-attn --max-num-batched-tokens 8196 --max-num-seqs 6 "
     "--enable-flashinfer-autotune --enable-chunked-prefill --kv-cache-dtype fp8 --load-format fastsafetensors "
     "--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder"),
    ("workstation NVFP4 (serving-and-benchmarks.md)", "Qwen/Qwen3.6-35B-A3B --kv-cache-dtype fp8 --moe-backend marlin "
     "--max-model-len 262144 --async-scheduling --speculative-config "
     "'{\"method\":\"mtp\",\"num_speculative_tokens\":3,\"moe_backend\":\"triton\"}' --load-format instanttensor"),
]  # fmt: skip
# (source, command line, what the one error names) of the launch lines deltaserve refuses
REFUSED = [
    ("HF card Qwen3.5 YaRN 1M", "Qwen/Qwen3.5-9B --max-model-len 1010000 --hf-overrides '{\"text_config\": "
     "{\"rope_parameters\": {\"mrope_interleaved\": true, \"mrope_section\": [11, 11, 10], \"rope_type\": \"yarn\", "
     "\"rope_theta\": 10000000, \"partial_rotary_factor\": 0.25, \"factor\": 4.0, "
     "\"original_max_position_embeddings\": 262144}}}'", "--hf-overrides"),
    ("YaRN, dotted", "Qwen/Qwen3.5-9B --hf-overrides.text_config.rope_parameters.rope_type yarn "
     "--hf-overrides.text_config.rope_parameters.factor 4.0", '--hf-overrides {"text_config": {"rope_parameters": '
     '{"rope_type": "yarn", "factor": 4.0}}}'),
    ("vLLM recipe Qwen3.5 throughput", "Qwen/Qwen3.5-397B-A17B-FP8 -dp 8 --enable-expert-parallel "
     "--language-model-only --reasoning-parser qwen3 --enable-prefix-caching", "--data-parallel-size 8"),
]  # fmt: skip


def parse(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deltaserve serve")
    cli.add_arguments(parser)
    return parser.parse_args(cli.normalize_argv(shlex.split(line)))


@pytest.mark.parametrize(("source", "line"), STARTING, ids=[source for source, _ in STARTING])
def test_launch_lines_start(source: str, line: str) -> None:
    args = parse(line)
    check_compat(args)
    model, device = cli.resolve_model(args)
    cli.build_engine_config(args, model, device)
    assert cli.build_settings(args, model).model_root == shlex.split(line)[0]


@pytest.mark.parametrize(("source", "line", "named"), REFUSED, ids=[source for source, _, _ in REFUSED])
def test_launch_lines_refused_by_name(source: str, line: str, named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}"):
        check_compat(parse(line))


def test_vllm_short_aliases() -> None:
    """Every short alias of vLLM 0.26's serve flags (vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py)
    names the same flag here: `-sc` is --speculative-config, `-dc` --diffusion-config (refused by that name)."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    known = parser._option_string_actions
    aliases = "-q -pp -n -r -tp -dcp -pcp -dp -dpn -dpr -dpl -dpa -dpp -dpb -dph -dpe -dpm -ep -sc -dc -cc -ac -asc -O"
    assert [alias for alias in aliases.split() if alias not in known] == []
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    short = cli.build_engine_config(parse(f"m -sc '{spec}'"), "m", "cpu").speculative_config
    assert short == cli.build_engine_config(parse(f"m --speculative-config '{spec}'"), "m", "cpu").speculative_config
    assert short is not None and short.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="^--diffusion-config"):
        check_compat(parse("m -dc {}"))


def test_dotted_flags_read_as_vllm() -> None:
    """vLLM's FlexibleArgumentParser (vllm/utils/argparse_utils.py): dotted keys nest (a.b.c), merge per flag, take
    a short alias (merged apart from its long name's, as vLLM keys them by the name written), a `+` list and
    human-readable ints, and the merged JSON comes after the other arguments (so it wins over the JSON form given
    before or after it)."""
    args = parse("m --compilation-config.pass_config.fuse_norm_quant true --compilation_config.cudagraph_mode=X "
                 "--compilation-config.cudagraph_capture_sizes+ 1,2 --compilation-config.max_cudagraph_capture_size 1k "
                 "--limit-mm-per-prompt.video 0 --limit_mm_per_prompt.image=2")  # fmt: skip
    assert json.loads(args.compat_compilation_config) == {
        "pass_config": {"fuse_norm_quant": True}, "cudagraph_mode": "X", "cudagraph_capture_sizes": ["1", "2"],
        "max_cudagraph_capture_size": 1000,
    }  # fmt: skip
    assert json.loads(args.limit_mm_per_prompt) == {"video": 0, "image": 2}
    later = parse("m --limit-mm-per-prompt.video 0 --limit-mm-per-prompt '{\"image\": 2}'")
    assert json.loads(later.limit_mm_per_prompt) == {"video": 0}
    assert json.loads(parse("m -cc.cudagraph_mode=PIECEWISE").compat_compilation_config) == {
        "cudagraph_mode": "PIECEWISE"
    }
    # a negative number stays a value
    assert parse("m --seed -1").seed == -1


def test_limit_mm_per_prompt_is_json_at_parse_time(capsys: pytest.CaptureFixture) -> None:
    """vLLM parses the flag with json.loads: `image=2,video=0` fails before the model loads, naming the flag."""
    with pytest.raises(SystemExit):
        parse("m --limit-mm-per-prompt image=2,video=0")
    assert "argument --limit-mm-per-prompt: not valid JSON" in capsys.readouterr().err
    assert parse('m --limit-mm-per-prompt \'{"image": 2, "video": 0}\'').limit_mm_per_prompt


def test_drafter_knobs_of_the_speculative_config_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    spec = '{"method": "mtp", "num_speculative_tokens": 3, "moe_backend": "triton", "disable_padded_drafter_batch": 1}'
    config = cli.build_engine_config(parse(f"m -sc '{spec}'"), "m", "cpu").speculative_config
    assert config is not None and config.num_speculative_tokens == 3
    messages = {record.getMessage() for record in caplog.records}
    assert (
        "ignoring speculative_config key `moe_backend`: the MTP drafter runs deltaserve's own MoE kernels" in messages
    )
    assert any(
        message.startswith("ignoring speculative_config key `disable_padded_drafter_batch`") for message in messages
    )
    with pytest.raises(SystemExit):  # a drafter setting that would change what it drafts stays refused
        parse('m -sc \'{"method": "mtp", "kv_cache_dtype": "fp8"}\'')


def test_instanttensor_reads_safetensors() -> None:
    for load_format in ("instanttensor", "fastsafetensors", "safetensors"):
        assert cli.build_engine_config(parse(f"m --load-format {load_format}"), "m", "cpu").load_format == "safetensors"


def test_unread_vllm_environment_variables_are_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM launch script's VLLM_USE_FLASHINFER_SAMPLER=1 (and the like) is named at start-up, not dropped in
    silence; the ones deltaserve reads (VLLM_ALLOW_LONG_MAX_MODEL_LEN, VLLM_API_KEY, ...) are not."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert cli.run(parse("m --ssl-cert-reqs 5")) == 2  # stops at the flag checks, after the variables are logged
    messages = [record.getMessage() for record in caplog.records]
    for name in ("VLLM_USE_DEEP_GEMM", "VLLM_USE_FLASHINFER_SAMPLER"):
        assert f"ignoring the environment variable {name}: deltaserve does not read it" in messages
    assert not any("VLLM_ALLOW_LONG_MAX_MODEL_LEN" in message for message in messages)
