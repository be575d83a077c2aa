"""`deltaserve gate prefix-cache`: greedy tokens with the prefix cache on equal tokens with it off (issue 36).

Two engines on one checkpoint, the same dtype and device, `enable_prefix_caching` False then True, run the same
traffic in the same order: rounds of prompts, each round one `LLM.generate` call, so that a later round can hit
what an earlier one left in the cache. The traffic (spans of the shipped corpus' held-out text, which no trained
checkpoint saw, so the trained checkpoints' greedy tokens have margins that survive bf16):
- shared-prefix-L: a prefix of L tokens shared by five prompts with their own 20-40-token suffixes, sent one, one,
  then three at once (the second sighting leaves a checkpoint where the prefix ends, the later ones hit it); L =
  100 (mid-block), 128 (a block and 64-token chunk boundary), 144 (a block boundary inside a chunk) and 200;
- multi-turn: a conversation of three turns, each prompt the previous prompt + the previous answer (the cache-off
  engine's answer, so both engines see the same prompts) + a new user span: turn k + 1 hits turn k's history;
- retry: one prompt sent three times in a row; same-prompt-x3: one prompt three times in one call (what n > 1
  children share; greedy n > 1 is refused, as vLLM 0.26 refuses it).
Every prompt's completion is a check. The verdict starts with `STRICT n/N`, then every mismatch (scenario, round,
prompt, the first differing position, both tokens and both engines' top-2 logprob margins there), then the hit
rate: cached / prompt tokens of the cache-on engine (RequestOutput.num_cached_tokens). Outside fp32 it then prints
the yardstick: the cache-off engine against itself with its prefills cut into YARDSTICK_CHUNK-token chunks
(`max_num_batched_tokens`), no cache involved. A hit resumes a prefill from a saved state, so in bf16 the cache-on
engine rounds like a chunked prefill, not like one pass over the prompt: where the yardstick flips as many
near-tie tokens as the cache does, those flips are bf16 rounding, not a wrong state (a wrong state moves logits by
O(1), far past any margin). Exit 0 when every completion matches and the cache served at least one token; 1 on a
mismatch (the yardstick never turns a mismatch into a pass); 2 when nothing was checked or the cache never hit
(then nothing of the feature was exercised). `--record PATH` writes the verdict as JSON. On the H200: `--dtype
bfloat16 --device cuda` on the trained checkpoints (deltaserve/tiny/trained.py), the issue's bf16 STRICT run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deltaserve.gates.tokens import held_out_ids, save_record
from deltaserve.sampling_params import SamplingParams

RECORD_SCHEMA = "deltaserve-gate-prefix-cache/1"
SHARED_PREFIX_LENGTHS = (100, 128, 144, 200)
SUFFIX_LENGTHS = (20, 40)  # inclusive range of a shared-prefix prompt's own tokens
TURN_LENGTHS = (120, 30, 30)  # the first turn's prompt, then each later turn's new user span
YARDSTICK_CHUNK = 64  # the yardstick engine's step budget: its prefills run in chunks of this many tokens


@dataclass
class Round:
    """Prompts submitted together (one LLM.generate call), each completed greedily."""

    prompts: list[list[int]]


@dataclass
class Scenario:
    name: str
    rounds: list[Round]
    # multi-turn: each round's prompt is built from the previous prompt and the cache-off engine's answer
    turn_spans: list[list[int]] = field(default_factory=list)


@dataclass
class Mismatch:
    scenario: str
    round: int
    prompt: int
    position: int  # first output position where the tokens differ (or the shorter length)
    off_token: int | None
    on_token: int | None
    # each engine's top-1 minus top-2 logprob at that position: a near-tie (a small margin on both sides) is a
    # rounding flip of a resumed state, a large one a wrong state
    off_margin: float | None = None
    on_margin: float | None = None


@dataclass
class Yardstick:
    """The cache-off engine against itself with chunked prefills (module docstring): bf16's own rounding flips."""

    chunk: int  # the chunked engine's max_num_batched_tokens
    num_checked: int
    num_matched: int
    mismatches: list[Mismatch]  # off_* is the unchunked engine, on_* the chunked one


@dataclass
class GateVerdict:
    num_checked: int
    num_matched: int
    prompt_tokens: int
    cached_tokens: int
    mismatches: list[Mismatch]
    config: dict[str, Any]
    hits_by_scenario: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (cached, prompt tokens)
    yardstick: Yardstick | None = None  # None: not run (fp32, where the cache must be exact, or --yardstick off)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder (the trained tiny checkpoints: see above)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="both engines' step budget (small: chunked prefill)"
    )
    parser.add_argument("--no-async-scheduling", action="store_true", help="both engines plan one step at a time")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each engine's share (on a GPU)")
    parser.add_argument("--record", type=Path, default=None, help="write the verdict as JSON here")
    parser.add_argument(
        "--yardstick",
        default="auto",
        choices=["auto", "on", "off"],
        help="also run the cache-off engine with chunked prefills against itself (auto: outside fp32)",
    )


def run(args: argparse.Namespace) -> int:
    engine_kwargs: dict[str, Any] = {"device": args.device, "gpu_memory_utilization": args.gpu_memory_utilization}
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.no_async_scheduling:
        engine_kwargs["async_scheduling"] = False
    yardstick = args.yardstick == "on" or (args.yardstick == "auto" and args.dtype != "float32")
    verdict = run_gate(Path(args.model), args.dtype, args.max_tokens, args.seed, engine_kwargs, yardstick)
    print_verdict(verdict)
    if args.record is not None:  # with the host's date, commit and GPUs (the records index reads them)
        save_record(args.record, RECORD_SCHEMA, {"model": str(args.model), **asdict(verdict)})
    return verdict_code(verdict)


def verdict_code(verdict: GateVerdict) -> int:
    if verdict.num_checked == 0 or verdict.cached_tokens == 0:
        return 2
    return 0 if not verdict.mismatches else 1


def make_scenarios(ids: list[int], seed: int) -> list[Scenario]:
    """The traffic above, drawn from `ids` with one seeded generator (the same for both engines)."""
    rng = np.random.default_rng(seed)

    def span(length: int) -> list[int]:
        start = int(rng.integers(0, max(len(ids) - length, 1)))
        return list(ids[start : start + length])

    def suffix() -> list[int]:
        return span(int(rng.integers(SUFFIX_LENGTHS[0], SUFFIX_LENGTHS[1] + 1)))

    scenarios = []
    for length in SHARED_PREFIX_LENGTHS:
        prefix = span(length)
        prompts = [prefix + suffix() for _ in range(5)]
        rounds = [Round([prompts[0]]), Round([prompts[1]]), Round(prompts[2:])]
        scenarios.append(Scenario(f"shared-prefix-{length}", rounds))
    turns = [span(n) for n in TURN_LENGTHS]
    scenarios.append(Scenario("multi-turn", [], turn_spans=turns))
    retry = span(90)
    scenarios.append(Scenario("retry", [Round([retry]) for _ in range(3)]))
    # one prompt three times in one call: what n > 1 children share (greedy n > 1 itself is refused, as vLLM 0.26
    # refuses it)
    scenarios.append(Scenario("same-prompt-x3", [Round([span(70)] * 3)]))
    return scenarios


def _generate(llm: Any, round_: Round, max_tokens: int) -> list[tuple[list[list[int]], int, int]]:
    """Per prompt: (the n completions' token ids, prompt tokens, cached tokens, each completion's top-2 margin per
    position)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in round_.prompts], params, use_tqdm=False)
    return [
        (
            [list(c.token_ids) for c in out.outputs],
            len(out.prompt_token_ids),
            int(out.num_cached_tokens),
            [_margins(c.logprobs) for c in out.outputs],
        )
        for out in outputs
    ]


def _margins(logprobs: list[dict[int, Any]] | None) -> list[float | None]:
    """Per position, the top-1 minus the top-2 logprob (None where fewer than two came back)."""
    margins: list[float | None] = []
    for entry in logprobs or []:
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        margins.append(values[0] - values[1] if len(values) >= 2 else None)
    return margins


def _run_engine(llm: Any, scenarios: list[Scenario], max_tokens: int, answers: dict[str, list[list[int]]]) -> dict:
    """Every scenario's rounds in order -> {(scenario, round, prompt): (completions, prompt tokens, cached)}.
    Multi-turn prompts are built from `answers` (the cache-off engine's) when given, else from this engine's own
    answers, which are recorded into `answers`."""
    results: dict[tuple[str, int, int], tuple[list[list[int]], int, int, list[list[float | None]]]] = {}
    for scenario in scenarios:
        if scenario.turn_spans:
            prompt: list[int] = []
            own = answers.setdefault(scenario.name, [])
            for turn, user in enumerate(scenario.turn_spans):
                prompt = prompt + user
                (result,) = _generate(llm, Round([prompt]), max_tokens)
                results[(scenario.name, turn, 0)] = result
                if len(own) <= turn:
                    own.append(result[0][0])
                prompt = prompt + own[turn]
            continue
        for index, round_ in enumerate(scenario.rounds):
            for position, result in enumerate(_generate(llm, round_, max_tokens)):
                results[(scenario.name, index, position)] = result
    return results


def run_gate(
    model_dir: Path, dtype: str, max_tokens: int, seed: int, engine_kwargs: dict[str, Any] | None = None,
    yardstick: bool = False,
) -> GateVerdict:  # fmt: skip
    from deltaserve.engine.llm import LLM

    kwargs = dict(engine_kwargs or {})
    answers: dict[str, list[list[int]]] = {}
    off = LLM(model_dir, dtype=dtype, enable_prefix_caching=False, **kwargs)
    scenarios = make_scenarios(held_out_ids(off.get_tokenizer()), seed)
    try:
        off_results = _run_engine(off, scenarios, max_tokens, answers)
    finally:
        off.shutdown()
    on = LLM(model_dir, dtype=dtype, enable_prefix_caching=True, **kwargs)
    try:
        on_results = _run_engine(on, scenarios, max_tokens, answers)
    finally:
        on.shutdown()
    checked, matched, mismatches = compare(off_results, on_results)
    prompt_tokens = cached_tokens = 0
    by_scenario: dict[str, tuple[int, int]] = {}
    for key, (_, num_prompt, num_cached, _) in on_results.items():
        prompt_tokens += num_prompt
        cached_tokens += num_cached
        cached_so_far, prompt_so_far = by_scenario.get(key[0], (0, 0))
        by_scenario[key[0]] = (cached_so_far + num_cached, prompt_so_far + num_prompt)
    config = {"dtype": dtype, "max_tokens": max_tokens, "seed": seed, **{k: str(v) for k, v in kwargs.items()}}
    verdict = GateVerdict(checked, matched, prompt_tokens, cached_tokens, mismatches, config, by_scenario)
    if yardstick:
        chunked = LLM(model_dir, dtype=dtype, enable_prefix_caching=False,
                      **{**kwargs, "max_num_batched_tokens": YARDSTICK_CHUNK})  # fmt: skip
        try:
            chunked_results = _run_engine(chunked, scenarios, max_tokens, answers)
        finally:
            chunked.shutdown()
        verdict.yardstick = Yardstick(YARDSTICK_CHUNK, *compare(off_results, chunked_results))
    return verdict


def compare(off_results: dict, on_results: dict) -> tuple[int, int, list[Mismatch]]:
    """(completions checked, matched, the mismatches) of two engines' results over the same traffic."""
    mismatches: list[Mismatch] = []
    checked = matched = 0
    for key, (off_completions, _, _, off_margins) in off_results.items():
        on_completions, _, _, on_margins = on_results[key]
        pairs = zip(off_completions, on_completions, off_margins, on_margins, strict=True)
        for off_ids, on_ids, off_margin, on_margin in pairs:
            checked += 1
            if off_ids == on_ids:
                matched += 1
                continue
            position = next((i for i, (a, b) in enumerate(zip(off_ids, on_ids, strict=False)) if a != b), None)
            position = min(len(off_ids), len(on_ids)) if position is None else position
            mismatches.append(
                Mismatch(
                    key[0], key[1], key[2], position,
                    off_ids[position] if position < len(off_ids) else None,
                    on_ids[position] if position < len(on_ids) else None,
                    _rounded(off_margin[position] if position < len(off_margin) else None),
                    _rounded(on_margin[position] if position < len(on_margin) else None),
                )
            )  # fmt: skip
    return checked, matched, mismatches


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(float(value), 6)


def print_verdict(verdict: GateVerdict) -> None:
    print(f"STRICT {verdict.num_matched}/{verdict.num_checked} (greedy tokens, prefix cache on vs off)")
    for m in verdict.mismatches:
        print(
            f"  mismatch {m.scenario} round {m.round} prompt {m.prompt}: first difference at output position "
            f"{m.position}, off {m.off_token} vs on {m.on_token} (top-2 logprob margin off {m.off_margin}, on "
            f"{m.on_margin})"
        )
    rate = verdict.cached_tokens / verdict.prompt_tokens if verdict.prompt_tokens else 0.0
    print(
        f"hits: {verdict.cached_tokens} of {verdict.prompt_tokens} prompt tokens served from the cache "
        f"({100 * rate:.1f} %) by the cache-on engine; config {verdict.config}"
    )
    for name, (cached, prompt) in verdict.hits_by_scenario.items():
        print(f"  {name}: {cached} of {prompt} prompt tokens cached")
    stick = verdict.yardstick
    if stick is not None:
        print(
            f"yardstick STRICT {stick.num_matched}/{stick.num_checked} (no cache: the cache-off engine against "
            f"itself with {stick.chunk}-token prefill chunks, bf16 rounding alone)"
        )
        for m in stick.mismatches:
            print(
                f"  yardstick {m.scenario} round {m.round} prompt {m.prompt}: output position {m.position}, whole "
                f"{m.off_token} vs chunked {m.on_token} (margins {m.off_margin}, {m.on_margin})"
            )
    if verdict.num_checked == 0:
        print("nothing was checked")
    elif verdict.cached_tokens == 0:
        print("the cache never hit: the gate exercised nothing of it")


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="deltaserve gate prefix-cache", description=__doc__)
    add_arguments(main_parser)
    sys.exit(run(main_parser.parse_args()))
