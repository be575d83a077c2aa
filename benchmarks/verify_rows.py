"""Where a verify row first stops being the decode row: a diagnostic of MTP's exactness in one dtype (issue 41).

`deltaserve gate mtp` counts prompts whose greedy tokens with MTP differ from those without (bf16 on the H200,
2026-12-05: 9/16 on the trained dense checkpoint, while the same gate in bf16 on the CPU is 16/16). A flip means some
module computed a position's row differently in a verify chunk of 1 + k rows than in the one-row decode. This tool
finds which: it runs the offline engine eagerly (no CUDA graphs: module hooks see every call) one prompt at a time,
without MTP and with it, records the output of every decoder layer's mixer (`self_attn` / `linear_attn`), its MLP
and the final norm for every row, keyed by position, and compares the two runs row by row, bit for bit.

A verify row is comparable only where its input is the run without MTP's: its token and every earlier draft of its
chunk equal that run's tokens (a rejected draft's row, and every row after it in its chunk, saw another token; the
position is computed again in a later step, which is compared instead), and only up to the first position whose
sampled token differs (after it the histories differ). Per prompt the tool prints the first (position, module) whose
row differs, with the largest absolute difference there, or that every comparable row is equal; then, over all
prompts, how many first differences each module holds. Exit 0 when every comparable row is equal, 1 otherwise, 2
when nothing was compared.

    python3 benchmarks/verify_rows.py --model deltaserve/tiny/trained/dense --dtype bfloat16 --device cuda

On the H200: `bash scripts/h200.sh verify-rows` (the three trained checkpoints, bf16, a record each).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Call:
    """One forward of the target model: its rows' tokens and positions, and each hooked module's output rows."""

    input_ids: list[int]
    positions: list[int]
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # module name -> [T, H] on the CPU


@dataclass
class Run:
    """One engine's greedy run of one prompt: its tokens (prompt + outputs) and its calls in order."""

    tokens: list[int]
    calls: list[Call]


def hook_model(model: torch.nn.Module, calls: list[Call]) -> list[Any]:
    """Records every target forward into `calls` (the MTP layer is not hooked: it drafts, it decides nothing).
    Returns the hook handles."""

    def start(_module: torch.nn.Module, args: tuple) -> None:
        input_ids, positions = args[0], args[1]
        rows = positions[0] if positions.dim() == 2 else positions  # [T] text positions
        calls.append(Call(input_ids.tolist(), rows.tolist()))

    def keep(name: str) -> Any:
        def hook(_module: torch.nn.Module, _args: tuple, output: Any) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            calls[-1].outputs[name] = tensor.detach().float().cpu()

        return hook

    handles = [model.register_forward_pre_hook(start), model.register_forward_hook(keep("norm"))]
    for i, layer in enumerate(model.layers):
        mixer = "self_attn" if layer.is_full_attention else "linear_attn"
        handles.append(layer.mixer.register_forward_hook(keep(f"layers.{i}.{mixer}")))
        handles.append(layer.mlp.register_forward_hook(keep(f"layers.{i}.mlp")))
    return handles


def run_prompt(
    model_dir: str, prompt: list[int], max_tokens: int, dtype: str, device: str, spec: dict[str, Any] | None
) -> Run:
    """One prompt greedily through an eager engine (max_num_seqs 1: rows map to positions one to one)."""
    from deltaserve.engine.llm import LLM
    from deltaserve.sampling_params import SamplingParams

    memory = {"gpu_memory_utilization": 0.3} if device == "cuda" else {}
    llm = LLM(model_dir, dtype=dtype, device=device, seed=0, max_num_seqs=1, enforce_eager=True,
              speculative_config=spec, enable_prefix_caching=False, **memory)  # fmt: skip
    calls: list[Call] = []
    handles = hook_model(llm.engine.runner.model, calls)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    for handle in handles:
        handle.remove()
    llm.shutdown()
    return Run(prompt + list(output.outputs[0].token_ids), calls)


def rows_by_position(run: Run, reference: list[int], limit: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per position < limit, each module's row from the LAST call that computed it with the reference's input:
    the row's token and every earlier row of its call equal the reference tokens at their positions."""
    rows: dict[int, dict[str, torch.Tensor]] = {}
    for call in run.calls:
        for i, (token, position) in enumerate(zip(call.input_ids, call.positions, strict=True)):
            if position >= limit or position >= len(reference) or token != reference[position]:
                break  # this row and every later row of the call saw another history
            rows[position] = {name: out[i] for name, out in call.outputs.items()}
    return rows


def comparable_rows(plain: Run, spec: Run) -> tuple[int, dict, dict]:
    """(the first position whose token differs, or the shorter run's length: nothing from it on is compared; the
    run without MTP's rows and the run with it's, by position, below it)."""
    from deltaserve.gates.mtp import first_difference as first_token_difference

    limit = first_token_difference(plain.tokens, spec.tokens)
    if limit is None:
        limit = len(plain.tokens)
    return limit, rows_by_position(plain, plain.tokens, limit), rows_by_position(spec, plain.tokens, limit)


def first_difference(plain: Run, spec: Run, module_order: list[str]) -> dict[str, Any] | None:
    """The first (position, module) whose comparable rows differ, or None when all are equal."""
    limit, theirs, ours = comparable_rows(plain, spec)
    for position in sorted(set(ours) & set(theirs)):
        for name in module_order:
            a, b = theirs[position].get(name), ours[position].get(name)
            if a is not None and b is not None and not torch.equal(a, b):
                return {"position": position, "module": name, "max_abs_diff": float((a - b).abs().max()),
                        "first_token_difference": limit}  # fmt: skip
    return None


def compared_positions(plain: Run, spec: Run) -> int:
    _, theirs, ours = comparable_rows(plain, spec)
    return len(set(theirs) & set(ours))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deltaserve/tiny/trained/dense")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-len", type=int, default=160)
    parser.add_argument("--out", type=Path, default=None, help="the record (JSON)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from deltaserve.gates.tokens import make_text_prompts

    prompts = make_text_prompts(AutoTokenizer.from_pretrained(args.model), args.num_prompts, args.max_prompt_len, 0)
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    results, firsts = [], Counter()
    for index, prompt in enumerate(prompts):
        plain = run_prompt(args.model, prompt, args.max_tokens, args.dtype, args.device, None)
        with_spec = run_prompt(args.model, prompt, args.max_tokens, args.dtype, args.device, spec)
        order = list(plain.calls[0].outputs) if plain.calls else []
        found = first_difference(plain, with_spec, order)
        compared = compared_positions(plain, with_spec)
        results.append({"prompt": index, "compared_positions": compared, "first_difference": found})
        if found is None:
            print(f"prompt {index}: {compared} positions compared, every row equal", flush=True)
        else:
            firsts[found["module"]] += 1
            print(f"prompt {index}: {compared} positions compared; first difference at position {found['position']} "
                  f"in {found['module']} (max abs {found['max_abs_diff']:.3g}; tokens first differ at "
                  f"{found['first_token_difference']})", flush=True)  # fmt: skip
    total = sum(r["compared_positions"] for r in results)
    differing = sum(1 for r in results if r["first_difference"] is not None)
    print(f"verify rows: {args.model} {args.dtype} on {args.device}, k = {args.num_speculative_tokens}: "
          f"{len(results) - differing}/{len(results)} prompts with every comparable row equal ({total} positions); "
          f"first differences by module: {dict(firsts.most_common())}")  # fmt: skip
    if args.out is not None:
        record = {"kind": "verify_rows", "model": args.model, "dtype": args.dtype, "device": args.device,
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                  "num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
                  "results": results, "first_differences_by_module": dict(firsts)}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    if total == 0:
        return 2
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
