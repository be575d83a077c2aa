"""On the GPU: --kv-cache-memory-bytes sizes the cache from its bytes after the real warm-up and memory queries,
whatever gpu_memory_utilization says (vLLM 0.26's gpu_worker.determine_available_memory), and the tensors bound to
the layers take exactly the planned bytes. On the CPU, with the CUDA calls stood in: tests/runner/test_cache_budget.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir

DENSE = trained_model_dir("dense")
BUDGET = 64 * 2**20
SEQS = 8


def _sizes() -> tuple[int, int]:
    """(bytes of one 16-token KV block, bytes of one GDN state slot) in bf16 with the fp32 recurrent state."""
    c = ModelConfig.from_pretrained(DENSE)
    block = 2 * 16 * c.num_key_value_heads * c.head_dim * 2 * len(c.full_attention_layers)
    conv = (c.linear_conv_kernel_dim - 1) * (
        2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    )
    ssm = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return block, (conv * 2 + ssm * 4) * len(c.linear_attention_layers)


@pytest.mark.gpu
@pytest.mark.parametrize("utilization", [0.2, 0.5])
def test_kv_cache_memory_bytes_sizes_the_gpu_cache_whatever_the_utilization(utilization: float) -> None:
    block, slot = _sizes()
    llm = LLM(DENSE, dtype="bfloat16", max_model_len=256, max_num_seqs=SEQS, enable_prefix_caching=False,
              gpu_memory_utilization=utilization, kv_cache_memory_bytes=BUDGET)  # fmt: skip
    runner = llm.engine.runner
    assert (runner.layout.num_blocks, runner.layout.num_slots) == ((BUDGET - SEQS * slot) // block, SEQS)
    attention = next(layer.self_attn for layer in runner.model.layers if layer.is_full_attention)
    gdn = next(layer.linear_attn for layer in runner.model.layers if not layer.is_full_attention)
    # one tensor per kind holds every layer's views (runner/cache.py allocate_and_bind)
    bound = sum(t.untyped_storage().nbytes() for t in (attention.k_cache, gdn.conv_states, gdn.ssm_states))
    assert bound == runner.layout.num_blocks * block + SEQS * slot <= BUDGET
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [3, 17, 29, 5]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8
    del llm, runner, attention, gdn
    gc.collect()
    torch.cuda.empty_cache()
