"""The flags of `deltaserve bench serve` and what they resolve to before a run.

`add_arguments` declares vLLM's flag names for everything the client supports (and our own `--warmup-distinct`,
multi-turn and provenance flags); the helpers here read the parsed flags the way vLLM does: the input and output
lengths with their `--input-len` / `--output-len` aliases, the prefix_repetition options (where `--output-len` wins),
and the pairing of dataset, backend and endpoint that vLLM refuses before sending anything. serve_cli.py runs the
benchmark from them.
"""

from __future__ import annotations

import argparse
import json
import math

from deltaserve.bench.dataset_mm import add_mm_arguments
from deltaserve.bench.dataset_prefix import PrefixOptions
from deltaserve.bench.multi_turn import DATASET_NAME as MULTI_TURN
from deltaserve.bench.multi_turn import add_multi_turn_arguments, check_multi_turn

CHAT_BACKENDS = ("openai-chat",)
# the datasets whose requests are sent with ignore_eos unless told otherwise: vLLM's random ones, and our multi-turn
# mode (its answers have exact lengths, so every engine re-sends the same history)
IGNORE_EOS_DATASETS = ("random", "random-mm", MULTI_TURN)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flag names for everything this client supports."""
    server = parser.add_argument_group("server")
    server.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm", "openai", "openai-chat"],
        help="vllm/openai: /v1/completions; openai-chat: chat payloads (pass --endpoint /v1/chat/completions)",
    )
    server.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions")
    server.add_argument("--model", default=None, help="default: data[0].id of GET /v1/models")
    server.add_argument("--served-model-name", default=None, help="the request's model field, if not --model")
    server.add_argument("--tokenizer", default=None, help="default: data[0].root of GET /v1/models")
    server.add_argument("--trust-remote-code", action="store_true")
    server.add_argument(
        "--no-server-tokenize",
        action="store_true",
        help="do not align prompt lengths with the server's /tokenize and /detokenize",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name", default="random", choices=["random", "random-mm", "prefix_repetition", MULTI_TURN]
    )
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument("--input-len", type=int, default=None, help="alias of --random-input-len")
    data.add_argument("--output-len", type=int, default=None, help="alias of --random-output-len")
    add_mm_arguments(data)
    add_multi_turn_arguments(data)
    defaults = PrefixOptions()
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=defaults.prefix_len)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=defaults.suffix_len)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=defaults.num_prefixes)
    data.add_argument("--prefix-repetition-output-len", type=int, default=defaults.output_len)
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0)
    load.add_argument(
        "--warmup-distinct",
        action="store_true",
        help="warm-ups send prompts drawn apart from the measured ones (vLLM's client sends the first measured "
        "prompt, which a server with prefix caching then serves from its cache)",
    )
    load.add_argument("--request-id-prefix", default=None)
    load.add_argument("--disable-tqdm", action="store_true")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on for random and random-mm (as vLLM forces it), off for prefix_repetition",
    )
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request")

    metrics = parser.add_argument_group("metrics and results")
    metrics.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft/tpot/e2el in ms")
    metrics.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    metrics.add_argument("--metric-percentiles", default="99")
    metrics.add_argument("--save-result", action="store_true")
    metrics.add_argument("--save-detailed", action="store_true")
    metrics.add_argument("--result-dir", default=None)
    metrics.add_argument("--result-filename", default=None)
    metrics.add_argument("--label", default=None)
    metrics.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    metrics.add_argument("--gpu-indices", default=None, help="comma-separated NVML indices to sample (default all)")


def resolve_lengths(args: argparse.Namespace) -> tuple[int, int]:
    input_len = args.input_len if args.input_len is not None else args.random_input_len
    output_len = args.output_len if args.output_len is not None else args.random_output_len
    return input_len, output_len


def prefix_options(args: argparse.Namespace) -> PrefixOptions:
    """The prefix_repetition flags; `--output-len` overrides the output length, as in vLLM."""
    output_len = args.output_len if args.output_len is not None else args.prefix_repetition_output_len
    return PrefixOptions(
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
        args.prefix_repetition_num_prefixes,
        output_len,
    )


def check_endpoint(args: argparse.Namespace) -> bool:
    """vLLM's pairing rules: random-mm needs openai-chat, whose URL must end in chat/completions (a chat payload
    sent to /v1/completions would fail every request). Returns whether the run is a chat run; raises ValueError."""
    is_chat = args.backend in CHAT_BACKENDS
    if args.dataset_name == MULTI_TURN:
        check_multi_turn(args)
    if args.dataset_name == "random-mm" and not is_chat:
        raise ValueError("Multi-modal content (images) is only supported on 'openai-chat' backend.")
    if is_chat and not args.endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"OpenAI Chat Completions API URL must end with chat/completions, got {args.endpoint}")
    return is_chat
