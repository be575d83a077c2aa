"""vLLM as the token gate's in-process reference (`deltaserve gate tokens --reference vllm`, on the H200).

The oracle is built only by the registry (`registry.vllm_engine` + `registry.build_vllm_llm`: production
configuration, the site's named deviations, raw logits per step). The gate runs it greedily with the top
LOGPROBS_TOP_K raw logits per step (vLLM's default max_logprobs; a margin to a token outside them is a lower
bound), then shuts it down so deltaserve can take the GPU. The record states the configuration vLLM itself
reports: the resolved VllmConfig fields that decide the numerics, and, read from the model in the engine
process through `LLM.apply_model`, each attention layer's `use_fused_qk_norm_rope_gate` (vLLM 0.26
`Qwen3NextAttention.__init__`: attn_output_gate and neox RoPE and CUDA and text_only, where text_only = no
multimodal config or language_model_only) and each GDN layer's `gdn_prefill_backend`.

With `speculative_config` the oracle is vLLM's MTP arm (`deltaserve gate mtp --reference vllm`): it then also reads
vLLM's spec-decode counters after the run through its offline metrics API (`LLM.get_metrics()`: Counter objects
for vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens, a Vector for
vllm:spec_decode_num_accepted_tokens_per_pos, one per label set, summed here) into `ReferenceRun.config
["spec_decode"]`.

vLLM is imported only inside these functions, so the module imports (and its CPU tests run) without it.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from deltaserve.bench import registry
from deltaserve.gates.references import ReferenceError, ReferenceRun, StepScores

# vLLM's default max_logprobs: asking for more would need a non-default engine setting.
LOGPROBS_TOP_K = 20
# Per layer class: the attribute that states the decision vLLM made at construction.
LAYER_FACTS = {
    "use_fused_qk_norm_rope_gate": "fused QK-norm + RoPE + gate preamble (Qwen3NextAttention)",
    "gdn_prefill_backend": "GDN prefill kernel (QwenGatedDeltaNetAttention)",
}


def model_layer_facts(model: Any) -> dict[str, Any]:
    """Runs inside vLLM's engine process (LLM.apply_model): the decisions each layer recorded, by attribute."""
    facts: dict[str, Any] = {"model_class": type(model).__name__}
    for attribute in LAYER_FACTS:
        values: dict[str, int] = {}
        for _, module in model.named_modules():
            if hasattr(module, attribute):
                key = str(getattr(module, attribute))
                values[key] = values.get(key, 0) + 1
        facts[attribute] = values  # value -> number of layers
    return facts


def _get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _plain(value: Any) -> Any:
    """A JSON-friendly form of a config value (enums by name, dtypes as text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return getattr(value, "name", None) or str(value)


# (record key, VllmConfig attribute path): the resolved settings that decide the oracle's numerics.
CONFIG_FIELDS = (
    ("dtype", "model_config.dtype"),
    ("max_model_len", "model_config.max_model_len"),
    ("enforce_eager", "model_config.enforce_eager"),
    ("logprobs_mode", "model_config.logprobs_mode"),
    ("language_model_only", "model_config.multimodal_config.language_model_only"),
    ("mamba_ssm_cache_dtype", "cache_config.mamba_ssm_cache_dtype"),
    ("kv_cache_dtype", "cache_config.cache_dtype"),
    ("enable_prefix_caching", "cache_config.enable_prefix_caching"),
    ("max_num_batched_tokens", "scheduler_config.max_num_batched_tokens"),
    ("max_num_seqs", "scheduler_config.max_num_seqs"),
    ("async_scheduling", "scheduler_config.async_scheduling"),
    ("compilation_mode", "compilation_config.mode"),
    ("cudagraph_mode", "compilation_config.cudagraph_mode"),
    ("cudagraph_capture_sizes", "compilation_config.cudagraph_capture_sizes"),
    ("attention_backend", "attention_config.backend"),
    ("additional_config", "additional_config"),
)


def effective_config(llm: Any) -> dict[str, Any]:
    """The oracle's configuration as vLLM reports it: resolved config fields and the layers' own decisions."""
    import vllm

    vllm_config = _get(llm, "llm_engine.vllm_config")
    facts: dict[str, Any] = {"engine": "vllm", "version": vllm.__version__}
    for key, path in CONFIG_FIELDS:
        facts[key] = _plain(_get(vllm_config, path)) if vllm_config is not None else None
    facts["has_multimodal_config"] = _get(vllm_config, "model_config.multimodal_config") is not None
    try:
        per_worker = llm.apply_model(model_layer_facts)
        facts["layers"] = per_worker[0] if per_worker else None
    except Exception as exc:
        facts["layers"] = {"error": f"{type(exc).__name__}: {exc}"}
    layers = facts.get("layers") or {}
    fused = layers.get("use_fused_qk_norm_rope_gate") or {}
    if not fused:
        facts["is_fused_preamble"] = None
    elif set(fused) == {"True"}:
        facts["is_fused_preamble"] = True
    else:
        facts["is_fused_preamble"] = False if "True" not in fused else "mixed"
    backends = layers.get("gdn_prefill_backend") or {}
    facts["gdn_prefill_kernel"] = next(iter(backends)) if len(backends) == 1 else (backends or None)
    return facts


# vLLM's spec-decode series (vllm/v1/spec_decode/metrics.py) -> the field of spec_decode_counts they fill
SPEC_DECODE_SERIES = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


def spec_decode_counts(metrics: list[Any]) -> dict[str, Any]:
    """LLM.get_metrics()'s spec-decode series as plain counts, summed over label sets (one per engine under data
    parallelism); refused when vLLM reported none of them (speculation off, or stat logging off)."""
    counts: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    seen = set()
    for metric in metrics:
        field_name = SPEC_DECODE_SERIES.get(getattr(metric, "name", None))
        if field_name is None:
            continue
        seen.add(field_name)
        if field_name == "accepted_per_pos":
            total = counts["accepted_per_pos"]
            total += [0] * (len(metric.values) - len(total))
            for position, value in enumerate(metric.values):
                total[position] += int(value)
        else:
            counts[field_name] += int(metric.value)
    if not seen:
        raise ReferenceError(
            "vLLM reported no vllm:spec_decode_* series through LLM.get_metrics(): speculative decoding did not run "
            "or stat logging is off"
        )
    return counts


def _shutdown(llm: Any) -> None:
    """Stop the engine process and free its GPU memory before deltaserve starts."""
    core = _get(llm, "llm_engine.engine_core")
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


class VllmReference:
    """vLLM, in process, in the registry's production configuration."""

    kind = "vllm"

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        max_prompt_len: int,
        seed: int,
        site: str,
        serves_media: bool = False,
        shares_gpu: bool = False,
        speculative_config: dict[str, Any] | None = None,
    ) -> None:
        self.engine = registry.vllm_engine(
            str(model_dir), max_prompt_len, dtype=dtype, site=site, seed=seed, serves_media=serves_media,
            shares_gpu=shares_gpu, speculative_config=speculative_config,
        )  # fmt: skip
        self.dtype = dtype
        self.is_speculative = speculative_config is not None

    def run(
        self, prompts: list[list[int]] | list[dict[str, Any]], max_tokens: int, logprobs: int | None = LOGPROBS_TOP_K
    ) -> ReferenceRun:
        """Token-id prompts, or vLLM prompt dicts ({"prompt": ..., "multi_modal_data": ...}) as they are. `logprobs`
        None: no per-step logits (each prompt's scores are an empty list, so no margin can be measured)."""
        engine = self.engine
        try:
            from vllm import SamplingParams
        except ImportError as exc:
            raise ReferenceError(
                f"vLLM is not importable ({exc}); on the H200 unpack the bundle first (benchmarks/oracle/unpack.sh)"
            ) from exc
        llm = registry.build_vllm_llm(engine)
        try:
            config = effective_config(llm)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
            inputs = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
            outputs = llm.generate(inputs, params, use_tqdm=False)
            if self.is_speculative:
                config["spec_decode"] = spec_decode_counts(llm.get_metrics())
        finally:
            _shutdown(llm)
        tokens, scores = [], []
        for output in outputs:
            completion = output.outputs[0]
            tokens.append(list(completion.token_ids))
            # logprobs_mode=raw_logits: each entry's `logprob` is the raw logit.
            steps = completion.logprobs or []
            scores.append([StepScores({t: float(lp.logprob) for t, lp in step.items()}, False) for step in steps])
        config["registry"] = {
            "kwargs": {k: _plain(v) for k, v in engine.kwargs.items()},
            "env": engine.env,
            "reasons": engine.reasons,
            "deviations": engine.deviations,
            "denominator_note": engine.denominator_note,
        }
        return ReferenceRun(tokens, scores, config)
