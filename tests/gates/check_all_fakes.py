"""Fake gates for `deltaserve check all`, in process (install) or as a worker subprocess of gates/parallel.py
(`python tests/gates/check_all_fakes.py SPEC_JSON --threads N`: installs the fakes, then runs the real worker loop).

SPEC keys: codes (variant -> token gate exit code), totals (variant -> prompts the token gate reports), agree
(prompts conditioning reports agreeing, default all), rate (MTP agreement, default 0.6), sleep (variant -> seconds
the token gate waits first, to finish jobs out of order), die (variant -> exit status the token gate's process
dies with, mid-job).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any


def install(spec: dict[str, Any]) -> None:
    """Replaces the token gate, the conditioning and MTP checks and the checkpoint lookup (for this process)."""
    from deltaserve.gates import all as check_all

    codes, totals = spec.get("codes", {}), spec.get("totals", {})

    def run_gate(model_dir: Path, reference: str = "transformers", num_prompts: int = 32, max_tokens: int = 32) -> int:
        variant = Path(model_dir).name
        time.sleep(spec.get("sleep", {}).get(variant, 0.0))
        if variant in spec.get("die", {}):
            print("about to die", flush=True)
            print("fake gate: dying on purpose", file=sys.stderr, flush=True)
            os._exit(spec["die"][variant])
        total = totals.get(variant, num_prompts)
        code = codes.get(variant, 0)
        print(f"fake token gate on {variant}\nSTRICT {total if code == 0 else total - 1}/{total}")
        print(f"fake token gate warning on {variant}", file=sys.stderr)
        return code

    def check_conditioning(model_dir: Path, num_prompts: int = 32, max_tokens: int = 32) -> int:
        agree = spec.get("agree", num_prompts)
        print(f"conditioning: {Path(model_dir).name}: transformers-bfloat16 vs transformers-float32 "
              f"STRICT {agree}/{num_prompts}")  # fmt: skip
        return 0 if agree == num_prompts else 1

    def check_mtp(model_dir: Path) -> object:
        rate = spec.get("rate", 0.6)
        return types.SimpleNamespace(num_agree=int(rate * 100), num_positions=100, rate=rate)

    sys.modules["deltaserve.gates.tokens"] = types.SimpleNamespace(run_gate=run_gate)  # type: ignore[assignment]
    sys.modules["deltaserve.gates.conditioning"] = types.SimpleNamespace(check_conditioning=check_conditioning)  # type: ignore[assignment]
    sys.modules["deltaserve.tiny.mtp"] = types.SimpleNamespace(check_mtp=check_mtp)  # type: ignore[assignment]
    check_all._checkpoint = lambda tmp, variant, checkpoints: Path("/nowhere") / variant


def worker_command(spec: dict[str, Any]) -> Any:
    """A replacement for deltaserve.gates.parallel.worker_command that starts workers with these fakes."""
    root = str(Path(__file__).resolve().parents[2])

    def command(num_threads: int) -> list[str]:
        return [sys.executable, __file__, json.dumps(spec), "--threads", str(num_threads), "--root", root]

    return command


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[sys.argv.index("--root") + 1])
    install(json.loads(sys.argv[1]))
    from deltaserve.gates.parallel import worker_main

    sys.exit(worker_main(sys.argv[2 : sys.argv.index("--root")]))
