"""Decode-step benchmark: GPU time of one captured decode step per batch size, and every kernel in it against the
bandwidth and matrix-rate ceilings measured in the same run.

    python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models
    python3 benchmarks/decode_step.py --models /tmp/ds_models --tune

For each shape (`--shapes`, keys of SHAPES or folder names: 35b-a3b and 27b, bf16, and their block-FP8 twins
35b-a3b-fp8, 27b-fp8 plus 122b-a10b-fp8, make_dummy_models.py's q35-*-fp8 folders; each the real Qwen35Model
built from the folder's config, block-FP8 projections as Fp8Weight where its quantization_config says so, filled
by init_dummy_weights as --load-format dummy fills it (seed 0 here, the server's 1234), then the serving path's
load-time fusions) and each batch size B it binds its own KV cache and GDN state slots (B sequences of --context
cached tokens), builds a decode ForwardContext directly, and
- captures the decode forward + lm_head as a CUDA graph and times replays with CUDA events (median, p10, p90
  of --replays): `graph_ms`, the number to compare across B (no launch overhead, inputs on the device);
- runs one eager forward under torch.profiler with the model's own labels on (deltaserve/model/labels.py: a range
  around every layer and every op it calls): per op the kernels' GPU time, the bytes the op must move at least
  and the FLOPs it must do (counted here from the shapes, see `op_costs`; a projection's weight at the size the
  model holds it, `model_weight_bytes`: a block-FP8 weight 1 byte an element plus its fp32 block scales, the rest
  at the model dtype), and the achieved GB/s and TFLOP/s against the device-to-device copy bandwidth and the bf16
  GEMM rate measured at start (no FP8 GEMM rate is measured: an FP8 run's record and summary say so). What a
  layer runs outside its ops is `attn.other` / `gdn.other`. A run's entry in the record lists the weight bytes
  per projection call it counted (`weight_bytes`) and whether the shape is block FP8 (`is_fp8`).
Variants (`--variants`, default `model`): `model` runs the model as committed; `nopdl` runs it with
DELTASERVE_PDL=0 (plain launches instead of programmatic dependent launch,
docs/kernels.md#programmatic-dependent-launch). Every variant of every shape is timed before the process's first
profile (run_shape says why), and on the GPU after an unrecorded timing pass of the first variant
(`--no-warmup-pass` drops it, `--warmup-pass` asks for it on the CPU: the first variant timed in a process read up
to 0.14 ms slower at B = 1), so variants compare fairly in one process.
`--tune` first runs benchmarks/tune_moe.py for the 35B-A3B MoE shape and installs the table it writes (bf16 experts
only: the block-FP8 kernels' launch configurations are fixed, kernels/fp8_triton.py).
`--baseline DIR` runs the same measurement in a subprocess against another deltaserve tree (PYTHONPATH=DIR,
`model` variant only) and stores it as the `before` half of the record. Tables go to stdout (the last one is
the per-B summary), the JSON record to --out (default benchmarks/results/kernels/decode-step-<UTC time>.json)
after every batch size. Exits 2 without CUDA (unless --device cpu, the plumbing check the CPU test runs), 1 if a
measurement failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kernels"  # where the kernel benchmarks' records are filed
# --shapes key -> make_dummy_models.py's folder: the bf16 text shapes and their block-FP8 twins (the 122B-A10B in FP8
# only: its FP8 weights need an H200, and B up to 64 there, docs/fp8.md#the-122b-a10b-on-one-h200)
SHAPES = {"35b-a3b": "q35-35b-a3b", "27b": "q35-27b", "35b-a3b-fp8": "q35-35b-a3b-fp8", "27b-fp8": "q35-27b-fp8",
          "122b-a10b-fp8": "q35-122b-a10b-fp8"}  # fmt: skip
DEFAULT_BATCHES = "1,2,4,8,16,24,32,48,64,96,128,192,256"
LABEL = "ds:"  # the model labels' prefix (deltaserve.model.labels.PREFIX; fixed here for a --baseline tree)
CLIFF_TOLERANCE = 0.05  # a larger batch may be at most this much faster than a smaller one


# ----------------------------------------------------------------------------------------------------------------
# Ceilings


def default_out(kind: str) -> Path:
    """A new record's default path: RESULTS / `<kind>-<UTC date and time>.json`."""
    return RESULTS / f"{kind}-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"


def event_times_ms(fn: Callable[[], object], reps: int) -> list[float]:
    """GPU ms of each of `reps` calls of fn, between two CUDA events, each call waited for. (deltaserve/bench/
    kernels.py has the same helper; this script keeps its own because --baseline runs it against another tree.)"""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = sorted(event_times_ms(fn, reps))
    return times[len(times) // 2]


def _copy_gbps(num_bytes: int = 2 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * num_bytes / (_median_ms(lambda: dst.copy_(src), 20) * 1e-3) / 1e9


def _gemm_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda").to(torch.bfloat16) for _ in range(2))
    for _ in range(3):
        torch.matmul(a, b)
    return 2 * n**3 / (_median_ms(lambda: torch.matmul(a, b), 20) * 1e-3) / 1e12


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (bytes read + written by a 2 GiB device-to-device copy) and the bf16 GEMM rate (8192³
    through torch.matmul on random data), medians of 20."""
    ceilings = {"copy_gbps": _copy_gbps(), "bf16_tflops": _gemm_tflops()}
    torch.cuda.empty_cache()
    return ceilings


# ----------------------------------------------------------------------------------------------------------------
# Model, cache and context


def build_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from deltaserve.config import ModelConfig
    from deltaserve.model.loader import init_dummy_weights
    from deltaserve.model.qwen3_5 import Qwen35Model

    config = ModelConfig.from_pretrained(model_dir)
    model = Qwen35Model(config, dtype, device)
    init_dummy_weights(model, seed=0)
    if hasattr(model, "fuse_projections"):  # as the runner does (a --baseline tree may predate it)
        model.fuse_projections()
    model.eval()
    return config, model


@dataclasses.dataclass
class Cache:
    block_size: int
    blocks_per_seq: int
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32, sequence b owns blocks_per_seq scattered blocks


def bind_cache(model: Any, config: Any, max_batch: int, context: int, max_model_len: int, block_size: int) -> Cache:
    """KV blocks for max_batch sequences of context + 1 tokens (scattered, as a long-running cache is) and one
    GDN state slot per sequence, allocated here and bound to the layers as the runner binds them."""
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = max_batch * blocks_per_seq + 1
    attn = [layer.self_attn for layer in model.layers if layer.is_full_attention]
    gdn = [layer.linear_attn for layer in model.layers if not layer.is_full_attention]
    kv_shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    for mixer in attn:
        mixer.k_cache = torch.randn(kv_shape, device=device).to(dtype)
        mixer.v_cache = torch.randn(kv_shape, device=device).to(dtype)
    ssm_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.ssm_state_dtype, torch.float32)
    conv_shape = (max_batch, config.linear_conv_kernel_dim - 1, config.conv_dim)
    ssm_shape = (max_batch, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    for mixer in gdn:
        mixer.conv_states = torch.randn(conv_shape, device=device).to(dtype)
        mixer.ssm_states = (torch.randn(ssm_shape, device=device) * 0.05).to(ssm_dtype)
    max_blocks = -(-max_model_len // block_size)
    tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
    order = torch.randperm(num_blocks - 1, device=device).int() + 1
    tables[:, :blocks_per_seq] = order[: max_batch * blocks_per_seq].view(max_batch, blocks_per_seq)
    return Cache(block_size, blocks_per_seq, tables)


def decode_context(
    cache: Cache, batch: int, context: int, vocab_size: int, device: torch.device
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(ForwardContext, input_ids [B], positions [3, B]) of one all-decode step: every sequence holds `context`
    tokens and decodes token `context` (stored at its slot, attention over context + 1 keys)."""
    from deltaserve.model.context import ForwardContext

    tables = cache.block_tables[:batch]
    block = tables[:, context // cache.block_size].long()
    slot_mapping = block * cache.block_size + context % cache.block_size
    values = {
        "num_decode_tokens": batch,
        "num_prefill_tokens": 0,
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        "block_tables": tables,
        "slot_mapping": slot_mapping,
        "max_query_len": 1,
        "max_seq_len": tables.shape[1] * cache.block_size,
        "state_indices": torch.arange(batch, dtype=torch.int32, device=device),
        "has_initial_state": torch.ones(batch, dtype=torch.bool, device=device),
        "prefill_query_start_loc": torch.zeros(1, dtype=torch.int32, device=device),
    }
    fields = {f.name: f for f in dataclasses.fields(ForwardContext) if f.init}
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]  # fmt: skip
    if missing:
        raise RuntimeError(f"ForwardContext gained required fields this benchmark does not fill: {missing}")
    ctx = ForwardContext(**{n: v for n, v in values.items() if n in fields})
    generator = torch.Generator(device="cpu").manual_seed(batch)
    ids = torch.randint(vocab_size // 8, vocab_size * 7 // 8, (batch,), generator=generator).to(device)
    positions = torch.full((3, batch), context, dtype=torch.int64, device=device)
    return ctx, ids, positions


# ----------------------------------------------------------------------------------------------------------------
# Labels: the model's own profiler ranges (deltaserve/model/labels.py), one around every layer and every op


def linear_names(config: Any) -> dict[str, dict[tuple[int, int], str]]:
    """The projections' op names by weight shape, per kind: what op_costs counts for each projection label."""
    h = config.hidden_size
    nq, nkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    names = {
        "gdn": {
            (config.conv_dim + config.value_dim, h): "in_proj_qkvz",
            (2 * config.linear_num_value_heads, h): "in_proj_ba",
            # the serving path's fused weight (GatedDeltaNet.fuse_in_proj): both projections in one GEMM
            (config.conv_dim + config.value_dim + 2 * config.linear_num_value_heads, h): "in_proj_qkvzba",
            (h, config.value_dim): "out_proj",
        },  # fmt: skip
        "attn": {(2 * nq * d + 2 * nkv * d, h): "qkv_proj", (h, nq * d): "o_proj"},
        "mlp": {(2 * config.intermediate_size, h): "gate_up", (h, config.intermediate_size): "down"},
        "lm": {(config.vocab_size, h): "lm_head"},
    }
    if config.num_experts:
        ish = config.shared_expert_intermediate_size
        names["mlp"].update({(config.num_experts, h): "moe_router", (2 * ish, h): "shared_gate_up",
                             (h, ish): "shared_down", (1, h): "shared_gate"})  # fmt: skip
    return names


@contextlib.contextmanager
def labelled() -> Iterator[None]:
    """The model's labels on for the block. A --baseline tree older than them profiles without (its kernels are
    then attributed by name, TRITON_LABELS)."""
    try:
        from deltaserve.model import labels
    except ImportError:
        print("decode_step: this deltaserve tree has no model labels; kernels are attributed by name", flush=True)
        yield
        return
    with labels.enabled():
        yield


def op_of(name: str) -> str | None:
    """The op a model label (its name without the prefix) stands for in the record: an op label is itself;
    what a layer runs outside its ops is `attn.other` / `gdn.other` (by the layer's kind), what compute_logits
    runs outside lm_head `lm.other`."""
    if name.startswith("layer.") and name.count(".") == 2 and name.split(".")[1].isdigit():
        return "attn.other" if name.endswith(".full_attention") else "gdn.other"
    if "." not in name:
        return f"{name}.other"
    return name


# ----------------------------------------------------------------------------------------------------------------
# Bytes and FLOPs each op must move / do (compulsory: inputs read once, outputs written once)


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of independently routed tokens hits: E·(1 − (1 − k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def tensor_bytes(weight: Any) -> int:
    """Bytes of one weight as the model holds it: every element at its own size (1 for float8_e4m3fn, 2 for bf16),
    and for a block-FP8 weight (kernels/fp8.py's Fp8Weight: float8 `weight` [..., N, K] and fp32 `scale`
    [..., ceil(N/block_n), ceil(K/128)]) its scales too."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return tensor_bytes(weight.weight) + tensor_bytes(weight.scale)


# a mixer's projection labels -> the attribute holding the weight (`in_proj`: GatedDeltaNet.fuse_in_proj's fused
# qkvz | ba rows, absent where the model keeps two GEMMs, as it does for block-FP8 qkvz)
MIXER_WEIGHTS = {
    "gdn": {"in_proj_qkvzba": "in_proj", "in_proj_qkvz": "in_proj_qkvz", "in_proj_ba": "in_proj_ba",
            "out_proj": "out_proj"},
    "attn": {"qkv_proj": "qkv_proj", "o_proj": "o_proj"},
}  # fmt: skip


def projection_weights(model: Any) -> dict[str, Any]:
    """Label -> the weight one call of that projection reads, as the model holds it (a tensor, or kernels/fp8.py's
    Fp8Weight): the mixers' projections, the router, the shared expert's or the dense MLP's gate | up and down, and
    lm_head, each from the first layer that has it."""
    found: dict[str, Any] = {"lm.lm_head": model.lm_head}
    for layer in model.layers:
        kind, mixer = ("attn", layer.self_attn) if layer.is_full_attention else ("gdn", layer.linear_attn)
        for name, attr in MIXER_WEIGHTS[kind].items():
            weight = getattr(mixer, attr, None)
            if weight is not None:
                found.setdefault(f"{kind}.{name}", weight)
        mlp = layer.mlp
        if hasattr(mlp, "w13"):  # MoEBlock
            found.setdefault("mlp.moe_router", mlp.gate)
            if getattr(mlp, "has_shared_expert", False):
                found.setdefault("mlp.shared_gate_up", mlp.shared_expert.gate_up_proj)
                found.setdefault("mlp.shared_down", mlp.shared_expert.down_proj)
                found.setdefault("mlp.shared_gate", mlp.shared_expert_gate)
        else:  # DenseMLP
            found.setdefault("mlp.gate_up", mlp.gate_up_proj)
            found.setdefault("mlp.down", mlp.down_proj)
    return found


def model_weight_bytes(model: Any) -> dict[str, int]:
    """Label -> bytes of the weight one call of that op reads (one layer's; `mlp.expert`: one routed expert's gate |
    up and down), taken from the model's own tensors (tensor_bytes): a block-FP8 projection counts 1 byte an element
    plus its fp32 scales, a bf16 one (lm_head, the router, GDN in_proj_ba, shared_expert_gate, every projection of a
    bf16 checkpoint) 2, so op_costs' counts of a bf16 model are the same as from the shapes alone."""
    found = {label: tensor_bytes(weight) for label, weight in projection_weights(model).items()}
    moe = next((layer.mlp for layer in model.layers if hasattr(layer.mlp, "w13")), None)
    if moe is not None:
        found["mlp.expert"] = (tensor_bytes(moe.w13) + tensor_bytes(moe.w2)) // moe.w13.shape[0]
    return found


def fp8_labels(model: Any) -> set[str]:
    """The projection labels whose weight the model holds in block FP8 (none for a bf16 model, or a --baseline tree
    without FP8 weights)."""
    try:
        from deltaserve.kernels.fp8 import Fp8Weight
    except ImportError:
        return set()
    return {label for label, weight in projection_weights(model).items() if isinstance(weight, Fp8Weight)}


def op_costs(
    config: Any, batch: int, context: int, dtype_bytes: int = 2, weights: dict[str, int] | None = None
) -> dict[str, tuple[float, float]]:
    """Label (without the prefix) -> (bytes, FLOPs) per step, summed over the layers that run it. Activations, caches
    and states count dtype_bytes an element; a projection's weight counts `weights[label]` bytes where given
    (model_weight_bytes: the model's own tensors, so block-FP8 values at 1 byte plus their fp32 scales), else
    dtype_bytes an element. FLOPs do not depend on the weights' format."""
    b, h, s = batch, config.hidden_size, dtype_bytes
    weights = weights or {}
    nq, nkv, d, r = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rotary_dim
    hv, hk, dk, dv = (config.linear_num_value_heads, config.linear_num_key_heads, config.linear_key_head_dim,
                      config.linear_value_head_dim)  # fmt: skip
    num_attn, num_gdn = len(config.full_attention_layers), len(config.linear_attention_layers)
    num_layers = config.num_hidden_layers
    num_moe = sum(1 for x in config.moe_layers if x) if config.num_experts else 0
    num_dense = num_layers - num_moe
    state_bytes = 4 if config.ssm_state_dtype == "float32" else 2
    costs: dict[str, tuple[float, float]] = {}

    def add(label: str, num_bytes: float, flops: float = 0.0, times: int = 1) -> None:
        old = costs.get(label, (0.0, 0.0))
        costs[label] = (old[0] + times * num_bytes, old[1] + times * flops)

    def weight(label: str, elements: int) -> float:
        return weights.get(label, elements * s)

    def linear(label: str, n: int, k: int, times: int) -> None:
        add(label, weight(label, n * k) + (b * k + b * n) * s, 2.0 * b * n * k, times)

    names = linear_names(config)
    for kind, times in (("gdn", num_gdn), ("attn", num_attn), ("lm", 1)):
        for (n, k), name in names[kind].items():
            linear(f"{kind}.{name}", n, k, times)
    add("lm.embed", 2 * b * h * s)
    add("layer.rms_norm", 4 * b * h * s, 0, 2 * num_layers)  # residual add + norm, twice a layer, and the final
    add("layer.rms_norm", 4 * b * h * s, 0, 1)
    add("layer.rope_cos_sin_for_positions", b * r * s, 0, 1)
    # attention
    add("attn.attn_preamble", b * ((2 * nq * d + nkv * d) * 2 + r) * s, 0, num_attn)
    add("attn.store_kv", 4 * b * nkv * d * s, 0, num_attn)
    add("attn.paged_attention", (2 * b * (context + 1) * nkv * d + 2 * b * nq * d) * s,
        4.0 * b * (context + 1) * nq * d, num_attn)  # fmt: skip
    add("attn.sigmoid_gate_mul", 3 * b * nq * d * s, 0, num_attn)  # sigmoid(gate)·o
    # Gated DeltaNet
    conv = config.conv_dim
    kc = config.linear_conv_kernel_dim
    add("gdn.causal_conv1d_update", (2 * b * conv + 2 * b * (kc - 1) * conv + conv * kc) * s, 2.0 * b * conv * kc,
        num_gdn)  # fmt: skip
    add("gdn.gdn_decode", 2 * b * hv * dk * dv * state_bytes + b * (2 * hk * dk + 2 * hv * dv + 2 * hv) * s,
        8.0 * b * hv * dk * dv, num_gdn)  # fmt: skip
    add("gdn.gated_rms_norm", 3 * b * hv * dv * s, 0, num_gdn)
    # MLP / MoE
    if num_dense:
        for (n, k), name in names["mlp"].items():
            if name in ("gate_up", "down"):
                linear(f"mlp.{name}", n, k, num_dense)
        add("mlp.silu_and_mul", 3 * b * config.intermediate_size * s, 0, num_dense)
    if num_moe:
        e, k, i = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
        ish = config.shared_expert_intermediate_size
        experts = expected_experts(e, k, b) * weight("mlp.expert", 3 * i * h)
        shared = weight("mlp.shared_gate_up", 2 * ish * h) + weight("mlp.shared_down", ish * h)
        gates = weight("mlp.moe_router", e * h) + weight("mlp.shared_gate", h)  # the router and the shared gate
        flops = 2.0 * b * k * 3 * i * h
        add("mlp.fused_moe", experts + (b * h + b * k * 4) * s, flops, num_moe)
        add("mlp.moe_route", b * e * s, 0, num_moe)
        add("mlp.silu_and_mul", 3 * b * ish * s, 0, num_moe)
        for (n, kk), name in names["mlp"].items():
            if name.startswith(("moe_router", "shared")):
                linear(f"mlp.{name}", n, kk, num_moe)
        add("mlp.fused_moe_block", experts + shared + gates + 2 * b * h * s,
            flops + 2.0 * b * (3 * ish + e + 1) * h, num_moe)  # fmt: skip
    add("lm.other", b * config.vocab_size * (s + 4), 0, 1)  # the logits' fp32 upcast
    return costs


# ----------------------------------------------------------------------------------------------------------------
# One batch size


def _label_of(event: Any) -> str | None:
    """The op of the innermost model label around a profiler event (None outside every label)."""
    node = event
    while node is not None:
        if node.name.startswith(LABEL):
            return op_of(node.name[len(LABEL) :])
        node = node.cpu_parent
    return None


# Where a Triton kernel belongs when the profiler did not link it to a labelled range (a fallback: kineto links
# each kernel to the innermost op or range active at its launch, so this should stay unused).
GEMV_LABEL = "layer.linear_gemv"
FP8_LABEL = "layer.linear_fp8"
TRITON_LABELS = {
    "_attn_preamble_kernel": "attn.attn_preamble",
    "_store_kv_kernel": "attn.store_kv",
    "_paged_attn_decode_kernel": "attn.paged_attention",
    "_paged_attn_combine_kernel": "attn.paged_attention",
    "_causal_conv1d_update_kernel": "gdn.causal_conv1d_update",
    "_gdn_decode_kernel": "gdn.gdn_decode",
    "_gated_rms_norm_kernel": "gdn.gated_rms_norm",
    "_rms_norm_kernel": "layer.rms_norm",
    "_silu_and_mul_kernel": "mlp.silu_and_mul",
    "_moe_route_kernel": "mlp.moe_route",
    # kernels.linear's one-row GEMV: its launches escape the projections' ranges, so they are counted together
    "_gemv_kernel": GEMV_LABEL,
    # the block-FP8 projections' GEMM and its activation quantization escape them too: counted together likewise
    "_fp8_gemm_kernel": FP8_LABEL,
    "_quant_act_kernel": FP8_LABEL,
}
MOE_KERNELS = ("_moe_align_kernel", "_moe_gemm1_kernel", "_moe_gemm2_kernel", "_moe_sum_kernel", "_moe_router_kernel",
               "_moe_router_gemv_kernel",
               "_moe_decode_gemm1_kernel", "_moe_decode_gemm2_kernel", "_moe_decode_gemm2_split_kernel",
               "_moe_decode_combine_kernel", "_moe_fp8_gemm1_kernel", "_moe_fp8_gemm2_kernel")  # fmt: skip


# the op unclaimed MoE kernels get: the model's one MoE op at whole experts (router, routed and shared experts)
MOE_LABEL = "mlp.fused_moe_block"


def gemv_cost(by_label: dict[str, Any], costs: dict[str, tuple[float, float]], called: set[str]) -> tuple[float, float]:
    """(bytes, FLOPs) of the GEMV's label (or the FP8 GEMM's, given the FP8 projections as `called`): the
    projections called whose own labels claimed no kernel (their launches went to the GEMV, counted by kernel name);
    a projection cuBLAS ran (lm_head) keeps its own label."""
    missing = [label for label in called if label in costs and label not in by_label]
    return sum(costs[label][0] for label in missing), sum(costs[label][1] for label in missing)


def profile_ops(
    run: Callable[[], object], device: torch.device
) -> tuple[dict[str, dict[str, float]], dict[str, Any], set[str]]:
    """One forward under the profiler: per op {us, kernels} (the device kernels launched inside the op's innermost
    model label; on the CPU, where no kernels exist, the labels' CPU time), the kernel totals (per kernel name {us,
    calls}, all kernels' time, and what no label claimed, attributed by kernel name where known), and the ops whose
    labels ran (claimed a kernel or not)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    by_label: dict[str, dict[str, float]] = defaultdict(lambda: {"us": 0.0, "kernels": 0})
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    claimed: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    called: set[str] = set()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA and event.name.startswith(LABEL):
            called.add(op_of(event.name[len(LABEL) :]))
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.name][0] += event.time_range.elapsed_us()
            by_kernel[event.name][1] += 1
        elif device.type == "cuda" and event.kernels:
            label = _label_of(event) or "unlabelled"
            for kernel in event.kernels:
                by_label[label]["us"] += kernel.duration
                by_label[label]["kernels"] += 1
                claimed[kernel.name][0] += kernel.duration
                claimed[kernel.name][1] += 1
        elif device.type != "cuda" and event.name.startswith(LABEL):
            op = op_of(event.name[len(LABEL) :])
            by_label[op]["us"] += event.cpu_time_total
            by_label[op]["kernels"] += 1
    unclaimed_us = 0.0
    if device.type == "cuda":
        for name, (us, calls) in by_kernel.items():
            left_us, left_calls = us - claimed[name][0], calls - claimed[name][1]
            if left_calls <= 0:
                continue
            unclaimed_us += left_us
            label = MOE_LABEL if name in MOE_KERNELS else TRITON_LABELS.get(name, "unlabelled")
            by_label[label]["us"] += left_us
            by_label[label]["kernels"] += left_calls
    kernels = {
        "total_us": round(sum(v[0] for v in by_kernel.values()), 1),
        "unclaimed_us": round(unclaimed_us, 1),
        "top": sorted(({"name": n[:120], "us": round(v[0], 2), "calls": v[1]} for n, v in by_kernel.items()),
                      key=lambda row: -row["us"])[:40],
    }  # fmt: skip
    return dict(by_label), kernels, called


def graph_times(run: Callable[[], object], replays: int) -> dict[str, float]:
    """Capture run() (a decode forward + logits) as a CUDA graph; replay; median/p10/p90 ms by CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # allocator warm-up off the capture stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = sorted(event_times_ms(graph.replay, replays))
    del graph
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {"graph_ms": times[len(times) // 2], "graph_ms_p10": pick(0.1), "graph_ms_p90": pick(0.9)}


def _decode_run(model: Any, config: Any, cache: Cache, batch: int, args: argparse.Namespace) -> Callable[[], Any]:
    """One decode forward + logits of `batch` sequences at args.context cached tokens each."""
    from deltaserve.model.context import forward_context

    device = model.embed_tokens.device
    ctx, ids, positions = decode_context(cache, batch, args.context, config.vocab_size, device)

    def run() -> torch.Tensor:
        with forward_context(ctx):
            return model.compute_logits(model(ids, positions))

    return run


def time_batch(model: Any, config: Any, cache: Cache, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """A batch size's first forward (its compiles) and its step time: the CUDA graph's replays on the GPU, one eager
    forward on the CPU. Runs before any profiler session of the process (see run_shape)."""
    device = model.embed_tokens.device
    run = _decode_run(model, config, cache, batch, args)
    row: dict[str, Any] = {"batch": batch}
    with torch.inference_mode():
        started = time.perf_counter()
        run()  # compiles the kernels this batch size first meets
        if device.type == "cuda":
            torch.cuda.synchronize()
        row["first_forward_s"] = round(time.perf_counter() - started, 2)
        if device.type == "cuda":
            row.update(graph_times(run, args.replays))
        else:
            started = time.perf_counter()
            run()
            row["eager_ms"] = (time.perf_counter() - started) * 1e3
    return row


def profile_batch(
    model: Any, config: Any, cache: Cache, row: dict[str, Any], args: argparse.Namespace, ceilings: dict[str, float]
) -> None:
    """Adds to a timed row the per-op kernel times of one eager forward under the profiler, the op's bytes and
    FLOPs (weights as the model holds them, activations in the model's dtype: op_costs), and the floor."""
    batch = row["batch"]
    device = model.embed_tokens.device
    run = _decode_run(model, config, cache, batch, args)
    with torch.inference_mode(), labelled():
        by_label, kernels, called = profile_ops(run, device)
    costs = op_costs(config, batch, args.context, model.embed_tokens.element_size(), model_weight_bytes(model))
    fp8 = fp8_labels(model)
    if GEMV_LABEL in by_label:
        costs[GEMV_LABEL] = gemv_cost(by_label, costs, called - fp8)
    if FP8_LABEL in by_label:
        costs[FP8_LABEL] = gemv_cost(by_label, costs, called & fp8)
    ops = []
    for label, measured in sorted(by_label.items(), key=lambda item: -item[1]["us"]):
        num_bytes, flops = costs.get(label, (None, None))
        us = measured["us"]
        op: dict[str, Any] = {"op": label, "us": round(us, 2), "kernels": int(measured["kernels"])}
        if num_bytes is not None and us > 0:
            op.update(bytes=int(num_bytes), flops=int(flops), gbps=round(num_bytes / (us * 1e-6) / 1e9, 1),
                      floor_us=round(num_bytes / (ceilings["copy_gbps"] * 1e9) * 1e6, 2))  # fmt: skip
            op["copy_share"] = round(op["gbps"] / ceilings["copy_gbps"], 3)
            if flops:
                op["tflops"] = round(flops / (us * 1e-6) / 1e12, 2)
                op["gemm_share"] = round(op["tflops"] / ceilings["bf16_tflops"], 3)
        ops.append(op)
    row["ops"] = ops
    row["kernels"] = kernels
    row["kernels_us"] = round(sum(op["us"] for op in ops), 1)
    row["num_kernels"] = int(sum(op["kernels"] for op in ops))
    floor_bytes = sum(c[0] for label, c in costs.items() if label in {o["op"] for o in ops})
    row["floor_ms"] = round(floor_bytes / (ceilings["copy_gbps"] * 1e9) * 1e3, 3)


# ----------------------------------------------------------------------------------------------------------------
# Runs, tables, record


def _print_ops(shape: str, variant: str, row: dict[str, Any]) -> None:
    timing = f"graph {row['graph_ms']:.3f} ms" if "graph_ms" in row else f"eager {row.get('eager_ms', 0):.1f} ms"
    print(f"\n{shape} [{variant}] B={row['batch']}: {timing}, "
          f"{row['num_kernels']} kernels, {row['kernels_us'] / 1e3:.3f} ms of kernel time (eager profile), "
          f"floor {row['floor_ms']:.3f} ms")  # fmt: skip
    print(
        f"  {'op':<30} {'n':>4} {'us':>9} {'floor_us':>9} {'MB':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%mm':>5}"
    )
    for op in row["ops"]:
        mb = op.get("bytes", 0) / 1e6
        print(f"  {op['op']:<30} {op['kernels']:>4} {op['us']:>9.1f} {op.get('floor_us', 0):>9.1f} {mb:>9.2f} "
              f"{op.get('gbps', 0):>7.0f} {100 * op.get('copy_share', 0):>5.0f}% {op.get('tflops', 0):>8.2f} "
              f"{100 * op.get('gemm_share', 0):>4.0f}%")  # fmt: skip


def cliffs(rows: list[dict[str, Any]], key: str = "graph_ms") -> list[str]:
    """Batch sizes whose step is more than CLIFF_TOLERANCE faster than a smaller batch's (time must not fall)."""
    found = []
    for i, row in enumerate(rows):
        for earlier in rows[:i]:
            if key in row and key in earlier and row[key] < earlier[key] * (1 - CLIFF_TOLERANCE):
                found.append(f"B={earlier['batch']} {earlier[key]:.2f} ms > B={row['batch']} {row[key]:.2f} ms")
    return found


# Every feature a variant may combine with +: `nopdl` runs with DELTASERVE_PDL=0 (plain launches instead of
# programmatic dependent launch). The engine's own settings only: nothing in the model is patched.
FEATURES = {"model", "nopdl"}


@contextlib.contextmanager
def variant_context(features: set[str], args: argparse.Namespace) -> Iterator[None]:
    """The engine's settings as the variant's features make them, for the block."""
    from deltaserve import env

    with env.overridden("DELTASERVE_PDL", "0" if "nopdl" in features else "1"):
        yield


def variant_features(variant: str, config: Any) -> set[str]:
    """A variant's features as variant_context takes them: `model` adds none."""
    return set(variant.split("+")) - {"model"}


def run_shape(
    shape: str, variants: list[str], args: argparse.Namespace, ceilings: dict[str, float], save: Callable[[], None],
    record: dict[str, Any], phase: str,
) -> None:  # fmt: skip
    """One shape's variants at every batch size: phase "time" adds a run entry per variant with the timed rows,
    phase "profile" adds the per-op profile to those rows. main runs every shape's timing before any profile:
    once torch.profiler has run, CUPTI stays attached for the life of the process (torch keeps CUPTI teardown off
    with CUDA graphs) and every later graph replay paid ~0.2-0.3 ms a step more at B = 1 on both shapes (a variant
    timed after another's profile read 2.9-3.0 ms against 2.68-2.73 timed first; docs/kernels-log.md)."""
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",") if b]
    model_dir = args.models / SHAPES.get(shape, shape)
    started = time.perf_counter()
    config, model = build_model(model_dir, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    cache = bind_cache(model, config, max(batches), args.context, args.max_model_len, args.block_size)
    print(f"{shape}: model and cache ready in {time.perf_counter() - started:.1f} s ({phase})", flush=True)
    if phase == "time" and args.is_warmup_pass and variants:
        # The variant timed first in a process read up to 0.14 ms slower at B = 1 than the same code timed later
        # (cause unknown; it is not CUPTI, nothing has profiled yet; docs/kernels-log.md). The first variant's
        # batches are timed once and dropped, so every recorded variant is timed after a full timing pass.
        with variant_context(variant_features(variants[0], config), args):
            for batch in batches:
                try:
                    time_batch(model, config, cache, batch, args)
                except Exception as exc:  # the recorded pass reports it
                    print(f"{shape} warm-up B={batch}: {type(exc).__name__}: {exc}"[:300], flush=True)
        print(f"{shape}: warm-up pass done (not recorded)", flush=True)
    done: set[str] = set()
    for variant in variants:
        features = variant_features(variant, config)
        variant = "+".join(sorted(features)) or "model"
        if variant in done:
            continue
        done.add(variant)
        if phase == "time":
            entry: dict[str, Any] = {"shape": shape, "variant": variant, "rows": []}
            # what the ops' bytes count for each projection's weight (model_weight_bytes), and whether it is block FP8
            entry.update(is_fp8=getattr(config, "fp8", None) is not None, weight_bytes=model_weight_bytes(model))
            if entry["is_fp8"]:
                entry["note"] = FP8_NOTE
            record["runs"].append(entry)
        else:
            entry = next(r for r in record["runs"] if r["shape"] == shape and r["variant"] == variant)
            if entry.get("note"):
                print(f"{shape} [{variant}]: {entry['note']}", flush=True)
        with variant_context(features, args):
            for index, batch in enumerate(batches):
                try:
                    if phase == "time":
                        entry["rows"].append(time_batch(model, config, cache, batch, args))
                    elif "error" not in entry["rows"][index]:
                        profile_batch(model, config, cache, entry["rows"][index], args, ceilings)
                        _print_ops(shape, variant, entry["rows"][index])
                except Exception as exc:  # one failed batch size is a finding; the rest still run
                    error = f"{type(exc).__name__}: {exc}"[:500]
                    if phase == "time":
                        entry["rows"].append({"batch": batch, "error": error})
                    else:
                        entry["rows"][index]["profile_error"] = error
                    record["errors"].append(f"{shape} {variant} B={batch} ({phase}): {error}")
                    print(f"{shape} [{variant}] B={batch}: FAILED ({phase}) {error}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                save()
        if phase == "time":
            entry["cliffs"] = cliffs(
                [r for r in entry["rows"] if "error" not in r], "graph_ms" if device.type == "cuda" else "eager_ms"
            )
            timed = [
                f"B={r['batch']} {r.get('graph_ms', r.get('eager_ms', 0)):.3f}"
                for r in entry["rows"]
                if "error" not in r
            ]
            print(f"{shape} [{variant}] timed: {', '.join(timed)}", flush=True)
    del model, cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# A block-FP8 run's note in the record and the summary: what its bytes count, and which rate its %mm is against.
FP8_NOTE = ("block-FP8 weights: bytes count 1 per FP8 element plus its fp32 block scales, the unquantized weights "
            "(lm_head, router, in_proj_ba, shared_expert_gate) at their dtype; %mm (gemm_share) is against the bf16 "
            "GEMM rate: the FP8 GEMM rate is not measured")  # fmt: skip


def summary(record: dict[str, Any]) -> str:
    key = "graph_ms" if record.get("device") == "cuda" else "eager_ms"
    lines = []
    runs = [("after", r) for r in record["runs"]] + [("before", r) for r in record.get("before", {}).get("runs", [])]
    batches = sorted({row["batch"] for _, run in runs for row in run["rows"]})
    width = max([10, *(len(run["shape"]) for _, run in runs)])
    header = f"{'shape':<{width}} {'run':<7} {'variant':<12} " + " ".join(f"{b:>7}" for b in batches)
    lines.append(f"decode step {key} by batch size (context {record['context']} tokens per sequence)")
    lines.append(header)
    for half, run in runs:
        by_batch = {row["batch"]: row for row in run["rows"]}
        cells = []
        for b in batches:
            row = by_batch.get(b, {})
            cells.append(f"{row[key]:>7.2f}" if key in row else f"{'err' if 'error' in row else '-':>7}")
        lines.append(f"{run['shape']:<{width}} {half:<7} {run['variant']:<12} " + " ".join(cells))
    for half, run in runs:
        if run.get("note"):
            lines.append(f"NOTE {run['shape']} {half} {run['variant']}: {run['note']}")
    for half, run in runs:
        if run.get("cliffs"):
            lines.append(f"CLIFF {run['shape']} {half} {run['variant']}: " + "; ".join(run["cliffs"][:6]))
    current = [run for half, run in runs if half == "after"]
    measured = [row for run in current for row in run["rows"] if key in row]
    if not measured:
        lines.append("no batch size was measured in the current runs: nothing to check for cliffs")
    else:
        ok = not any(run.get("cliffs") for run in current)
        lines.append(f"no cliffs (time non-decreasing in B within {CLIFF_TOLERANCE:.0%}) in the current runs: "
                     f"{'yes' if ok else 'NO'} ({len(measured)} batch sizes measured)")  # fmt: skip
    return "\n".join(lines)


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """This script against another deltaserve tree (PYTHONPATH=DIR), `model` variant, no tuning."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--models", str(args.models), "--shapes", args.shapes,
                   "--batches", args.batches, "--context", str(args.context), "--replays", str(args.replays),
                   "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
                   "--variants", "model", "--out", str(out), "--label", "before", "--device", args.device]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).resolve())}
        print(f"baseline: {shlex.join(command)} (PYTHONPATH={env['PYTHONPATH']})", flush=True)
        done = subprocess.run(command, env=env, timeout=args.baseline_timeout_s)
        if not out.is_file():
            return {"error": f"the baseline run wrote no record (exit {done.returncode})", "runs": []}
        before = json.loads(out.read_text())
        before["exit_code"] = done.returncode
        return before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("/tmp/ds_models"), help="make_dummy_models.py's folder")
    parser.add_argument("--shapes", default="35b-a3b,27b", help=f"comma list of {', '.join(SHAPES)} or folder names")
    parser.add_argument("--batches", default=DEFAULT_BATCHES)
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    parser.add_argument("--max-model-len", type=int, default=4096, help="block-table width (as the engine's)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument(
        "--warmup-pass",
        dest="is_warmup_pass",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the first variant's batches once, unrecorded, before the recorded passes (default: on the GPU)",
    )
    parser.add_argument(
        "--variants",
        default="model",
        help="comma list: model (as committed), nopdl (DELTASERVE_PDL=0: plain launches)",
    )
    parser.add_argument("--tune", action="store_true", help="tune the 35B-A3B MoE table first and install it")
    parser.add_argument("--tune-budget-s", type=float, default=150.0)
    parser.add_argument("--moe-table", type=Path, default=None, help="install this MoE table (a tune_moe.py output)")
    parser.add_argument("--baseline", type=Path, default=None, help="another deltaserve tree: the `before` run")
    parser.add_argument("--baseline-timeout-s", type=float, default=420.0)
    parser.add_argument("--no-current", action="store_true", help="only the baseline run")
    parser.add_argument("--label", default="after")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: see the module docstring)")
    args = parser.parse_args()
    args.out = args.out or default_out("decode-step")
    if args.is_warmup_pass is None:
        args.is_warmup_pass = args.device == "cuda"
    unknown = {f for v in args.variants.split(",") if v for f in v.split("+")} - FEATURES
    if unknown:
        print(f"decode_step: unknown variant features {sorted(unknown)}; known: {sorted(FEATURES)}")
        return 2
    if args.device == "cuda" and (not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        print("decode_step: no CUDA device: nothing to measure (--device cpu checks the plumbing)", file=sys.stderr)
        return 2
    from deltaserve.bench.provenance import git_state

    git = git_state(ROOT)
    record: dict[str, Any] = {
        "kind": "decode_step", "label": args.label, "command": "python3 " + shlex.join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": git.get("commit"),
        "deltaserve": str(Path(sys.modules["deltaserve"].__file__).parent), "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
        "context": args.context, "max_model_len": args.max_model_len, "block_size": args.block_size,
        "runs": [], "errors": [], "is_warmup_pass": args.is_warmup_pass,
    }  # fmt: skip
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")

    if args.device == "cuda":
        record["ceilings"] = measure_ceilings()
        print(f"ceilings: copy {record['ceilings']['copy_gbps']:.0f} GB/s, bf16 GEMM "
              f"{record['ceilings']['bf16_tflops']:.0f} TFLOP/s", flush=True)  # fmt: skip
    else:
        record["ceilings"] = {"copy_gbps": 100.0, "bf16_tflops": 1.0}  # placeholders: the CPU run checks plumbing
    save()
    if not args.no_current:
        if args.tune:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import tune_moe

            started = time.perf_counter()
            table = tune_moe.tune("35b-a3b", tune_moe.DEFAULT_BUCKETS, args.tune_budget_s, 10, print)
            path = args.out.parent / "moe-table.json"
            path.write_text(json.dumps(table, indent=2) + "\n")
            record["tuning"] = {"table": str(path), "file": table["file"], "s": round(time.perf_counter() - started, 1)}
            args.moe_table = path
            save()
        if args.moe_table is not None:
            from deltaserve.kernels import moe_configs

            moe_configs.install_table(json.loads(args.moe_table.read_text()), str(args.moe_table))
            record["moe_table"] = str(args.moe_table)
        variants = [v for v in args.variants.split(",") if v]
        shapes = [s for s in args.shapes.split(",") if s]
        for phase in ("time", "profile"):  # every graph timed before the process's first profiler session
            for shape in shapes:
                run_shape(shape, variants, args, record["ceilings"], save, record, phase)
    if args.baseline is not None:
        record["before"] = run_baseline(args)
        save()
    text = summary(record)
    record["summary"] = text
    save()
    print("\n" + text)
    return 1 if record["errors"] or record.get("before", {}).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
