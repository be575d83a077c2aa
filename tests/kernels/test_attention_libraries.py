"""--attention-backend's row split (model/layers/attention.py paged_attention_rows) and the two library backends
(kernels/attention_fa3.py, kernels/attention_flashinfer.py) on the CPU through the stand-ins of
tests/support/fake_attention_libraries.py, which compute attention from only what the library call receives: a mixed
step's decode and verify rows run deltaserve's kernel and its prefill rows the library, and the one output equals
deltaserve's kernel over every row (fp32); steps without prefill rows never reach the library."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deltaserve.kernels.attention import paged_attention_ref
from deltaserve.kernels.attention_fa3 import Fa3Prefill
from deltaserve.kernels.attention_flashinfer import FlashInferPrefill, page_list
from deltaserve.model.context import ForwardContext
from deltaserve.model.layers import attention as layer
from deltaserve.runner import attention_plan
from tests.support.fake_attention_libraries import install_fake_fa3, install_fake_flashinfer_prefill

BLOCK, NQ, NKV, D = 16, 4, 2, 32
SCALE = D**-0.5


def _step(num_new: list[int], starts: list[int], num_decodes: int, spec_width: int = 0) -> tuple:
    """A step of these chunks (decodes first, then `spec_width`-wide verify chunks if any, then prefills) over a
    random fp32 cache whose blocks are shuffled: (q, k_cache, v_cache, ctx, layout)."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = np.array(starts) + np.array(num_new)
    width = int(-(-seq_lens.max() // BLOCK)) + 1  # one spare column: the page list must stop at each length
    num_blocks = len(num_new) * width
    tables = torch.randperm(num_blocks, generator=gen).view(len(num_new), width).to(torch.int32)
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, NKV, D, generator=gen) for _ in range(2))
    qsl = np.concatenate([[0], np.cumsum(num_new)])
    q = torch.randn(int(qsl[-1]), NQ, D, generator=gen)
    num_spec = sum(1 for n in num_new[num_decodes:] if n == spec_width) if spec_width else 0
    first = num_decodes + num_spec
    spec = {}
    if num_spec:
        spec = {"num_spec_tokens": num_spec * spec_width,
                "spec_state_indices": torch.zeros(num_spec, dtype=torch.int32),
                "spec_token_index": torch.arange(num_spec * spec_width).view(num_spec, spec_width)}  # fmt: skip
    ctx = ForwardContext(
        num_decode_tokens=num_decodes,
        num_prefill_tokens=int(qsl[-1] - qsl[first]),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        max_query_len=max(num_new),
        max_seq_len=int(seq_lens.max()),
        state_indices=torch.zeros(len(num_new), dtype=torch.int32),
        has_initial_state=torch.zeros(len(num_new), dtype=torch.int32),
        prefill_query_start_loc=torch.tensor(qsl[first:] - qsl[first], dtype=torch.int32),
        **spec,
    )
    layout = SimpleNamespace(query_start_loc=qsl, starts=np.array(starts), num_new=np.array(num_new),
                             chained=np.zeros(len(num_new), dtype=bool))  # fmt: skip
    return q, k_cache, v_cache, ctx, layout


def _backend(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    if name == "FLASH_ATTN":
        fake = install_fake_fa3(monkeypatch)
        return Fa3Prefill(), fake
    wrappers = install_fake_flashinfer_prefill(monkeypatch)
    return FlashInferPrefill(NQ, NKV, D, BLOCK, SCALE, torch.float32, torch.device("cpu")), wrappers


def _spy_ours(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The query rows of each call of deltaserve's kernel from the layer."""
    rows: list[int] = []
    monkeypatch.setattr(layer, "paged_attention", lambda q, *a: rows.append(q.shape[0]) or paged_attention_ref(q, *a))
    return rows


def _library_rows(name: str, fake: object) -> list[int]:
    if name == "FLASH_ATTN":
        return [rows for _, rows in fake.batches]
    return [rows for wrapper in fake.instances for rows in wrapper.runs]


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER"])
@pytest.mark.parametrize("spec_width", [0, 3])
def test_a_mixed_step_splits_and_equals_ours(name: str, spec_width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 decodes, (with spec_width) 2 verify chunks, then 3 prefill chunks: one from scratch, one after 37 cached
    tokens (a chunked prefill over 3 pages), one of 16 tokens ending on a page boundary."""
    num_new, starts = [1, 1], [20, 47]
    if spec_width:
        num_new, starts = num_new + [spec_width] * 2, starts + [9, 30]
    num_new, starts = num_new + [21, 11, 16], starts + [0, 37, 16]
    q, k_cache, v_cache, ctx, layout = _step(num_new, starts, 2, spec_width)
    backend, fake = _backend(name, monkeypatch)
    ours = _spy_ours(monkeypatch)
    want = paged_attention_ref(q, k_cache, v_cache, ctx.query_start_loc, ctx.seq_lens, ctx.block_tables, SCALE)
    attention_plan.plan_step(backend, ctx, layout)
    got = layer.paged_attention_rows(q, k_cache, v_cache, ctx, SCALE, name)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    first = 2 + 2 * spec_width
    assert ours == [first] and _library_rows(name, fake) == [48]


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER"])
def test_steps_without_prefill_rows_never_reach_the_library(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, fake = _backend(name, monkeypatch)
    ours = _spy_ours(monkeypatch)
    for num_new, starts, spec_width in (([1, 1, 1], [5, 17, 40], 0), ([1, 4, 4], [5, 17, 40], 4)):
        q, k_cache, v_cache, ctx, layout = _step(num_new, starts, 1 if spec_width else 3, spec_width)
        assert ctx.num_prefill_tokens == 0
        attention_plan.plan_step(backend, ctx, layout)
        assert ctx.prefill_attention is None
        want = paged_attention_ref(q, k_cache, v_cache, ctx.query_start_loc, ctx.seq_lens, ctx.block_tables, SCALE)
        torch.testing.assert_close(layer.paged_attention_rows(q, k_cache, v_cache, ctx, SCALE, name), want)
    assert ours == [3, 9] and _library_rows(name, fake) == []
    assert name == "FLASH_ATTN" or all(wrapper.plans == 0 for wrapper in fake.instances)


def test_triton_attn_runs_ours_on_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _spy_ours(monkeypatch)
    q, k_cache, v_cache, ctx, _ = _step([1, 21, 11], [20, 0, 37], 1)
    layer.paged_attention_rows(q, k_cache, v_cache, ctx, SCALE, "TRITON_ATTN")
    assert ours == [33]


def test_a_prefill_step_without_its_plan_is_an_error() -> None:
    q, k_cache, v_cache, ctx, _ = _step([1, 21], [20, 0], 1)
    with pytest.raises(RuntimeError, match="--attention-backend FLASHINFER: a step with 21 prefill rows .*plan"):
        layer.paged_attention_rows(q, k_cache, v_cache, ctx, SCALE, "FLASHINFER")


def test_a_chained_prefill_chunk_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = _backend("FLASHINFER", monkeypatch)
    _, _, _, ctx, layout = _step([1, 21], [20, 0], 1)
    layout.chained[1] = True
    with pytest.raises(RuntimeError, match="behind a verify in flight"):
        attention_plan.plan_step(backend, ctx, layout)


def test_flashinfer_plans_alternate_wrappers_and_keep_indptrs_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prepare plans the other wrapper (a plan never rewrites the one the previous step may still read); the
    stand-in refuses indptrs on the device, so this also proves the plan's host side."""
    backend, fake = _backend("FLASHINFER", monkeypatch)
    for _ in range(3):
        _, _, _, ctx, layout = _step([1, 21], [20, 0], 1)
        attention_plan.plan_step(backend, ctx, layout)
    assert [wrapper.plans for wrapper in fake.instances] == [2, 1] and backend.plans == 3


def test_page_list() -> None:
    indptr, positions, last = page_list(np.array([16, 1, 33]), 16, 4)
    assert indptr.tolist() == [0, 1, 2, 5]
    assert positions.tolist() == [0, 4, 8, 9, 10]  # row-major positions in the [3, 4] block table
    assert last.tolist() == [16, 1, 1]


def test_the_fakes_refuse_a_device_side_indptr(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in's host check can fail (a device indptr stands for one on the GPU: the CPU has no other device, so
    a meta tensor plays it)."""
    wrappers = install_fake_flashinfer_prefill(monkeypatch)
    wrapper = wrappers(torch.empty(128 << 20, dtype=torch.uint8))
    host = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(AssertionError, match="qo_indptr: int32 on the host"):
        wrapper.plan(host.to("meta"), host, host[1:], host[1:], NQ, NKV, D, BLOCK, causal=True, sm_scale=1.0,
                     q_data_type=torch.float32, kv_data_type=torch.float32)  # fmt: skip
