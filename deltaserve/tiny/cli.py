"""`deltaserve make-tiny DIR`: write a tiny random checkpoint (dense, moe or next) and print where and how big.

`--trained` copies the shipped trained checkpoint of the variant instead (deltaserve/tiny/trained.py); the
recipe that made it is `python -m deltaserve.tiny.train DIR --variant V`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deltaserve.tiny.spec import EXPERT_LAYOUTS, VARIANTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="folder to write (replaced if it holds a checkpoint)")
    parser.add_argument("--variant", choices=VARIANTS, default="dense", help="checkpoint family (default: dense)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share embed_tokens with lm_head (default: tied for dense, untied for moe and next)",
    )
    parser.add_argument(
        "--expert-layout",
        choices=EXPERT_LAYOUTS,
        default=None,
        help="routed-expert tensors (default: fused for moe, per_expert for next; ignored for dense)",
    )
    parser.add_argument("--num-shards", type=int, default=2, help="safetensors shards (default: 2; 1 = no index)")
    parser.add_argument(
        "--trained",
        action="store_true",
        help="copy the shipped trained (well-conditioned) checkpoint of the variant instead of random weights",
    )


def _folder_size_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def run(args: argparse.Namespace) -> int:
    if args.trained:
        from deltaserve.tiny.trained import copy_trained

        folder = copy_trained(args.dir, args.variant)
        print(f"{folder.resolve()}  ({args.variant}, trained, {_folder_size_bytes(folder) / 2**20:.1f} MiB)")
        return 0
    # Imported here so that `--help` does not pay for torch.
    from deltaserve.tiny.generate import make_tiny

    folder = make_tiny(
        args.dir,
        args.variant,
        args.seed,
        tie_word_embeddings=args.tie_word_embeddings,
        expert_layout=args.expert_layout,
        num_shards=args.num_shards,
    )
    size_mib = _folder_size_bytes(folder) / 2**20
    print(f"{folder.resolve()}  ({args.variant}, {size_mib:.1f} MiB)")
    return 0
