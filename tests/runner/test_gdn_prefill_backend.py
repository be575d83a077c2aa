"""--gdn-prefill-backend from the engine config down to the GDN layers (runner/device_setup.py gdn_prefill_backend):
the default and triton build deltaserve's own kernel into every layer, flashinfer is refused at start-up where it
cannot run (here: the CPU) with the reason, and where it can (a stand-in FlashInfer, its checks passed by hand) the
engine serves its prefills through it, with the tokens of deltaserve's own kernel; on a (faked) GPU the warm-up
compiles both of FlashInfer's kernels and the cache keeps room for its state copies."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.engine_config import EngineConfig
from deltaserve.kernels import gdn, gdn_flashinfer
from deltaserve.runner import device_setup, warmup
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.support.fake_cuda import fake_cuda
from tests.support.fake_flashinfer import install_fake_flashinfer

DENSE = trained_model_dir("dense")
FIXED = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4}


def _backends(llm: LLM) -> set[str]:
    return {
        layer.linear_attn.prefill_backend for layer in llm.engine.runner.model.layers if not layer.is_full_attention
    }


def test_resolution(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where FlashInfer cannot run, the default is ours (the log says why) and flashinfer is refused; where it can,
    the default is "flashinfer-large" (FlashInfer for large calls), flashinfer is FlashInfer for every call, and
    triton is ours."""
    config = ModelConfig.from_pretrained(DENSE)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.device_setup"):
        for requested in (None, "triton", "auto"):
            engine_config = EngineConfig("m", gdn_prefill_backend=requested)
            assert device_setup.gdn_prefill_backend(engine_config, cpu, torch.float32, config) == "triton"
    assert "FlashInfer's cannot run here: the device is cpu" in caplog.text
    with pytest.raises(ValueError, match=r"--gdn-prefill-backend flashinfer: .*the device is cpu.*pass triton"):
        device_setup.gdn_prefill_backend(
            EngineConfig("m", gdn_prefill_backend="flashinfer"), cpu, torch.float32, config
        )
    monkeypatch.setattr(gdn_flashinfer, "unusable_reason", lambda *args: None)
    monkeypatch.setattr(device_setup, "flashinfer_version", lambda: "0.6.14")
    for requested, want in ((None, "flashinfer-large"), ("auto", "flashinfer-large"), ("flashinfer", "flashinfer"),
                            ("triton", "triton")):  # fmt: skip
        engine_config = EngineConfig("m", gdn_prefill_backend=requested)
        assert device_setup.gdn_prefill_backend(engine_config, cpu, torch.float32, config) == want


def test_engine_config_reads_vllms_values() -> None:
    assert EngineConfig("m").gdn_prefill_backend is None
    assert EngineConfig("m", gdn_prefill_backend="auto").gdn_prefill_backend is None  # vLLM's auto, offline
    assert EngineConfig("m", gdn_prefill_backend="flashinfer").gdn_prefill_backend == "flashinfer"
    with pytest.raises(ValueError, match=r"--gdn-prefill-backend cutedsl .*Blackwell"):
        EngineConfig("m", gdn_prefill_backend="cutedsl")
    with pytest.raises(ValueError, match="gdn_prefill_backend must be one of flashinfer, triton, cutedsl"):
        EngineConfig("m", gdn_prefill_backend="FlashInfer")


def test_the_layers_get_the_resolved_kernel() -> None:
    assert _backends(LLM(DENSE, **FIXED)) == {"triton"}
    assert _backends(LLM(DENSE, gdn_prefill_backend="triton", **FIXED)) == {"triton"}


def test_flashinfer_is_refused_on_the_cpu_before_loading() -> None:
    with pytest.raises(ValueError, match=r"FlashInfer's GDN prefill cannot run here: the device is cpu"):
        LLM(DENSE, gdn_prefill_backend="flashinfer", **FIXED)


def test_flashinfer_serves_the_prefills_with_our_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With FlashInfer usable (the stand-in, fp32 on the CPU), every GDN prefill without an in-step checkpoint runs
    it, and greedy tokens equal deltaserve's own kernel's; steps with an in-step checkpoint (the 64-token interval
    on a 150-token prompt) take deltaserve's kernel."""
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 200 + 1 for i in range(n)]} for n in (150, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    kwargs = {**FIXED, "prefix_cache_checkpoint_interval": 64}
    ours = [o.outputs[0].token_ids for o in LLM(DENSE, **kwargs).generate(prompts, params, use_tqdm=False)]
    fake = install_fake_flashinfer(monkeypatch)
    monkeypatch.setattr(gdn_flashinfer, "unusable_reason", lambda *args: None)
    with_checkpoint: list[bool] = []  # per call of deltaserve's kernel: whether it carried an in-step checkpoint
    real_ours = gdn.gdn_prefill_ours
    monkeypatch.setattr(gdn, "gdn_prefill_ours", lambda *a: with_checkpoint.append(a[12] is not None) or real_ours(*a))
    llm = LLM(DENSE, gdn_prefill_backend="flashinfer", **kwargs)
    assert _backends(llm) == {"flashinfer"}
    assert fake.calls == 0 and not with_checkpoint  # the CPU runs no warm-up
    theirs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert theirs == ours
    assert fake.calls > 0 and with_checkpoint and all(with_checkpoint)


def test_the_default_sends_large_calls_to_flashinfer_and_small_ones_to_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """With FlashInfer usable and no flag, a prefill call of FLASHINFER_MIN_TOKENS rows or more (lowered here to 100,
    so the tiny checkpoint meets it) runs FlashInfer's kernel and a smaller one ours, with ours' greedy tokens."""
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 200 + 1 for i in range(n)]} for n in (150, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    kwargs = {**FIXED, "enable_prefix_caching": False, "max_num_batched_tokens": 256}
    ours = [o.outputs[0].token_ids for o in LLM(DENSE, **kwargs).generate(prompts, params, use_tqdm=False)]
    fake = install_fake_flashinfer(monkeypatch)
    monkeypatch.setattr(gdn_flashinfer, "unusable_reason", lambda *args: None)
    monkeypatch.setattr(gdn, "FLASHINFER_MIN_TOKENS", 100)
    rows_ours: list[int] = []
    real_ours = gdn.gdn_prefill_ours
    monkeypatch.setattr(gdn, "gdn_prefill_ours", lambda *a: rows_ours.append(a[0].shape[0]) or real_ours(*a))
    llm = LLM(DENSE, **kwargs)
    assert _backends(llm) == {"flashinfer-large"}
    for n in (150, 40):  # one prompt a step: the 150-row call takes FlashInfer, the 40-row one ours
        calls_before = fake.calls
        rows_ours.clear()
        prompt = [{"prompt_token_ids": [(7 * i + 3) % 200 + 1 for i in range(n)]}]
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        assert (fake.calls > calls_before) == (n >= 100) and bool(rows_ours) == (n < 100)
    theirs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert theirs == ours


def test_the_gpu_start_up_compiles_flashinfer_and_keeps_room_for_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the faked CUDA calls: the warm-up first runs FlashInfer on one 64-token sequence (its context-parallel
    kernel) and on 2 (the other, on the CPU's count of 2 SMs); the cache then keeps, per sequence a step may hold
    (max_num_seqs 4), its two state copies of one layer out of the KV blocks, against the same engine on our kernel."""
    fake = install_fake_flashinfer(monkeypatch)
    monkeypatch.setattr(gdn_flashinfer, "unusable_reason", lambda *args: None)
    total, peak = 2 * (warmup.HEADROOM_BYTES + 24 * 2**20), 3 * 2**20
    config = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 64, "max_num_batched_tokens": 64,
              "enable_prefix_caching": False, "gpu_memory_utilization": 0.5}  # fmt: skip
    layouts = {}
    for backend in ("triton", "flashinfer"):
        with pytest.MonkeyPatch.context() as patch, fake_cuda(patch, total, peak):
            layouts[backend] = LLM(DENSE, gdn_prefill_backend=backend, **config).engine.runner.layout
        assert fake.batches[:2] == ([(1, 64), (2, 128)] if backend == "flashinfer" else [])
    model = ModelConfig.from_pretrained(DENSE)
    copies = 4 * gdn_flashinfer.state_copy_bytes(model.linear_num_value_heads, 16, 16)  # 4 sequences, 2 states each
    block = layouts["triton"].bytes_per_block
    assert layouts["triton"].num_slots == layouts["flashinfer"].num_slots
    assert layouts["triton"].num_blocks - layouts["flashinfer"].num_blocks in (copies // block, -(-copies // block))
