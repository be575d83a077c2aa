"""The trained tiny checkpoints shipped as package data (deltaserve/tiny/trained/<variant>/).

They are `make_tiny`'s checkpoints trained on the shipped corpus by deltaserve/tiny/train.py (trunk and MTP
head), so their logits are peaked and bf16 rounding rarely flips a greedy token: the checkpoints on which a bf16
exactness claim means something (issue 13); the vision variants' also on image, multi-image and video prompts
(deltaserve/tiny/train_vision.py, issue 14). `trained_model_dir` finds one; `copy_trained` copies one out (for
`deltaserve make-tiny DIR --trained`). Each folder's training.json states the recipe that made it.

The FP8 gate's -w128 variants (spec.WIDE_VARIANTS) are not shipped: train.py trains them on the H200 at gate time
(`scripts/h200.sh gates fp8`), because every device call carries the whole tree within a fixed size and their
12.6 MB would not fit beside the bundle pieces (docs/fp8.md, "The FP8 gate's checkpoints").
"""

from __future__ import annotations

import shutil
from pathlib import Path

from deltaserve.tiny.spec import WIDE_VARIANTS

TRAINED_ROOT = Path(__file__).with_name("trained")
# the vision variants are trained by deltaserve/tiny/train_vision.py (issue 14)
TRAINED_VARIANTS: tuple[str, ...] = ("dense", "moe", "next", "dense-vl", "moe-vl")


def trained_model_dir(variant: str) -> Path:
    """The shipped trained checkpoint of `variant` (read-only package data)."""
    if variant in WIDE_VARIANTS:  # trained on the device at gate time, never shipped (the module docstring)
        raise FileNotFoundError(
            f"the FP8 gate's checkpoint {variant!r} is not shipped: train it with "
            f"`python -m deltaserve.tiny.train DIR --variant {variant} --device cuda` (scripts/h200.sh gates fp8 "
            f"does), or `deltaserve make-tiny DIR --variant {variant}` for its untrained twin"
        )
    folder = TRAINED_ROOT / variant
    if not (folder / "config.json").is_file():
        shipped = sorted(p.parent.name for p in TRAINED_ROOT.glob("*/config.json"))
        raise FileNotFoundError(
            f"no trained tiny checkpoint for variant {variant!r} in {TRAINED_ROOT} "
            f"(shipped: {', '.join(shipped) or 'none'}); make one with "
            f"`python -m deltaserve.tiny.train DIR --variant {variant}`"
        )
    return folder


def copy_trained(out_dir: Path | str, variant: str) -> Path:
    """Copy the shipped trained checkpoint of `variant` into out_dir (replaced if it exists) and return it."""
    source = trained_model_dir(variant)
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(source, out_dir)
    return out_dir
