"""`deltaserve gate tokens --media KIND`: greedy token-exactness on image, multi-image and video prompts.

The prompts are tiny/media_prompts.py's fixed synthetic sets (KIND image, multi-image, video, or all three). deltaserve
gets each as vLLM spells it, `LLM.generate({"prompt": chat text, "multi_modal_data": ...})`, so its own
processor expands the placeholders and its engine runs the vision tower, the embedding replacement and the 3-D
MRoPE table through the fused preamble. The reference:
- transformers: the checkpoint's composite `config.architectures[0]` (*ForConditionalGeneration), fed the
  pixel_values / grids / mm_token_type_ids of deltaserve's processor (itself proven equal to transformers'
  Qwen3-VL processors in tests/multimodal), computing its own vision embeddings and its own get_rope_index;
- vllm (on the H200): `vllm.LLM` from the registry with `serves_media` (the vision tower kept: no
  language_model_only), given the same prompt dicts.
The verdict is tokens.py's: STRICT n/N first, then every mismatch with the reference's margin, the logit check
(full forward with the media, against the reference's), and prefill-then-decode against one forward with the
chunk boundary inside the first item's pad run (an image straddling two chunks). Added here: the gate's
processor and LLM.generate expand each prompt to the same ids, and the four-op check: with
DELTASERVE_FUSE_ATTN_PREAMBLE=0, LLM.generate and the model itself must refuse a media prompt with an error
naming the variable, and the engine must serve the prompt again afterwards. Run with that variable already 0,
the gate checks the refusal only. Exit 0 pass, 1 fail or refused reference, 2 nothing to check (no prompts, or
a checkpoint without a vision tower).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from deltaserve import env
from deltaserve.bench.deviations import GATE_SITE
from deltaserve.gates import tokens
from deltaserve.gates.references import (
    ReferenceError,
    ReferenceRun,
    StepScores,
    TransformersReference,
    cache_argument,
    cache_of,
)
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.tiny.media_prompts import (
    MediaRefusedError,
    ProcessedPrompt,
    make_media_prompts,
    media_kinds,
    process_prompts,
    reference_inputs,
)

FOUR_OP_VARIABLE = "DELTASERVE_FUSE_ATTN_PREAMBLE"


class MediaTransformersReference(TransformersReference):
    """The composite transformers class, given each prompt's pixel values and grids on its prefill."""

    def __init__(self, model_dir: Path, dtype: str, device: str) -> None:
        super().__init__(model_dir, dtype, device)
        config = self.model.config
        self.token_ids = (config.image_token_id, config.video_token_id)
        self._media: MultimodalInput | None = None

    def inputs(self, sequence: list[int], mm_input: MultimodalInput) -> dict[str, torch.Tensor]:
        kwargs = reference_inputs(sequence, mm_input, *self.token_ids)
        return {k: v.to(self.device) for k, v in kwargs.items()}

    def _walk(
        self, ids: list[int], mm_input: MultimodalInput, num_steps: int, forced: list[int] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        """transformers' own prefill (vision tower, get_rope_index) and cached one-token decode loop: the
        prompt's logits [P, V], each step's logits row [V], and the tokens fed (argmax, or `forced`)."""
        out = self.model(**self.inputs(ids, mm_input), use_cache=True)
        prefill = out.logits[0]
        rows, tokens = [], []
        for step in range(num_steps):
            logits = out.logits[0, -1]
            rows.append(logits)
            # torch.argmax returns the first maximal index, as vLLM's greedy sampler does.
            tokens.append(forced[step] if forced is not None else int(torch.argmax(logits.float())))
            if step == num_steps - 1 and forced is None:
                break
            # decode steps carry no media: the model continues from its cached rope deltas
            cache = {cache_argument(self.model): cache_of(out)}
            out = self.model(input_ids=torch.tensor([[tokens[-1]]], device=self.device), use_cache=True, **cache)
        if forced is not None:
            rows.append(out.logits[0, -1])
        return prefill, rows, tokens

    @torch.inference_mode()
    def run_media(self, processed: list[ProcessedPrompt], max_tokens: int) -> ReferenceRun:
        """Greedy tokens and each step's logits, in the model's dtype."""
        all_tokens, all_scores = [], []
        for item in processed:
            _, rows, tokens = self._walk(item.ids, item.mm_input, max_tokens)
            all_tokens.append(tokens)
            all_scores.append([StepScores.from_row(row) for row in rows])
        return ReferenceRun(all_tokens, all_scores, dict(self.facts))

    @torch.inference_mode()
    def full_logits(self, sequence: list[int], mm_input: MultimodalInput | None = None) -> torch.Tensor:
        """Logits [L, V] (fp32 copy) of prompt + continuation: the prompt in one prefill with its media, then the
        continuation fed one token at a time (one forward over all of it would count a generated
        placeholder token as an image slot)."""
        media = mm_input or self._media
        if media is None:
            return super().full_logits(sequence)
        prompt_len = media.prompt_len
        prefill, rows, _ = self._walk(sequence[:prompt_len], media, len(sequence) - prompt_len,
                                      forced=sequence[prompt_len:])  # fmt: skip
        return torch.cat([prefill[:-1], *(row[None] for row in rows)]).float().cpu() if rows else prefill.float().cpu()

    def media_weight_floor(self, mm_input: MultimodalInput, sequence: list[int], relative: float) -> float:
        """The reference's own change under one rounding of every weight (weight_floor), with the prompt's media."""
        self._media = mm_input
        try:
            return self.weight_floor(sequence, relative)
        finally:
            self._media = None

    def media_noise_floor(self, mm_input: MultimodalInput, ids: list[int], relative: float, seed: int) -> float:
        """The rounding noise floor (TransformersReference.noise_floor) measured on the prompt's prefill."""
        self._media = mm_input
        try:
            return self.noise_floor(ids, relative, seed)
        finally:
            self._media = None


def split_point(item: ProcessedPrompt) -> int:
    """Inside the first item's first pad run: the prefill chunk boundary that cuts an image or video in two."""
    first, count = item.mm_input.items[0].embed_runs[0]
    return min(first + max(count // 2, 1), len(item.ids) - 1) if len(item.ids) > 1 else 1


def run_media_gate(
    model_dir: Path,
    media: str,
    reference: str = "transformers",
    num_prompts: int = 32,
    max_tokens: int = 32,
    dtype: str = "float32",
    device: str = "auto",
    seed: int = 0,
    site: str = GATE_SITE,
    record_path: Path | None = None,
    reference_cache: Path | None = None,
    tensor_parallel_size: int = 1,
    share_gpu: bool = False,
    is_reference_only: bool = False,
) -> int:
    from transformers import AutoTokenizer

    from deltaserve.config import ModelConfig

    model_dir = Path(model_dir)
    if num_prompts < 1 or max_tokens < 1:
        print("gate tokens: nothing to check (num_prompts and max_tokens must be positive)")
        return 2
    model_config = ModelConfig.from_pretrained(model_dir)
    if model_config.vision is None:
        print(f"gate tokens: nothing to check: {model_dir} has no vision tower (no vision_config), so --media "
              f"{media} has no prompts it can serve")  # fmt: skip
        return 2
    kinds = media_kinds(media)
    label = "/".join(kinds)
    run_device = tokens.gate_device(device)
    if run_device == "cpu":
        # the engine's own CPU rule (runner/device_setup.py set_cpu_threads), applied before the reference runs: one
        # thread for a tiny model
        threads = env.cpu_threads_for(model_config.hidden_size)
        if threads:
            torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [p for kind in kinds for p in make_media_prompts(tokenizer, kind, num_prompts, seed)]
    try:
        processed = process_prompts(model_dir, tokenizer, prompts)
    except MediaRefusedError as exc:
        print(f"gate tokens: nothing to check: deltaserve refuses {label} prompts on {model_dir}: {exc}")
        return 2
    if not env.fuse_attn_preamble():
        print(f"gate tokens: {FOUR_OP_VARIABLE}=0 selects the four-op preamble, which must refuse {label} "
              "prompts: checking that refusal only")  # fmt: skip
        from deltaserve import LLM

        llm = LLM(model_dir, dtype=dtype, device=run_device, seed=seed, tensor_parallel_size=tensor_parallel_size,
                  **tokens.engine_memory(share_gpu))  # fmt: skip
        is_ok, line = four_op_refusal(llm, processed[0], expected=None)
        print(line)
        if record_path is not None:
            record = {"schema": tokens.RECORD_SCHEMA, "kind": "gate-tokens-four-op-refusal", "model": str(model_dir),
                      "dtype": dtype, "media": list(kinds), "deltaserve": {"fuse_attn_preamble": False},
                      "output": [line], "exit_code": 0 if is_ok else 1}  # fmt: skip
            record_path.parent.mkdir(parents=True, exist_ok=True)
            record_path.write_text(json.dumps(record, indent=2) + "\n")
        return 0 if is_ok else 1
    try:
        ref, ref_run = _reference_run(model_dir, reference, dtype, run_device, seed, site, processed, max_tokens,
                                      kinds, reference_cache, share_gpu)  # fmt: skip
        if is_reference_only:
            return tokens.reference_saved(reference, model_dir, reference_cache, len(processed))
        rounding = ref if isinstance(ref, MediaTransformersReference) else MediaTransformersReference(
            model_dir, dtype, run_device
        )  # fmt: skip
        fp32_run = None
        if dtype != "float32":
            fp32_run = MediaTransformersReference(model_dir, "float32", run_device).run_media(processed, max_tokens)
    except ReferenceError as exc:
        print(f"gate tokens: REFUSED: {exc}")
        return 1
    llm, results, num_expanded, first = _compare(model_dir, dtype, run_device, seed, processed, max_tokens, ref,
                                                 ref_run, rounding, fp32_run, tensor_parallel_size,
                                                 share_gpu)  # fmt: skip
    report = tokens.GateReport()
    code = tokens.report_verdict(report, results, dtype, model_dir, reference, ref_run, label, tokenizer,
                                 tensor_parallel_size)  # fmt: skip
    kind_of = [p.prompt.kind for p in processed]
    counts = [(k, sum(r.is_exact for r, o in zip(results, kind_of, strict=True) if o == k), kind_of.count(k))
              for k in kinds]  # fmt: skip
    report.say("per kind: " + ", ".join(f"{kind} STRICT {n}/{total}" for kind, n, total in counts))
    is_expansion_ok = num_expanded == len(processed)
    report.say(
        f"prompt expansion: LLM.generate's prompt_token_ids equal the gate's processor's on "
        f"{num_expanded}/{len(processed)} prompts {'ok' if is_expansion_ok else 'FAIL'}"
    )
    is_refusal_ok, line = four_op_refusal(llm, processed[0], expected=first)
    report.say(line)
    llm.shutdown()
    code = code if is_expansion_ok and is_refusal_ok else 1
    if record_path is not None:
        tokens.write_record(record_path, report, results, code, model_dir, dtype, reference, ref_run,
                            f"media:{label}", seed)  # fmt: skip
    return code


def _reference_run(
    model_dir: Path,
    reference: str,
    dtype: str,
    device: str,
    seed: int,
    site: str,
    processed: list[ProcessedPrompt],
    max_tokens: int,
    kinds: tuple[str, ...],
    reference_cache: Path | None,
    share_gpu: bool = False,
) -> tuple[Any, ReferenceRun]:
    """The reference first (a refused one stops the gate before deltaserve runs; vLLM frees the GPU after)."""
    if reference == "transformers":
        ref: Any = MediaTransformersReference(model_dir, dtype, device)
    elif reference == "vllm":
        from deltaserve.gates.vllm_reference import VllmReference

        max_len = max(len(p.ids) for p in processed)
        ref = VllmReference(model_dir, dtype, max_len, seed, site, serves_media=True, shares_gpu=share_gpu)
    else:
        raise ValueError(f"unknown reference {reference!r}")
    # the prompts' identity: expanded ids and every item's content hash (pixels and processing settings)
    described = [[p.ids, [it.identifier for it in p.mm_input.items]] for p in processed]
    key = {"model": str(model_dir.resolve()), "dtype": dtype, "reference": reference, "site": site,
           "max_tokens": max_tokens, "media": list(kinds), "prompts": described}  # fmt: skip
    ref_run = tokens.cached_reference_run(reference_cache, key)
    if ref_run is None:
        if isinstance(ref, MediaTransformersReference):
            ref_run = ref.run_media(processed, max_tokens)
        else:
            ref_run = ref.run([p.prompt.vllm_prompt() for p in processed], max_tokens)
        tokens.save_reference_run(reference_cache, key, ref_run)
    return ref, ref_run


def _compare(
    model_dir: Path,
    dtype: str,
    device: str,
    seed: int,
    processed: list[ProcessedPrompt],
    max_tokens: int,
    ref: Any,
    ref_run: ReferenceRun,
    rounding: MediaTransformersReference,
    fp32_run: ReferenceRun | None,
    tensor_parallel_size: int = 1,
    share_gpu: bool = False,
) -> tuple[Any, list[tokens.PromptResult], int, list[int]]:
    """deltaserve through its offline API: LLM.generate with multi_modal_data, LLM.prefill_logits with the media."""
    from deltaserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=min(len(processed), 64), seed=seed,
              tensor_parallel_size=tensor_parallel_size, **tokens.engine_memory(share_gpu))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([p.prompt.vllm_prompt() for p in processed], params, use_tqdm=False)
    results, num_expanded = [], 0
    first_over: dict[int, int] = {}  # prompt -> its first position over the logit bound (transformers reference)
    for i, (item, output) in enumerate(zip(processed, outputs, strict=True)):
        num_expanded += list(output.prompt_token_ids) == item.ids
        ours = list(output.outputs[0].token_ids)
        ref_tokens, ref_scores = ref_run.tokens[i], ref_run.scores[i]
        result = tokens.PromptResult(i, len(item.ids), ours == ref_tokens)
        result.mismatch = tokens.judge_mismatch(ours, ref_tokens, ref_scores, dtype)
        if fp32_run is not None:
            result.is_ref_dtype_exact = ref_tokens == fp32_run.tokens[i]
            result.is_ours_vs_fp32_exact = ours == fp32_run.tokens[i]
        sequence = item.ids + ref_tokens
        full = llm.prefill_logits(sequence, mm_input=item.mm_input).cpu()
        if isinstance(ref, MediaTransformersReference):
            ref_full = ref.full_logits(sequence, item.mm_input)
            result.logit_rel_error = tokens.rel_error(full, ref_full)
            if result.logit_rel_error > tokens.LOGIT_TOLERANCE[dtype]:
                first_over[i] = tokens.first_position_over(full, ref_full, tokens.LOGIT_TOLERANCE[dtype])
        else:
            result.logit_rel_error = tokens.top_k_error(full, len(item.ids), ref_scores)
        boundary = split_point(item)
        split = llm.prefill_logits(sequence, [boundary, len(item.ids) - boundary], mm_input=item.mm_input).cpu()
        result.split_rel_error = tokens.rel_error(split, full)
        # measured over the prompt (one prefill each way): the continuation's decode loop would double the
        # reference's work for a floor estimate
        result.noise_floor = rounding.media_noise_floor(
            item.mm_input, item.ids, tokens.ROUNDING_PERTURBATION[dtype], seed + i
        )
        results.append(result)
    relative = tokens.ROUNDING_PERTURBATION[dtype]
    tokens.measure_weight_floors(results, dtype, lambda i: rounding.media_weight_floor(
        processed[i].mm_input, processed[i].ids + ref_run.tokens[i], relative))  # fmt: skip
    tokens.measure_router_ties(results, dtype, first_over, lambda i: rounding.routing_margins(
        **rounding.inputs(processed[i].ids, processed[i].mm_input)))  # fmt: skip
    return llm, results, num_expanded, list(outputs[0].outputs[0].token_ids)


def _names_variable(exc: BaseException) -> bool:
    return FOUR_OP_VARIABLE in str(exc)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:160]}"


def four_op_refusal(llm: Any, item: ProcessedPrompt, expected: list[int] | None) -> tuple[bool, str]:
    """With the four-op preamble selected, LLM.generate (the engine's up-front check) and LLM.prefill_logits (the
    model's own check in the preamble) must refuse a media prompt with a ValueError naming the variable, leaving
    nothing in the engine; afterwards, with the fused preamble back, the engine must serve the same prompt (to
    `expected`, its earlier tokens, when given)."""
    from deltaserve import SamplingParams
    from deltaserve.engine.frontend import RequestError

    head = f"four-op preamble ({FOUR_OP_VARIABLE}=0) on prompt 0 ({item.prompt.kind}):"
    num_tokens = len(expected) if expected else 2
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    problems, seen = [], []
    # the prompt's own checkpoints (the earlier run of it left its repeat point past the media) would let the model
    # resume after the 3-D positions and never meet them: the check is of the model's refusal, so nothing is cached
    llm.reset_prefix_cache()
    with env.overridden(FOUR_OP_VARIABLE, "0"):
        for name, call in (
            ("LLM.generate", lambda: llm.generate([item.prompt.vllm_prompt()], params, use_tqdm=False)),
            ("the model (LLM.prefill_logits)", lambda: llm.prefill_logits(item.ids, mm_input=item.mm_input)),
        ):
            try:
                call()
                problems.append(f"{name} served it (1-D RoPE on 3-D positions)")
            except ValueError as exc:
                seen.append(f"{name} refused it ({type(exc).__name__})")
                if name == "LLM.generate" and not isinstance(exc, RequestError):
                    # raised from inside a step: a server would lose its engine core, not answer a 400
                    problems.append(f"{name} raised it from a step, not the front end's up-front refusal")
                if not _names_variable(exc):
                    problems.append(f"{name}'s error does not name {FOUR_OP_VARIABLE}: {_short(exc)}")
            except Exception as exc:
                problems.append(f"{name} failed instead of refusing: {_short(exc)}")
            if llm.engine.has_unfinished():
                problems.append(f"a request refused by {name} stayed in the engine")
                break
    try:
        with env.overridden(FOUR_OP_VARIABLE, "1"):
            (again,) = llm.generate([item.prompt.vllm_prompt()], params, use_tqdm=False)
        served = list(again.outputs[0].token_ids)
        seen.append(f"then served it again with the fused preamble ({len(served)} tokens)")
        if expected is not None and served != expected:
            problems.append("the engine served the prompt differently after the refusals")
    except Exception as exc:
        problems.append(f"the engine could not serve the prompt after the refusals: {_short(exc)}")
    verdict = "ok" if not problems else "FAIL: " + "; ".join(problems)
    return not problems, f"{head} {', '.join(seen)} {verdict}"
