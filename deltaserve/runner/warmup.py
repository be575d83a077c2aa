"""The start-up warm-up and the cache budget it leaves: the first half of the runner's memory sizing (runner/memory.py
splits the budget between the state pool, the verify scratch, the prefix-cache checkpoints and the KV blocks).

The warm-up runs real steps on a throw-away cache, prefills of the largest step's tokens and every power of two below
it and a few several-sequence prefills (the GDN scan's launch configurations), then the sampler at its widest, so
Triton compiles and autotunes before serving and the activation peak is measured; while speculating the drafter runs
after those prefills, then a verify step's sampling and one verify step as large as the engine may serve
(runner/verify_warmup.py). With --gdn-prefill-backend flashinfer it first compiles
FlashInfer's kernels (kernels/gdn_flashinfer.py). The cache budget is what this engine's share of the GPU leaves once
the weights, that peak, the CUDA graphs' static buffers and a fixed headroom are taken out (vLLM 0.26's
`gpu_memory_utilization` accounting), or the bytes the configuration fixes.

The functions take the ModelRunner under construction: the warm-up runs real steps through its execute().
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deltaserve.engine_config import EngineConfig
from deltaserve.kernels import gdn_flashinfer, gdn_triton
from deltaserve.kernels._triton import sm_count
from deltaserve.kernels.gdn import CHUNK_SIZE as GDN_CHUNK_SIZE
from deltaserve.kernels.gdn import uses_flashinfer
from deltaserve.model.layers.gdn import GatedDeltaNet
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.cache import CacheLayout, allocate_and_bind, bytes_per_slot, verify_row_bytes
from deltaserve.runner.cuda_graph import buckets, static_bytes
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.mtp_drafter import MtpDrafter
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_decode import SpecDecoder
from deltaserve.runner.spec_graphs import max_verify_batch, verify_static_bytes
from deltaserve.runner.verify_warmup import PeakMeter, verify_warmup_rows, warm_up_verify
from deltaserve.sampler import Sampler, build_sampling_batch
from deltaserve.sampler.rejection import random_accept
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import NewRequest, ScheduledSeq, StepPlan

if TYPE_CHECKING:  # runner/model_runner.py imports runner/memory.py, which imports this module
    from deltaserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GIB = 2**30
# the graph pool's activations beyond the graphs' static buffers, and the libraries' workspaces
HEADROOM_BYTES = 512 * 2**20


def warmup_plan(
    step_id: int, num_tokens: int, max_seq_len: int, block_size: int, vocab_size: int,
    checkpoint_slot: int | None = None,
) -> StepPlan:  # fmt: skip
    """Fresh prefill sequences of at most max_seq_len tokens each, num_tokens in all (lengths_plan)."""
    lengths = [min(max_seq_len, num_tokens - start) for start in range(0, num_tokens, max_seq_len)]
    return lengths_plan(step_id, lengths, block_size, vocab_size, checkpoint_slot)


def lengths_plan(
    step_id: int, lengths: Sequence[int], block_size: int, vocab_size: int, checkpoint_slot: int | None = None
) -> StepPlan:
    """Fresh prefill sequences of the given lengths on rows 0, 1, ..., disjoint blocks and state slots 0, 1, ... of a
    throw-away cache; they sample nothing. With checkpoint_slot, the first sequence, when longer than a GDN chunk,
    saves an in-step prefix-cache checkpoint at 64 there, so the chunked prefill's checkpoint variant compiles before
    serving (runner/step_checkpoints.py)."""
    added, seqs = [], []
    next_block = 0
    for index, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        tokens = tuple((7 * i + index) % vocab_size for i in range(length))
        added.append(NewRequest(index, f"warmup-{index}", tokens, (), SamplingParams(temperature=0.0), ()))
        blocks = tuple(range(next_block, next_block + num_blocks))
        checkpoints = ((GDN_CHUNK_SIZE, checkpoint_slot),) if index == 0 and checkpoint_slot is not None else ()
        if length <= GDN_CHUNK_SIZE:
            checkpoints = ()
        seqs.append(ScheduledSeq(index, 0, length, index, None, blocks, needs_sample=False, checkpoints=checkpoints))
        next_block += num_blocks
    return StepPlan(step_id, tuple(seqs), tuple(added), removed=tuple(range(len(added))))


def scan_probes(
    model: Qwen35Model, device: torch.device, max_num_seqs: int, max_num_tokens: int, max_seq_len: int
) -> list[tuple[int, ...]]:
    """The several-sequence prefills that compile the GDN scan's other launch configurations
    (kernels/gdn_triton.py warmup_probes; the one-sequence prefills compile the rest): none without GDN layers."""
    if all(layer.is_full_attention for layer in model.layers):
        return []
    gdn = first_gdn_layer(model)
    num_sms = sm_count(device)
    return gdn_triton.warmup_probes(gdn.num_v_heads, gdn.head_v_dim, num_sms, max_num_seqs, max_num_tokens, max_seq_len)


def profile_peak_bytes(runner: ModelRunner, num_tokens: int, max_seq_len: int, max_num_seqs: int) -> int:
    """Warm-up on a throw-away cache: prefills of num_tokens (the largest step) and every power of two below
    it, so Triton compiles and autotunes the prefill shapes (the MoE and attention kernels key their configs on
    power-of-two size buckets) before serving, not during it; then the several-sequence prefills that compile the
    GDN scan's other launch configurations (scan_probes), each with and without an in-step checkpoint where the
    prefix cache is on; then the sampler over max_num_seqs rows with
    top-k/top-p (its sort is the largest sampling buffer). While speculating, the MTP drafter runs after each of
    those prefills (its layer over the step's tokens, as after a served prefill), the sampling side of the largest
    verify bucket runs alone (warm_up_verify_sampling), and then one plain decode step and one verify step as large
    as the engine may serve run through execute() on a throw-away cache of their own (runner/verify_warmup.py).
    Returns the activation peak in bytes: the larger of the two phases' (0 off CUDA, where the same steps run
    unmeasured). A step may hold more tokens than one sequence (max_num_batched_tokens > max_model_len), so a size
    above max_seq_len runs as several sequences, as the scheduler would batch them."""
    meter = PeakMeter(runner.device)
    weights = meter.allocated() - runner._allocated_before
    if uses_flashinfer(runner.gdn_prefill_backend):  # both of FlashInfer's kernels compile here, not in a served step
        gdn = first_gdn_layer(runner.model)
        gdn_flashinfer.warm_up(gdn.num_k_heads, gdn.head_k_dim, gdn.A_log, gdn.dt_bias)
    probes = scan_probes(runner.model, runner.device, max_num_seqs, num_tokens, max_seq_len)
    max_seqs = max([-(-num_tokens // max_seq_len)] + [len(lengths) for lengths in probes])
    # with the prefix cache, one more slot: the in-step checkpoint of each step's first sequence (warmup_plan)
    checkpoint_slot = max_seqs if runner.engine_config.enable_prefix_caching else None
    num_slots = max_seqs + (checkpoint_slot is not None)
    num_blocks = max([-(-num_tokens // runner.block_size)] + [sum(-(-n // runner.block_size) for n in lengths)
                                                             for lengths in probes]) + max_seqs  # fmt: skip
    layout = CacheLayout(num_blocks, runner.block_size, num_slots, 0, 0)
    allocate_and_bind(runner.model, runner.model_config, layout, runner.dtype, runner.device)
    saved_table, saved_spec = getattr(runner, "table", None), runner.spec
    runner.table = RequestTable(max_seqs, -(-max_seq_len // runner.block_size), runner.vocab_size, runner.device)
    speculative = runner.engine_config.speculative_config
    runner.spec = None  # the runner's own SpecDecoder (none yet at start-up) is not the warm-up's
    if speculative is not None:  # the drafter after every prefill; one verify chunk of scratch (none runs here)
        k = speculative.num_speculative_tokens
        runner.spec = SpecDecoder(runner.model, max_seqs, k, MtpDrafter(runner.model, k), runner.device,
                                  speculative.synthetic_acceptance_rates, 1)  # fmt: skip
    meter.mark()
    sizes = sorted({num_tokens} | {2**i for i in range(num_tokens.bit_length()) if 2**i < num_tokens}, reverse=True)
    # each probe with and without an in-step checkpoint, as the one-sequence prefills run (the scan's HAS_CKPT)
    probe_steps = [(lengths, slot) for lengths in probes for slot in dict.fromkeys((checkpoint_slot, None))]
    started = time.perf_counter()
    try:
        for step_id, size in enumerate(sizes):
            runner.execute(warmup_plan(step_id, size, max_seq_len, runner.block_size, runner.vocab_size,
                                       checkpoint_slot))  # fmt: skip
            runner.table.apply(StepPlan(-1, (), removed=tuple(range(-(-size // max_seq_len)))))
        for step_id, (lengths, slot) in enumerate(probe_steps, len(sizes)):
            runner.execute(lengths_plan(step_id, lengths, runner.block_size, runner.vocab_size, slot))
            runner.table.apply(StepPlan(-1, (), removed=tuple(range(len(lengths)))))
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0)] * max_num_seqs
        batch = build_sampling_batch(params, [[0]] * max_num_seqs, [[]] * max_num_seqs, [()] * max_num_seqs,
                                     runner.vocab_size, runner.device)  # fmt: skip
        runner.sampler(torch.randn(max_num_seqs, runner.vocab_size, device=runner.device), batch)
        verify = ""
        if speculative is not None:  # the largest verify bucket's sampling: 1 + k positions a row, the random rule
            rows = max_verify_batch(k, max_num_seqs, max_num_seqs)
            warm_up_verify_sampling(runner.sampler, rows, k, runner.vocab_size, runner.device)
            verify = f", a verify step's sampling over {rows} rows of {1 + k} positions"
        peak = meter.peak()
    finally:
        runner.table, runner.spec = saved_table, saved_spec
    if speculative is not None:
        # an upper bound of the cache budget (this phase's peak, not yet the verify step's): its verify scratch
        # caps the bucket as it will cap the served one; every rank runs the same step
        budget = given_budget(runner.engine_config, runner.device)
        if budget is None:
            budget = runner._requested_bytes - weights - peak - graph_bytes(runner, max_num_seqs)[1] - HEADROOM_BYTES
        slot_bytes = bytes_per_slot(runner.model_config, runner.dtype, runner.model.shapes)
        row_bytes = verify_row_bytes(runner.model_config, runner.dtype, k, runner.model.shapes)
        is_sized = runner.engine_config.max_num_seqs is None
        has_policy = speculative.k_policy is not None
        rows = verify_warmup_rows(k, max_num_seqs, num_tokens, runner.tp.min_over_ranks(budget), slot_bytes,
                                  row_bytes, is_sized, has_policy)  # fmt: skip
        drop_cache(runner.model)  # the prefill phase's throw-away cache, before the verify step's
        warm_up_verify(runner, rows, meter, len(sizes) + len(probe_steps))
        peak = max(peak, meter.peak())
        verify += f", a plain decode of {rows} rows, a verify step of {rows} rows of {1 + k} tokens with drafts and "
        verify += "the MTP drafter"
    logger.info("warm-up: %d prefill shapes up to %d tokens, %d several-sequence prefills (%s) and the sampler over "
                "%d rows%s in %.1f s", len(sizes), num_tokens, len(probes), " / ".join(str(len(lengths)) for lengths
                in probes) or "none", max_num_seqs, verify, time.perf_counter() - started)  # fmt: skip
    drop_cache(runner.model)  # before the real cache is allocated
    if meter.is_measuring:
        torch.cuda.empty_cache()
    return peak


def drop_cache(model: Qwen35Model) -> None:
    """Unbinds every cache view of the model (KV, GDN states, the verify scratch, the MTP layer's KV and hidden
    rows), so that a throw-away cache's memory is freed before the next one is allocated."""
    for layer in model.layers:
        mixer = layer.mixer
        mixer.k_cache = mixer.v_cache = mixer.conv_states = mixer.ssm_states = None
        mixer.spec_conv_scratch = mixer.spec_row_scratch = None
    if model.mtp is not None:
        model.mtp.attention.k_cache = model.mtp.attention.v_cache = None
        model.mtp.slot_hidden = None


def warm_up_verify_sampling(
    sampler: Sampler, num_seqs: int, num_speculative_tokens: int, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling side of a verify step of num_seqs chunks of 1 + k tokens, every row random with top-k/top-p: the
    sampler over all num_seqs·(1 + k) positions keeping their distributions, then the random rule's [S, k, V]
    gathers and Exp(1) draws (sampler/rejection.py). Returns the rule's (tokens [S, 1 + k], num_emitted [S])."""
    width = 1 + num_speculative_tokens
    positions = num_seqs * width
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * positions
    batch = build_sampling_batch(params, [[0]] * positions, [[]] * positions, [()] * positions, vocab_size, device)
    batch.keep_probs = True
    out = sampler(torch.randn(positions, vocab_size, device=device), batch)
    index = torch.arange(positions, device=device).view(num_seqs, width)
    target = out.token_ids[index]  # [S, W]
    drafts = target[:, 1:].flip(1).contiguous()  # [S, k]: some accepted, some not
    num_drafts = torch.full((num_seqs,), num_speculative_tokens, dtype=torch.int64, device=device)
    is_coupled = torch.zeros(num_seqs, dtype=torch.bool, device=device)  # unseeded rows: the rule's largest work
    probs = out.probs[index[:, :-1]]  # [S, k, V]
    uniforms = torch.rand(num_seqs, num_speculative_tokens, device=device)
    noise = torch.empty(num_seqs, num_speculative_tokens, vocab_size, device=device).exponential_()
    return random_accept(target, drafts, num_drafts, is_coupled, probs, uniforms, noise)


def first_gdn_layer(model: Qwen35Model) -> GatedDeltaNet:
    return next(layer.linear_attn for layer in model.layers if not layer.is_full_attention)


def given_budget(engine_config: EngineConfig, device: torch.device) -> int | None:
    """The cache budget the configuration fixes: kv_cache_memory_bytes where given (on a GPU whatever
    gpu_memory_utilization says, as in vLLM), else on the CPU cpu_kv_cache_bytes; None: a GPU's, measured."""
    if engine_config.kv_cache_memory_bytes is not None:
        return engine_config.kv_cache_memory_bytes
    return None if is_cuda(device) else engine_config.cpu_kv_cache_bytes


def cache_budget(runner: ModelRunner, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
    """The bytes for the KV cache, the state pool and the verify scratch: kv_cache_memory_bytes where given (the
    warm-up still runs on a GPU: it compiles and autotunes the prefill shapes, as vLLM's profile run does then too),
    else on the CPU cpu_kv_cache_bytes, else what this engine's share of the GPU leaves."""
    given = given_budget(runner.engine_config, runner.device)
    if not is_cuda(runner.device):
        return given
    peak = profile_peak_bytes(runner, max_num_batched_tokens, max_model_len, max_num_seqs)
    free, total = torch.cuda.mem_get_info(runner.device)
    weights = torch.cuda.memory_allocated(runner.device) - runner._allocated_before
    # the graphs' static buffers (decode graphs, or verify graphs while speculating), plus a fixed headroom for the
    # graph pool's other activations and library workspaces
    kind, graphs = graph_bytes(runner, max_num_seqs)
    headroom = HEADROOM_BYTES
    if given is not None:
        logger.info(
            "memory: %.1f GiB total, %.2f GiB free, weights %.2f GiB, warm-up peak %.2f GiB, %s graphs %.2f GiB + "
            "%.2f GiB headroom; cache budget %.2f GiB as kv_cache_memory_bytes gives it (gpu_memory_utilization %s "
            "does not size it; weights, activations and graphs are outside it)", total / GIB, free / GIB,
            weights / GIB, peak / GIB, kind, graphs / GIB, headroom / GIB, given / GIB,
            runner.engine_config.gpu_memory_utilization,
        )  # fmt: skip
        return given
    budget = runner._requested_bytes - weights - peak - graphs
    budget -= headroom
    logger.info(
        "memory: %.1f GiB total, weights %.2f GiB, warm-up peak %.2f GiB, %s graphs %.2f GiB + %.2f GiB "
        "headroom, cache budget %.2f GiB", total / GIB, weights / GIB, peak / GIB, kind, graphs / GIB,
        headroom / GIB, budget / GIB,
    )  # fmt: skip
    return budget


def graph_bytes(runner: ModelRunner, max_num_seqs: int, spec_rows: int | None = None) -> tuple[str, int]:
    """(which graphs, the bytes of their static buffers) as the graphs will allocate them for max_num_seqs: the
    decode graphs' shared logits and the largest bucket's lm_head output (the largest capture size, at most 512
    rows, rounded up to 8: DecodeGraphs' capacity); while speculating, the verify graphs' logits, lm_head output and
    hidden states over their largest bucket's tokens and the MTP drafter's logits over its rows
    (runner/spec_graphs.py), the bucket capped by the verify scratch's spec_rows where given; with a k policy, also
    the width-1 graphs' (all-decode steps without verify chunks: one token a row, up to max_num_seqs rows)."""
    if runner.is_graphed:
        return "decode", static_bytes(buckets(max_num_seqs)[2], runner.vocab_size)
    if runner.is_spec_graphed:
        k = runner.engine_config.speculative_config.num_speculative_tokens
        limit = max_num_seqs if spec_rows is None else spec_rows
        rows = -(-max_verify_batch(k, max_num_seqs, limit) // 8) * 8  # VerifyGraphs.capacity
        hidden_size = runner.model_config.hidden_size
        total = verify_static_bytes(rows, 1 + k, runner.vocab_size, hidden_size, runner.dtype, True)
        if runner.spec_draft_counts is None:
            return "verify", total
        rows = -(-max_verify_batch(0, max_num_seqs, max_num_seqs) // 8) * 8
        total += verify_static_bytes(rows, 1, runner.vocab_size, hidden_size, runner.dtype, True)
        return "verify and width-1", total
    return "no", 0
