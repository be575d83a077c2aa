"""`deltaserve check all`: run every gate and print one summary line per gate.

Gates: the static oracle-flags gate on the repository's harness sources; the token-exactness gate
(`deltaserve.gates.tokens.run_gate`, greedy tokens against transformers in fp32) on the three trained tiny
checkpoints shipped with the package (dense, moe, next; deltaserve/tiny/trained.py), or with `--checkpoints
random` on make_tiny's random ones; the conditioning check on the trained ones (transformers-bf16 against
transformers-fp32 >= 30 of 32, deltaserve/gates/conditioning.py), which shows a bf16 claim on them means
something; and the MTP check (the trained MTP head's top-1 agreement with the trunk's next-next token on held-out
text, at least MIN_MTP_AGREEMENT, deltaserve/tiny/mtp.py); those two on the trained checkpoints only (about 2.5
minutes together on a 2-core CPU; `--skip conditioning --skip mtp` drops them). The gates run on worker
subprocesses, one per CPU with that share of torch's threads (`--jobs`; `--jobs 1` runs them here, one after
another), and each gate's output is printed whole, in the order above, whatever order they end in
(deltaserve/gates/parallel.py). Exit 0 when every gate passes; 1 when any gate fails (or cannot run); otherwise 2
when some gate found nothing to check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

TINY_VARIANTS = ("dense", "moe", "next")
STRICT_RE = re.compile(r"STRICT\s+(\d+)\s*/\s*(\d+)")
# A random MTP head agrees with the trunk on about 1 token in 1300 (the tokenizer's size); the shipped heads,
# trained 360 steps, agree on 0.29-0.42 of held-out positions: 0.1 is far above chance and below them.
MIN_MTP_AGREEMENT = 0.1


@dataclass
class GateResult:
    name: str
    code: int
    detail: str


class _Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy, so a gate's output is shown and also parsed."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _run_captured(fn: Callable[[], int]) -> tuple[int, str]:
    """Call a gate, echoing and capturing its stdout; an exception becomes exit 1 with its traceback."""
    tee = _Tee(sys.stdout)
    try:
        with contextlib.redirect_stdout(tee):
            code = int(fn() or 0)
    except Exception:
        traceback.print_exc()
        return 1, tee.copy.getvalue() + "\n" + traceback.format_exc().strip().splitlines()[-1]
    return code, tee.copy.getvalue()


def oracle_flags_gate() -> GateResult:
    from deltaserve.gates import oracle_flags

    args = argparse.Namespace(paths=[], json=False)
    code, output = _run_captured(lambda: oracle_flags.run(args))
    summary = next((line for line in reversed(output.splitlines()) if line.startswith("oracle-flags:")), output.strip())
    return GateResult("oracle-flags", code, summary.removeprefix("oracle-flags: "))


def _checkpoint(tmp: str, variant: str, checkpoints: str) -> Path:
    """The trained checkpoint shipped for `variant`, or a fresh random make_tiny one."""
    if checkpoints == "trained":
        from deltaserve.tiny.trained import trained_model_dir

        return trained_model_dir(variant)
    from deltaserve.tiny import make_tiny

    return Path(make_tiny(Path(tmp) / variant, variant))


def token_gates(
    num_prompts: int, max_tokens: int, variants: tuple[str, ...] = TINY_VARIANTS, checkpoints: str = "trained"
) -> list[GateResult]:
    """The token gate on each tiny checkpoint; an import failure fails every variant with the reason."""
    try:
        from deltaserve.gates.tokens import run_gate
    except Exception as exc:
        return [GateResult(f"tokens[{v}]", 1, f"cannot import the gate: {exc}") for v in variants]
    results = []
    with tempfile.TemporaryDirectory(prefix="deltaserve-check-") as tmp:
        for variant in variants:
            name = f"tokens[{variant}]"
            try:
                model_dir = _checkpoint(tmp, variant, checkpoints)
            except Exception as exc:
                results.append(GateResult(name, 1, f"no {checkpoints} checkpoint: {exc}"))
                continue
            code, output = _run_captured(
                lambda d=model_dir: run_gate(
                    d, reference="transformers", num_prompts=num_prompts, max_tokens=max_tokens
                )
            )
            matches = STRICT_RE.findall(output)
            detail = f"STRICT {matches[-1][0]}/{matches[-1][1]}" if matches else "no STRICT line printed"
            # The gate may fail on checks beyond STRICT (logits, prefill-then-decode): name the first one.
            failures = [line.strip() for line in output.splitlines() if line.rstrip().endswith("FAIL")]
            if code not in (0, 2) and failures:
                detail += f"; {failures[0]}"
            if matches and int(matches[-1][1]) == 0 and code == 0:
                code = 2
            results.append(GateResult(name, code, detail))
    return results


def conditioning_gates(
    num_prompts: int, max_tokens: int, variants: tuple[str, ...] = TINY_VARIANTS
) -> list[GateResult]:
    """transformers-bf16 against transformers-fp32 on each trained checkpoint (must agree on >= 30 of 32)."""
    from deltaserve.gates.conditioning import check_conditioning

    results = []
    for variant in variants:
        name = f"conditioning[{variant}]"
        try:
            model_dir = _checkpoint("", variant, "trained")
        except Exception as exc:
            results.append(GateResult(name, 1, f"no trained checkpoint: {exc}"))
            continue
        code, output = _run_captured(lambda d=model_dir: check_conditioning(d, num_prompts, max_tokens))
        matches = STRICT_RE.findall(output)
        detail = f"bf16 vs fp32 STRICT {matches[-1][0]}/{matches[-1][1]}" if matches else "no STRICT line printed"
        results.append(GateResult(name, code, detail))
    return results


def mtp_gates(variants: tuple[str, ...] = TINY_VARIANTS) -> list[GateResult]:
    """The trained MTP head's agreement with the trunk's next-next token on held-out text."""
    results = []
    for variant in variants:
        name = f"mtp[{variant}]"
        try:
            from deltaserve.tiny.mtp import check_mtp

            found = check_mtp(_checkpoint("", variant, "trained"))
        except Exception as exc:
            results.append(GateResult(name, 1, f"cannot measure: {type(exc).__name__}: {exc}"))
            continue
        detail = f"agreement {found.num_agree}/{found.num_positions} = {found.rate:.3f} (need >= {MIN_MTP_AGREEMENT:g})"
        print(f"mtp check: {variant}: MTP top-1 agreement with the trunk's next-next token on held-out text: {detail}")
        code = 2 if found.num_positions == 0 else (0 if found.rate >= MIN_MTP_AGREEMENT else 1)
        results.append(GateResult(name, code, detail))
    return results


VERDICTS = {0: "PASS", 2: "NOTHING TO CHECK"}  # exit code -> summary word; anything else is a failure


def overall_code(results: list[GateResult]) -> int:
    """1 if any gate failed, else 2 if any found nothing to check (or no gate ran at all), else 0."""
    if not results:
        return 2
    if any(r.code not in (0, 2) for r in results):
        return 1
    if any(r.code == 2 for r in results):
        return 2
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip", action="append", default=[], choices=["oracle-flags", "tokens", "conditioning", "mtp"]
    )
    # Both run by default on the trained checkpoints now; --with stays accepted so older command lines still run.
    parser.add_argument(
        "--with", dest="with_", action="append", default=[], choices=["conditioning", "mtp"],
        help="no effect: the conditioning and MTP checks run by default on the trained checkpoints",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=32, help="token gate prompts per tiny model")
    parser.add_argument("--max-tokens", type=int, default=32, help="token gate tokens per prompt")
    parser.add_argument(
        "--checkpoints",
        default="trained",
        choices=["trained", "random"],
        help="the token gate's tiny checkpoints: the shipped trained ones (default) or fresh random make_tiny ones",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="gates run at once, each in a worker subprocess with its share of the CPUs (default 0: one per CPU); "
        "1 runs them one after another in this process. The output is the same, in the same order, either way",
    )


def gate_jobs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """Every gate `args` selects, as (summary name, job for run_job), in the order of the summary."""
    checkpoints = getattr(args, "checkpoints", "trained")
    sizes = {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens}
    jobs: list[tuple[str, dict[str, Any]]] = []
    if "oracle-flags" not in args.skip:
        jobs.append(("oracle-flags", {"gate": "oracle-flags"}))
    if "tokens" not in args.skip:
        jobs += [(f"tokens[{v}]", {"gate": "tokens", "variant": v, "checkpoints": checkpoints, **sizes})
                 for v in TINY_VARIANTS]  # fmt: skip
    # a random make_tiny checkpoint is ill-conditioned and has an untrained MTP head by construction
    is_trained = checkpoints == "trained"
    if is_trained and "conditioning" not in args.skip:
        jobs += [(f"conditioning[{v}]", {"gate": "conditioning", "variant": v, **sizes}) for v in TINY_VARIANTS]
    if is_trained and "mtp" not in args.skip:
        jobs += [(f"mtp[{v}]", {"gate": "mtp", "variant": v}) for v in TINY_VARIANTS]
    return jobs


def run_job(job: dict[str, Any]) -> GateResult:
    """One gate of the list gate_jobs makes (the in-process path and the workers of parallel.py both call this)."""
    gate = job["gate"]
    if gate == "oracle-flags":
        return oracle_flags_gate()
    if gate == "tokens":
        variants = (job["variant"],)
        return token_gates(job["num_prompts"], job["max_tokens"], variants, job["checkpoints"])[0]
    if gate == "conditioning":
        return conditioning_gates(job["num_prompts"], job["max_tokens"], (job["variant"],))[0]
    if gate == "mtp":
        return mtp_gates((job["variant"],))[0]
    raise ValueError(f"unknown gate {gate!r}")


def _run_in_workers(jobs: list[tuple[str, dict[str, Any]]], num_workers: int) -> list[GateResult]:
    """The jobs on worker subprocesses; each job's output is printed as the in-process path prints it, in order."""
    from deltaserve.gates import parallel

    def show(outcome: parallel.JobOutcome) -> None:
        sys.stdout.write(outcome.stdout)
        sys.stdout.flush()
        sys.stderr.write(outcome.stderr)
        sys.stderr.flush()

    num_threads = max(1, parallel.available_cpus() // num_workers)
    outcomes = parallel.run_jobs(jobs, num_workers, show, num_threads)
    return [GateResult(o.name, o.code, o.detail) for o in outcomes]


def worker_count(jobs: int, num_gates: int) -> int:
    """--jobs: 0 means one worker per CPU (at most one per gate); 1 runs every gate in this process."""
    from deltaserve.gates.parallel import available_cpus

    wanted = available_cpus() if jobs <= 0 else jobs
    return max(1, min(wanted, num_gates))


def run(args: argparse.Namespace) -> int:
    jobs = gate_jobs(args)
    workers = worker_count(getattr(args, "jobs", 1), len(jobs))
    if workers == 1:
        results = [run_job(job) for _, job in jobs]
    else:
        results = _run_in_workers(jobs, workers)
    print()
    for result in results:
        verdict = VERDICTS.get(result.code, f"FAIL (exit {result.code})")
        print(f"{result.name:<20} {verdict:<18} {result.detail}")
    code = overall_code(results)
    num_failed = sum(1 for r in results if r.code not in (0, 2))
    verdict = VERDICTS.get(code, "FAIL")
    print(f"check all: {verdict} ({len(results)} gates, {num_failed} failed)")
    return code
