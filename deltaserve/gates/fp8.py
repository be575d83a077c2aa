"""`deltaserve gate fp8`: deltaserve serving a block-FP8 checkpoint against vLLM 0.26 serving the same one (issue 37).

Both engines run the same FP8 checkpoint in process, greedy, in bf16 on cuda (the H200), on the token gate's
seeded prompts: `--prompts random` (the default: ordinary tokens, lengths 1 .. 160, tokens.make_prompts, which the
trained checkpoints' recipe conditions them for, as the bf16 gate against vLLM runs) or `--prompts text` (spans of
the shipped corpus' held-out text, tokens.make_text_prompts over tokens.held_out_ids: text no trained checkpoint
saw, on which the tiny checkpoints' greedy tokens are far less robust to rounding: docs/fp8.md, "The FP8 token
gate"). vLLM runs first, built by the oracle registry in its production configuration (gates/vllm_reference.py:
its block-FP8 kernels, its rounding points), then deltaserve's offline `LLM` on the GPU the oracle gave back. The
verdict starts with `STRICT n/N`; then every mismatch: the output position, both tokens, and vLLM's logit margin
between them from its top-20 raw logits (a near-tie within tokens.TIE_ULPS ulps is said so, and still counts
against STRICT).

`--model` is a block-FP8 checkpoint, or an unquantized one (the FP8 gate's tiny checkpoints,
<variant>-w128 in deltaserve/tiny/spec.py, whose every FP8 projection has sides vLLM's block kernels take): the gate
then writes its FP8 copy first with deltaserve/tiny/fp8.py (deterministic: the record holds the copy's sha256)
into `--fp8-dir` and both engines serve that copy. Those checkpoints are not shipped: scripts/h200.sh trains them
on the GPU first (`python -m deltaserve.tiny.train DIR --variant V-w128 --device cuda`), so the record also holds
the unquantized checkpoint's sha256 and, from its training.json, the device and recipe that trained it.

Exit 0 when every prompt matches; 1 on a mismatch or a refused reference; 2 when nothing was checked (no prompt,
no token, or vLLM not importable, as on a machine without the bundle). `--record PATH` writes the verdict as JSON
(gate-fp8-<checkpoint>-TAG.json under benchmarks/results/gates/). `--share-gpu` sizes both engines' caches small,
so the three tiny variants run side by side on one GPU (scripts/h200.sh gates fp8).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from deltaserve.bench.deviations import GATE_SITE
from deltaserve.gates.references import ReferenceError, ReferenceRun
from deltaserve.gates.tokens import (
    PROMPT_SOURCES,
    TIE_ULPS,
    Mismatch,
    add_oracle_arguments,
    engine_memory,
    judge_mismatch,
    make_prompts,
    make_text_prompts,
    save_record,
)

RECORD_SCHEMA = "deltaserve-gate-fp8/1"


class Reference(Protocol):
    """What the gate needs of its reference: greedy tokens and each step's top logits for token-id prompts."""

    def run(self, prompts: list[list[int]], max_tokens: int) -> ReferenceRun: ...


@dataclass
class PromptMismatch:
    """One prompt whose greedy tokens differ, judged at its first divergence by the reference's own logits."""

    prompt: int
    prompt_len: int
    position: int
    ref_token: int  # -1: the reference's output ended there
    our_token: int  # -1: deltaserve's output ended there
    margin: float | None  # the reference's logit of its token minus ours (tokens.Mismatch); None: no logits there
    is_margin_exact: bool = False  # False: our token is outside the reference's top-20, `margin` is a lower bound
    tie_margin: float = 0.0
    is_near_tie: bool = False

    @classmethod
    def judged(cls, prompt: int, prompt_len: int, mismatch: Mismatch) -> PromptMismatch:
        m = mismatch
        return cls(prompt, prompt_len, m.position, m.ref_token, m.our_token, m.margin, m.is_margin_exact,
                   m.tie_margin, m.is_near_tie)  # fmt: skip


@dataclass
class Fp8Verdict:
    num_prompts: int
    num_exact: int = 0
    mismatches: list[PromptMismatch] = field(default_factory=list)
    nothing: str | None = None  # why nothing was checked (exit 2)
    refused: str | None = None  # why the reference could not stand for the checkpoint (exit 1)
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True,
        help="a block-FP8 checkpoint folder, or an unquantized one (a <variant>-w128 checkpoint that "
        "deltaserve.tiny.train writes) that the gate first writes as FP8 (deltaserve/tiny/fp8.py) into --fp8-dir",
    )  # fmt: skip
    parser.add_argument("--fp8-dir", type=Path, default=None, help="where the FP8 copy goes (default: a temp folder)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=160)
    parser.add_argument("--prompts", default="random", choices=PROMPT_SOURCES, help="random tokens or held-out text")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    add_oracle_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_gate(
        Path(args.model), args.fp8_dir, args.num_prompts, args.max_tokens, args.max_prompt_len, args.dtype,
        args.device, args.seed, args.site, args.record, args.share_gpu, args.prompts,
    )  # fmt: skip


def is_fp8_checkpoint(model_dir: Path) -> bool:
    """Whether config.json (or its text_config) declares a quantization_config."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return any(isinstance(c.get("quantization_config"), dict) for c in (config, config.get("text_config") or {}))


def fp8_checkpoint(model_dir: Path, fp8_dir: Path | None) -> tuple[Path, bool]:
    """(the FP8 checkpoint both engines serve, whether the gate wrote it): model_dir itself when it is one, else
    its FP8 copy written into fp8_dir (a fresh temp folder when None)."""
    if is_fp8_checkpoint(model_dir):
        return Path(model_dir), False
    from deltaserve.tiny.fp8 import write_fp8_checkpoint

    out = fp8_dir or Path(tempfile.mkdtemp(prefix="deltaserve-gate-fp8-")) / Path(model_dir).name
    return write_fp8_checkpoint(Path(model_dir), out), True


def weights_sha256(folder: Path) -> str:
    """One sha256 over the folder's safetensors files in name order (the FP8 copy is written deterministically)."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def source_facts(model_dir: Path) -> dict[str, Any]:
    """The checkpoint the gate was given: its weights' sha256 and, when train.py made it (training.json), the
    device and step count that trained it and its losses (None for an untrained or foreign checkpoint)."""
    from deltaserve.tiny.train import MANIFEST_NAME

    manifest_path = Path(model_dir) / MANIFEST_NAME
    training = None
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        recipe = manifest.get("recipe") or {}
        training = {
            "device": recipe.get("device"),
            "num_steps": recipe.get("num_steps"),
            "seed": recipe.get("seed"),
            **{key: manifest.get(key) for key in ("seconds", "first_loss", "final_loss", "held_out_loss")},
        }
    return {"path": str(model_dir), "weights_sha256": weights_sha256(model_dir), "training": training}


def compare(
    prompts: list[list[int]], ours: list[list[int]], ref_run: ReferenceRun, dtype: str, verdict: Fp8Verdict
) -> None:
    """Fill the verdict: exact prompts, and each mismatch judged by the reference's logits at its first divergence."""
    for i, (prompt, our_tokens) in enumerate(zip(prompts, ours, strict=True)):
        ref_tokens = ref_run.tokens[i]
        if our_tokens == ref_tokens:
            verdict.num_exact += 1
            continue
        position = next((j for j, (a, b) in enumerate(zip(our_tokens, ref_tokens, strict=False)) if a != b), None)
        position = min(len(our_tokens), len(ref_tokens)) if position is None else position
        if position < len(ref_run.scores[i]):
            mismatch = judge_mismatch(our_tokens, ref_tokens, ref_run.scores[i], dtype)
            verdict.mismatches.append(PromptMismatch.judged(i, len(prompt), mismatch))
        else:  # no logits there (vLLM's output ended): the mismatch stands, with no margin to judge it by
            found = PromptMismatch(i, len(prompt), position, _at(ref_tokens, position), _at(our_tokens, position), None)
            verdict.mismatches.append(found)


def _at(tokens: list[int], position: int) -> int:
    return tokens[position] if position < len(tokens) else -1


def verdict_code(verdict: Fp8Verdict) -> int:
    if verdict.nothing is not None:
        return 2
    if verdict.refused is not None:
        return 1
    return 1 if verdict.mismatches else 0


def report(verdict: Fp8Verdict, what: str, ref_config: dict[str, Any] | None, tokenizer: Any = None) -> int:
    """Print the verdict (STRICT first, then every mismatch, then what was run) and return the exit code."""
    if verdict.nothing is not None:
        verdict.say(f"gate fp8: nothing to check: {verdict.nothing}")
    elif verdict.refused is not None:
        verdict.say(f"gate fp8: the vllm reference REFUSED: {verdict.refused}")
    else:
        peer = " ".join(["vllm", str((ref_config or {}).get("version", ""))]).strip()
        n, ties = verdict.num_prompts, sum(m.is_near_tie for m in verdict.mismatches)
        tail = f": {len(verdict.mismatches)} mismatches, {ties} of them near-ties" if verdict.mismatches else ""
        verdict.say(f"STRICT {verdict.num_exact}/{n} deltaserve against {peer}, both serving the FP8 checkpoint{tail}")
        for m in verdict.mismatches:
            verdict.say(_mismatch_line(m, tokenizer))
    code = verdict_code(verdict)
    verdict.say(f"gate fp8: {what}; exit {code}")
    return code


def _mismatch_line(m: PromptMismatch, tokenizer: Any) -> str:
    if m.margin is None:
        judged = "no vLLM logits at that position"
    else:
        bound = "" if m.is_margin_exact else "> "
        kind = "near-tie" if m.is_near_tie else "beyond the near-tie margin"
        judged = f"vLLM's margin {bound}{m.margin:.6g} (near-tie margin {m.tie_margin:.3g}): {kind}"
    ref_text, our_text = _text(tokenizer, m.ref_token), _text(tokenizer, m.our_token)
    return (f"  prompt {m.prompt} (len {m.prompt_len}), output position {m.position}: vLLM {m.ref_token}{ref_text}"
            f" vs deltaserve {m.our_token}{our_text}; {judged}")  # fmt: skip


def _text(tokenizer: Any, token: int) -> str:
    if tokenizer is None or token < 0:
        return ""
    try:
        return f" {tokenizer.decode([token])!r}"
    except Exception:
        return ""  # an id past the tokenizer (a padding row) has no text


def vllm_importable() -> bool:
    """Whether `import vllm` can work here (the H200 with the bundle unpacked on the path), without importing it."""
    return importlib.util.find_spec("vllm") is not None


def _device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_deltaserve(
    fp8_dir: Path, prompts: list[list[int]], max_tokens: int, dtype: str, device: str, seed: int, share_gpu: bool
) -> list[list[int]]:
    """Greedy tokens of deltaserve's offline LLM serving the FP8 checkpoint."""
    from deltaserve import LLM, SamplingParams

    llm = LLM(fp8_dir, dtype=dtype, device=device, seed=seed, max_num_seqs=min(len(prompts), 64),
              **engine_memory(share_gpu))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def _vllm_reference(fp8_dir: Path, dtype: str, max_prompt_len: int, seed: int, site: str, share_gpu: bool) -> Reference:
    from deltaserve.gates.vllm_reference import VllmReference

    return VllmReference(fp8_dir, dtype, max_prompt_len, seed, site, shares_gpu=share_gpu)


@torch.inference_mode()
def run_gate(
    model_dir: Path,
    fp8_dir: Path | None = None,
    num_prompts: int = 32,
    max_tokens: int = 32,
    max_prompt_len: int = 160,
    dtype: str = "bfloat16",
    device: str = "auto",
    seed: int = 0,
    site: str = GATE_SITE,
    record_path: Path | None = None,
    share_gpu: bool = False,
    prompts: str = "random",
    reference: Callable[[Path], Reference] | None = None,
) -> int:
    """The gate; `reference` builds a stand-in for vLLM from the FP8 folder (tests), None: vLLM in process."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    verdict = Fp8Verdict(num_prompts=max(num_prompts, 0))
    source = "held-out text" if prompts == "text" else "random"
    what = f"{model_dir} ({dtype}), {num_prompts} {source} prompts, {max_tokens} tokens each"
    if num_prompts < 1 or max_tokens < 1:
        verdict.nothing = "num_prompts and max_tokens must be positive"
        return report(verdict, what, None)
    if reference is None and not vllm_importable():
        verdict.nothing = "vLLM is not importable (on the H200 unpack the bundle first: benchmarks/oracle/unpack.sh)"
        return report(verdict, what, None)
    source_checkpoint = source_facts(model_dir)
    if (training := source_checkpoint["training"]) is not None:
        what += f"; trained on {training['device']} ({training['num_steps']} steps)"
    served, is_written = fp8_checkpoint(model_dir, fp8_dir)
    if is_written:
        what += f"; served as its FP8 copy {served}"
    tokenizer = AutoTokenizer.from_pretrained(served)
    maker = make_text_prompts if prompts == "text" else make_prompts
    prompt_ids = maker(tokenizer, num_prompts, max_prompt_len, seed)
    ref_run = None
    try:
        # vLLM first: it gives the GPU back before deltaserve takes it
        if reference is None:
            oracle = _vllm_reference(served, dtype, max_prompt_len, seed, site, share_gpu)
        else:
            oracle = reference(served)
        ref_run = oracle.run(prompt_ids, max_tokens)
    except (ReferenceError, ValueError) as exc:
        verdict.refused = str(exc)
    if ref_run is not None:
        ours = run_deltaserve(served, prompt_ids, max_tokens, dtype, _device(device), seed, share_gpu)
        compare(prompt_ids, ours, ref_run, dtype, verdict)
    config = ref_run.config if ref_run is not None else None
    code = report(verdict, what, config, tokenizer)
    if record_path is not None:
        facts = {"path": str(served), "written_by_gate": is_written, "weights_sha256": weights_sha256(served)}
        _write_record(record_path, verdict, code, source_checkpoint, facts, dtype, seed, max_tokens, prompt_ids,
                      source, config)  # fmt: skip
    return code


def _write_record(
    path: Path, verdict: Fp8Verdict, code: int, checkpoint: dict[str, Any], fp8: dict[str, Any], dtype: str, seed: int,
    max_tokens: int, prompts: list[list[int]], source: str, ref_config: dict[str, Any] | None,
) -> None:  # fmt: skip
    record = {
        "kind": "gate-fp8",
        "model": checkpoint["path"],
        "checkpoint": checkpoint,
        "fp8_checkpoint": fp8,
        "dtype": dtype,
        "reference": "vllm",
        "reference_config": ref_config,
        "prompts": {
            "source": source,
            "seed": seed,
            "lengths": [len(p) for p in prompts],
            "max_tokens": max_tokens,
        },  # fmt: skip
        "strict": {"num_exact": verdict.num_exact, "num_prompts": verdict.num_prompts},
        "near_tie_margin": f"{TIE_ULPS:g} ulps of {dtype} at vLLM's top logit",
        "mismatches": [asdict(m) for m in verdict.mismatches],
        "nothing_to_check": verdict.nothing,
        "refused": verdict.refused,
        "exit_code": code,
        "output": verdict.lines,
    }
    save_record(path, RECORD_SCHEMA, record)


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="deltaserve gate fp8", description=__doc__)
    add_arguments(main_parser)
    sys.exit(run(main_parser.parse_args()))
