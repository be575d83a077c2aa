"""`deltaserve generate`: offline generation from prompts given on the command line (greedy by default)."""

from __future__ import annotations

import argparse
import json
import logging

from deltaserve import default_model, env
from deltaserve.model.preflight import report_startup_error
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger("deltaserve.generate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in tiny model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks to shard the model over")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run(args: argparse.Namespace) -> int:
    from deltaserve.engine.llm import LLM

    model = args.model if args.model is not None else str(default_model.model_dir())
    try:
        llm = LLM(model, dtype=args.dtype, load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size)
    except Exception as exc:  # a start-up error is one line naming the file (the traceback only when debugging)
        return report_startup_error(exc, env.log_level() == "DEBUG", logger)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    for output in llm.generate(args.prompts, params):
        completion = output.outputs[0]
        if args.json:
            record = {"prompt": output.prompt, "text": completion.text, "token_ids": completion.token_ids,
                      "finish_reason": completion.finish_reason}  # fmt: skip
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0
