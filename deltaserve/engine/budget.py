"""The default step token budget (--max-num-batched-tokens when not given): from the weights one token reads.

A step's prefill tokens all finish together, so a larger budget delays the median first token of a burst of prompts,
and a smaller one spreads prefill over more steps that each also carry the running decodes. Measured on the H200
(benchmarks/results/grids/h200_budget-27b-20261202.json with benchmarks/results/grids/h200_core2-27b-20261202.json,
the 27B shape, 1024-token prompts, c8 / c32): output throughput equal within 1 % at budgets 8192, 4096 and 2048,
TTFT median 731.6 / 1754.1 ms at 8192, 625.6 / 1074.2 at 4096, 419.5 / 620.3 at 2048 (vLLM 0.26 at its production
2048: 414.6 / 572.8); the 35B-A3B shape at 8192 has TTFT below vLLM's at c1-c32
(benchmarks/results/grids/h200_core2-35b-a3b-20261202.json). What sets the cost of a prefill step is the matrix work
per token, about twice the parameters each token reads (attention over the prompt is small at these lengths), so the
budget keeps that work near the measured 27B point: STEP_PARAM_TOKENS parameter-tokens, rounded to a power of two
in [MIN_TOKENS, MAX_TOKENS]. 27B (24.3 G parameters a token): 2048; 35B-A3B (2.44 G: top-8 of 256 experts plus the
shared one): 8192. On the CPU, MIN_TOKENS.

That trade exists only where a step has other work. A step whose only work is one prompt's prefill (nothing
decoding, nothing else waiting: one long prompt alone, the c1 points of the long-prompt grid) delays nobody, and on the
27B its 2,048-token chunks cost it: the dense GEMMs run at 81-89 % of the bf16 rate at 2,048 rows, and eight GDN
prefill calls of 2,048 tokens take ~60 % longer than two of 8,192 (docs/kernels.md, "Measured: the GDN prefill side
by side"). Such a step may take LONE_PREFILL_TOKENS where the budget is the default (`step_budgets`).
"""

from __future__ import annotations

import math

from deltaserve.config import ModelConfig

STEP_PARAM_TOKENS = 2048 * 24.3e9  # the 27B shape at 2048 tokens: where the budget grid put TTFT level with vLLM's
MIN_TOKENS = 2048
MAX_TOKENS = 8192
# a step that prefills one prompt alone (engine_config.lone_prefill_tokens): vLLM 0.26's own default step budget on
# GPUs of >= 70 GiB, and the 35B-A3B's default here
LONE_PREFILL_TOKENS = 8192


def active_params_per_token(config: ModelConfig) -> float:
    """Weights one token multiplies through, embeddings and lm_head excluded: every layer's projections, and of an
    MoE layer the router, num_experts_per_tok routed experts and the shared expert."""
    h = config.hidden_size
    gdn = (config.conv_dim + config.value_dim + 2 * config.linear_num_value_heads) * h + config.value_dim * h
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    attention = (2 * q_width + 2 * kv_width) * h + q_width * h  # q and its gate, k, v; o
    dense_mlp = 3 * h * config.intermediate_size
    moe_mlp = (
        config.num_experts * h
        + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
        + 3 * h * config.shared_expert_intermediate_size
        + h
    )
    moe_layers = config.moe_layers or (config.is_moe,) * config.num_hidden_layers
    total = 0.0
    for kind, is_moe in zip(config.layer_types, moe_layers, strict=True):
        total += attention if kind == "full_attention" else gdn
        total += moe_mlp if is_moe else dense_mlp
    return total


def default_max_num_batched_tokens(config: ModelConfig, on_gpu: bool) -> int:
    if not on_gpu:
        return MIN_TOKENS
    tokens = STEP_PARAM_TOKENS / max(active_params_per_token(config), 1.0)
    return int(min(MAX_TOKENS, max(MIN_TOKENS, 2 ** round(math.log2(tokens)))))


def step_budgets(
    config: ModelConfig,
    on_gpu: bool,
    max_num_batched_tokens: int | None,
    lone_prefill_tokens: int | None,
    max_model_len: int,
) -> tuple[int, int]:
    """(the step token budget, the budget of a step whose only work is one prompt's prefill) from the engine
    config's two fields (None: not given). A given --max-num-batched-tokens is a hard cap for every step, as in
    vLLM, unless --lone-prefill-tokens is given too; 0 turns the lone budget off. A lone step holds one sequence's
    chunk, so its budget stops at max_model_len (the runner's warm-up sizes no larger step), never below the step
    budget."""
    budget = max_num_batched_tokens or default_max_num_batched_tokens(config, on_gpu)
    if lone_prefill_tokens is None:
        is_default = max_num_batched_tokens is None and on_gpu
        lone = LONE_PREFILL_TOKENS if is_default else budget
    elif lone_prefill_tokens == 0:
        lone = budget
    elif lone_prefill_tokens < budget:
        raise ValueError(
            f"lone_prefill_tokens ({lone_prefill_tokens}) is below max_num_batched_tokens ({budget}): a step that "
            "prefills one prompt alone may take more tokens than the step budget, never fewer (0 turns it off)"
        )
    else:
        lone = lone_prefill_tokens
    return budget, max(budget, min(lone, max_model_len))
