"""Is a checkpoint well conditioned for bf16 exactness claims? transformers' bf16 greedy run against its own fp32.

A bf16 mismatch between two engines only means something on a checkpoint whose own reference survives bf16
rounding: on a random tiny model transformers-bf16 disagrees with transformers-fp32 on almost every prompt, so
any engine's bf16 mismatch is indistinguishable from the model's chaos. This check runs the token gate's prompts
through transformers' reference class (`config.architectures[0]`) in both dtypes and prints
`conditioning: transformers-bfloat16 vs transformers-float32 STRICT n/N`; it passes at n >= MIN_AGREE of 32
(issue 13), scaled for other N. `python -m deltaserve.gates.conditioning DIR [--num-prompts N]`.

With `--media KIND` (image, multi-image, video, all or a comma list: tiny/media_prompts.py's kinds) the prompts
are the media token gate's instead (gates/media.py: the same synthetic images and videos, expanded by
deltaserve's processor, fed to the composite `*ForConditionalGeneration` class with their pixel values and grids),
one verdict line per kind; the check passes when every kind does (issue 14's vision checkpoints).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

MIN_AGREE = 30
OF_PROMPTS = 32


def required(num_prompts: int) -> int:
    """Prompts that must agree: 30 of 32, the same share (rounded up) for other counts."""
    return math.ceil(num_prompts * MIN_AGREE / OF_PROMPTS)


def check_conditioning(
    model_dir: Path,
    num_prompts: int = 32,
    max_tokens: int = 32,
    seed: int = 0,
    max_prompt_len: int = 160,
    device: str = "cpu",
    media: str | None = None,
) -> int:
    """Exit code 0 when well conditioned, 1 when not (or the reference is refused), 2 with nothing to check."""
    from transformers import AutoTokenizer

    if media is not None:
        return check_media_conditioning(model_dir, media, num_prompts, max_tokens, seed, device)

    from deltaserve.gates.references import ReferenceError, TransformersReference
    from deltaserve.gates.tokens import make_prompts

    if num_prompts < 1 or max_tokens < 1:
        print("conditioning: nothing to check")
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, num_prompts, max_prompt_len, seed)
    try:
        runs = {dtype: TransformersReference(model_dir, dtype, device).run(prompts, max_tokens) for dtype in
                ("bfloat16", "float32")}  # fmt: skip
    except ReferenceError as exc:
        print(f"conditioning: REFUSED: {exc}")
        return 1
    num_agree = sum(a == b for a, b in zip(runs["bfloat16"].tokens, runs["float32"].tokens, strict=True))
    need = required(num_prompts)
    verdict = "well conditioned" if num_agree >= need else "NOT well conditioned"
    print(
        f"conditioning: {model_dir}: transformers-bfloat16 vs transformers-float32 STRICT {num_agree}/{num_prompts} "
        f"({max_tokens} greedy tokens each, on {device}; need >= {need}): {verdict}"
    )
    return 0 if num_agree >= need else 1


def check_media_conditioning(
    model_dir: Path, media: str, num_prompts: int = 32, max_tokens: int = 32, seed: int = 0, device: str = "cpu"
) -> int:
    """The media gate's prompts of each kind in `media` through transformers in bf16 and fp32: 0 when every kind
    agrees on >= required(N) prompts, 1 when one does not (or is refused), 2 with nothing to check."""
    import torch

    from deltaserve import env
    from deltaserve.config import ModelConfig
    from deltaserve.tiny.media_prompts import media_kinds

    kinds = media_kinds(media)
    if num_prompts < 1 or max_tokens < 1:
        print("conditioning: nothing to check")
        return 2
    config = ModelConfig.from_pretrained(model_dir)
    if config.vision is None:
        print(f"conditioning: nothing to check: {model_dir} has no vision tower, so it has no {media} prompts")
        return 2
    saved_threads = torch.get_num_threads()
    if device == "cpu":
        # the media gate's CPU rule (the engine's): one thread for a tiny model unless the environment names a count
        threads = env.cpu_threads_for(config.hidden_size)
        torch.set_num_threads(threads or saved_threads)
    try:
        return _media_verdicts(model_dir, kinds, media, num_prompts, max_tokens, seed, device)
    finally:
        torch.set_num_threads(saved_threads)


def _media_verdicts(
    model_dir: Path, kinds: tuple[str, ...], media: str, num_prompts: int, max_tokens: int, seed: int, device: str
) -> int:
    from transformers import AutoTokenizer

    from deltaserve.gates.media import MediaTransformersReference
    from deltaserve.gates.references import ReferenceError
    from deltaserve.tiny.media_prompts import MediaRefusedError, make_media_prompts, process_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        processed = {
            kind: process_prompts(model_dir, tokenizer, make_media_prompts(tokenizer, kind, num_prompts, seed))
            for kind in kinds
        }
    except MediaRefusedError as exc:
        print(f"conditioning: nothing to check: deltaserve refuses {media} prompts on {model_dir}: {exc}")
        return 2
    runs: dict[str, dict[str, list[list[int]]]] = {}
    try:
        for dtype in ("bfloat16", "float32"):
            reference = MediaTransformersReference(model_dir, dtype, device)
            runs[dtype] = {kind: reference.run_media(processed[kind], max_tokens).tokens for kind in kinds}
            del reference
    except ReferenceError as exc:
        print(f"conditioning: REFUSED: {exc}")
        return 1
    need = required(num_prompts)
    code = 0
    for kind in kinds:
        pairs = zip(runs["bfloat16"][kind], runs["float32"][kind], strict=True)
        num_agree = sum(a == b for a, b in pairs)
        verdict = "well conditioned" if num_agree >= need else "NOT well conditioned"
        print(
            f"conditioning: {model_dir}: {kind} prompts: transformers-bfloat16 vs transformers-float32 STRICT "
            f"{num_agree}/{num_prompts} ({max_tokens} greedy tokens each, on {device}; need >= {need}): {verdict}"
        )
        code = code if num_agree >= need else 1
    return code


def main(argv: list[str] | None = None) -> int:
    # media_prompts pulls in torch and numpy: imported here, so that importing this module stays cheap
    from deltaserve.tiny.media_prompts import media_argument

    parser = argparse.ArgumentParser(prog="python -m deltaserve.gates.conditioning", description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where transformers runs (the CI check runs on the CPU)")
    parser.add_argument(
        "--media",
        type=media_argument,
        default=None,
        help="the media gate's prompts instead of text: image, multi-image, video, all or a comma-separated list",
    )
    args = parser.parse_args(argv)
    return check_conditioning(
        args.model_dir, args.num_prompts, args.max_tokens, args.seed, device=args.device, media=args.media
    )


if __name__ == "__main__":
    sys.exit(main())
