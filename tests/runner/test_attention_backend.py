"""--attention-backend from the flag down to the full-attention layers (runner/device_setup.py attention_backend,
runner/attention_plan.py): vLLM's spelling is read, vLLM's other values are refused by name, FLASH_ATTN and
FLASHINFER are refused at start-up where they cannot run (here: the CPU) with the reason, and where they can (the
stand-ins of tests/support/fake_attention_libraries.py, their checks passed by hand) the engine serves every prefill
row through the library, planned once per step, with the tokens of deltaserve's own kernel; decode rows never
reach it. The `-m gpu` tests run the real libraries on the trained checkpoints in bf16."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from deltaserve.api import cli
from deltaserve.api.compat import COMPAT_FLAGS
from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.engine_config import EngineConfig
from deltaserve.kernels import attention_fa3, attention_flashinfer
from deltaserve.model.context import ForwardContext
from deltaserve.runner import attention_plan, device_setup
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.api.test_api_flags import parse
from tests.support.fake_attention_libraries import install_fake_fa3, install_fake_flashinfer_prefill

DENSE = trained_model_dir("dense")
FIXED = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4}
PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 200 + 1 for i in range(n)]} for n in (150, 40, 9)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _backends(llm: LLM) -> set[str]:
    return {layer.self_attn.prefill_backend for layer in llm.engine.runner.model.layers if layer.is_full_attention}


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_engine_config_reads_vllms_spelling() -> None:
    assert EngineConfig("m").attention_backend is None
    for value, want in (("auto", None), ("AUTO", None), ("flash_attn", "FLASH_ATTN"), ("FLASHINFER", "FLASHINFER"),
                        ("Triton_Attn", "TRITON_ATTN")):  # fmt: skip
        assert EngineConfig("m", attention_backend=value).attention_backend == want
    for value in ("FLASHMLA", "flex_attention", "TRITON_ATTN_DIFFKV", "CPU_ATTN"):
        with pytest.raises(ValueError, match=rf"--attention-backend {value.upper()}: not implemented in deltaserve"):
            EngineConfig("m", attention_backend=value)
    with pytest.raises(ValueError, match="Unknown attention backend: 'FLASH'"):
        EngineConfig("m", attention_backend="FLASH")


def test_the_flag_is_implemented() -> None:
    assert all("--attention-backend" not in entry.flags for entry in COMPAT_FLAGS)
    for argv, value in (([], None), (["--attention-backend", "FLASH_ATTN"], "FLASH_ATTN"),
                        (["--attention-backend=flashinfer"], "FLASHINFER")):  # fmt: skip
        assert cli.build_engine_config(parse("m", *argv), "m", "cpu").attention_backend == value
    with pytest.raises(ValueError, match="not implemented in deltaserve"):
        cli.build_engine_config(parse("m", "--attention-backend", "FLASHMLA"), "m", "cpu")


def test_attention_config_backend_is_the_flag_and_the_two_exclude_each_other(caplog: pytest.LogCaptureFixture) -> None:
    assert all("--attention-config" not in entry.flags for entry in COMPAT_FLAGS)
    cases = [
        (["--attention-config", '{"backend": "FLASH_ATTN"}'], "FLASH_ATTN"),
        (["-ac", '{"backend": "flashinfer"}'], "FLASHINFER"),
        (["-ac", '{"flash_attn_version": 3}'], None),
        (["-ac", '{"flash_attn_version": 3}', "--attention-backend", "FLASHINFER"], "FLASHINFER"),
    ]
    for argv, value in cases:
        with caplog.at_level(logging.INFO, logger="deltaserve.serve"):
            assert cli.build_engine_config(parse("m", *argv), "m", "cpu").attention_backend == value
    assert "['flash_attn_version']" in caplog.text, "the config's other keys are logged"
    with pytest.raises(ValueError, match="attention_backend and attention_config.backend are mutually exclusive"):
        cli.build_engine_config(
            parse("m", "-ac", '{"backend": "FLASHINFER"}', "--attention-backend", "FLASH_ATTN"), "m", "cpu"
        )
    with pytest.raises(ValueError, match="not implemented in deltaserve"):
        cli.build_engine_config(parse("m", "-ac", '{"backend": "FLASHMLA"}'), "m", "cpu")
    with pytest.raises(SystemExit):
        parse("m", "--attention-config", "[1]")  # a JSON object, as vLLM's


def test_resolution_refuses_by_name_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig.from_pretrained(DENSE)
    cpu = torch.device("cpu")
    for requested in (None, "TRITON_ATTN"):
        resolved = device_setup.attention_backend(EngineConfig("m", attention_backend=requested), cpu,
                                                  torch.float32, config, 16)  # fmt: skip
        assert resolved == "TRITON_ATTN"
    for requested, library in (("FLASH_ATTN", "vLLM's FlashAttention 3"), ("FLASHINFER", "FlashInfer's paged")):
        with pytest.raises(ValueError, match=rf"--attention-backend {requested}: {library}.* the device is cpu"):
            device_setup.attention_backend(EngineConfig("m", attention_backend=requested), cpu, torch.float32,
                                           config, 16)  # fmt: skip
    # on a GPU: fp32 and a missing library are refused by name (the device checks come first, so a CUDA device is
    # only named here, never used)
    gpu = torch.device("cuda")
    assert "float32" in attention_fa3.unusable_reason(gpu, torch.float32, 256, 16)
    assert "bfloat16 or float16" in attention_flashinfer.unusable_reason(gpu, torch.float32, 256)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "needs SM90" in attention_fa3.unusable_reason(gpu, torch.bfloat16, 256, 16)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # an import that fails
    assert "flashinfer does not import" in attention_flashinfer.unusable_reason(gpu, torch.bfloat16, 256)


def test_vllm_attention_backend_env_is_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    config = ModelConfig.from_pretrained(DENSE)
    with caplog.at_level(logging.WARNING):
        resolved = device_setup.attention_backend(EngineConfig("m"), torch.device("cpu"), torch.float32, config, 16)
    assert resolved == "TRITON_ATTN"
    assert any("VLLM_ATTENTION_BACKEND=FLASHINFER is ignored" in r.getMessage() for r in caplog.records)


def test_the_default_builds_ours_into_every_layer_where_fa3_cannot_run(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.model_runner"):
        llm = LLM(DENSE, **FIXED)
    assert _backends(llm) == {"TRITON_ATTN"} and llm.engine.runner.prefill_attention is None
    # the start-up line a grid reads back (bench/server_logs.py)
    assert "prefill kernels: attention=TRITON_ATTN gdn=triton" in caplog.text


def test_the_default_is_fa3_where_it_runs_as_vllms_auto(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's auto picks FlashAttention on SM90: where vLLM's FA3 can run, the default serves the prefill rows
    through it (and says so), with deltaserve's tokens; TRITON_ATTN still keeps ours everywhere. Where it cannot,
    the log names the reason."""
    config = ModelConfig.from_pretrained(DENSE)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.device_setup"):
        assert device_setup.attention_backend(EngineConfig("m"), cpu, torch.float32, config, 16) == "TRITON_ATTN"
    assert "FlashAttention 3 cannot run here: the device is cpu" in caplog.text
    ours = _tokens(LLM(DENSE, **FIXED))
    fake = install_fake_fa3(monkeypatch)
    monkeypatch.setattr(attention_fa3, "unusable_reason", lambda *args: None)
    monkeypatch.setattr(attention_fa3, "vllm_version", lambda: "0.26.0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.device_setup"):
        assert device_setup.attention_backend(EngineConfig("m"), cpu, torch.float32, config, 16) == "FLASH_ATTN"
    assert "prefill rows through vLLM's FlashAttention 3 (vllm 0.26.0)" in caplog.text
    explicit = device_setup.attention_backend(EngineConfig("m", attention_backend="TRITON_ATTN"), cpu, torch.float32,
                                              config, 16)  # fmt: skip
    assert explicit == "TRITON_ATTN"
    llm = LLM(DENSE, **FIXED)
    assert _backends(llm) == {"FLASH_ATTN"}
    fake.batches.clear()
    assert _tokens(llm) == ours
    assert fake.batches  # the prompts' prefill rows went through the library


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER"])
def test_a_library_is_refused_on_the_cpu_before_loading(name: str) -> None:
    with pytest.raises(ValueError, match=rf"--attention-backend {name}: .*cannot run here: the device is cpu"):
        LLM(DENSE, attention_backend=name, **FIXED)


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER"])
def test_a_library_serves_the_prefill_rows_with_our_tokens(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens equal deltaserve's kernel's (fp32, the stand-in computes in fp32); the library sees exactly the
    prompts' rows, once per full-attention layer (decode rows never reach it), and FlashInfer plans once per step
    that holds prefill rows, every layer running that plan."""
    ours = _tokens(LLM(DENSE, **FIXED))
    if name == "FLASH_ATTN":
        fake = install_fake_fa3(monkeypatch)
        monkeypatch.setattr(attention_fa3, "unusable_reason", lambda *args: None)
    else:
        fake = install_fake_flashinfer_prefill(monkeypatch)
        monkeypatch.setattr(attention_flashinfer, "unusable_reason", lambda *args: None)
    planned: list[int] = []  # prefill rows of each planned step
    real_plan = attention_plan.plan_step

    def plan_step(backend: object, ctx: ForwardContext, layout: object) -> None:
        planned.append(ctx.num_prefill_tokens)
        real_plan(backend, ctx, layout)

    monkeypatch.setattr(attention_plan, "plan_step", plan_step)
    llm = LLM(DENSE, attention_backend=name, **FIXED)
    assert _backends(llm) == {name}
    planned.clear()  # the warm-up's steps
    if name == "FLASH_ATTN":
        fake.batches.clear()
    else:
        for wrapper in fake.instances:
            wrapper.runs.clear()
            wrapper.plans = 0
    assert _tokens(llm) == ours
    num_layers = sum(layer.is_full_attention for layer in llm.engine.runner.model.layers)
    prompt_rows = sum(len(p["prompt_token_ids"]) for p in PROMPTS)
    prefill_steps = [rows for rows in planned if rows]
    assert sum(prefill_steps) == prompt_rows
    if name == "FLASH_ATTN":
        rows = [rows for _, rows in fake.batches]
    else:
        rows = [rows for wrapper in fake.instances for rows in wrapper.runs]
        assert sum(wrapper.plans for wrapper in fake.instances) == len(prefill_steps)
    assert sorted(rows) == sorted(prefill_steps * num_layers)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER"])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_gpu_library_tokens_equal_ours_in_bf16(name: str, variant: str) -> None:
    """On an SM90 GPU with the library installed: greedy tokens of the trained checkpoint in bf16 equal deltaserve's
    kernel's (skipped, with the reason, where the library cannot run)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    config = ModelConfig.from_pretrained(trained_model_dir(variant))
    device = torch.device("cuda")
    if name == "FLASH_ATTN":
        reason = attention_fa3.unusable_reason(device, torch.bfloat16, config.head_dim, 16)
    else:
        reason = attention_flashinfer.unusable_reason(device, torch.bfloat16, config.head_dim)
    if reason is not None:
        pytest.skip(reason)
    kwargs = {"dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    ours = _tokens(LLM(str(trained_model_dir(variant)), **kwargs))
    assert _tokens(LLM(str(trained_model_dir(variant)), attention_backend=name, **kwargs)) == ours


def test_fa3_by_default_under_async_mtp_serves_prompts_beside_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default under MTP with async verify (CPU stand-in for FA3): prompts admitted while other sequences
    speculate are planned in steps that also hold verify chunks (some chained behind a verify in flight); their
    prefill rows reach the library (a chained chunk is never a prefill: prefill_rows would refuse it) and the greedy
    tokens equal deltaserve's kernel's."""
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "async_verify": True}
    config = {**FIXED, "max_num_batched_tokens": 64, "speculative_config": mtp}
    prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 3 for j in range(9 + (31 * i) % 80)]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in LLM(DENSE, **config).generate(prompts, params, use_tqdm=False)]
    fake = install_fake_fa3(monkeypatch)
    monkeypatch.setattr(attention_fa3, "unusable_reason", lambda *args: None)
    monkeypatch.setattr(attention_fa3, "vllm_version", lambda: "0.26.0")
    llm = LLM(DENSE, **config)
    assert _backends(llm) == {"FLASH_ATTN"} and llm.engine.config.chains_verifies
    fake.batches.clear()
    theirs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert theirs == ours
    assert sum(rows for _, rows in fake.batches) >= sum(len(p["prompt_token_ids"]) for p in prompts)
