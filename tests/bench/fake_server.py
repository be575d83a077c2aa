"""A stand-in OpenAI-compatible server with vLLM's surface, for testing the benchmark client and the grid.

It serves /health, /version, /v1/models (with `root`), /tokenize, /detokenize and streaming /v1/completions (one SSE
event per token after `--ttft-ms`, `--itl-ms` apart, then a usage-only event and [DONE]), using the `tokenizers`
library on the checkpoint's tokenizer.json. Streaming /v1/chat/completions answers the same way (a role chunk with
the first token, then content deltas) and counts each image_url part (a base64 data URL that Pillow must open) as
FAKE_IMAGE_TOKENS prompt tokens, over every message (string or parts content); its request bodies are kept in
app[CHAT_BODIES] (/v1/completions' in app[COMPLETION_BODIES]). For multi-turn tests, `has_prefix_cache` reports
usage.prompt_tokens_details.cached_tokens as a toy prefix cache would (the longest common prefix of the prompt's
token ids with any earlier chat prompt's) and exports its token totals on /metrics under vLLM's counter names (the
hits split over two engine labels, as a data-parallel vLLM reports them), and `is_answer_per_request` makes answer i
start at token t{i}, so each answer differs from the others; `jit_lines` logs a JIT monitor's line at the Nth
completion request. Run as a script it is a grid arm: `python
tests/bench/fake_server.py MODEL_DIR --port P [--itl-ms 2]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer

FAKE_IMAGE_TOKENS = 64
CHAT_BODIES = web.AppKey("chat_bodies", list)
COMPLETION_BODIES = web.AppKey("completion_bodies", list)


def make_word_tokenizer(model_dir: Path, vocab_size: int = 1000) -> Path:
    """A word-level tokenizer (ids round-trip exactly, like the dummy H200 checkpoints') in `model_dir`."""
    from tokenizers import models, pre_tokenizers

    model_dir.mkdir(parents=True, exist_ok=True)
    words = {f"t{i}": i for i in range(vocab_size)}
    del words[f"t{vocab_size - 1}"]
    words["<|endoftext|>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 4096}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


def build_app(
    model_dir: Path,
    ttft_ms: float = 5.0,
    itl_ms: float = 1.0,
    tokens_per_event: int = 1,
    has_tokenize: bool = True,
    has_prefix_cache: bool = False,
    is_answer_per_request: bool = False,
    jit_lines: dict[int, str] | None = None,
) -> web.Application:
    """The aiohttp application; `tokens_per_event` > 1 mimics --stream-interval / multi-token chunks."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model_id = str(model_dir)
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    @routes.get("/version")
    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "fake-0.0.1"})

    @routes.get("/v1/models")
    async def models(request: web.Request) -> web.Response:
        card = {"id": model_id, "object": "model", "owned_by": "vllm", "root": model_id, "max_model_len": 4096}
        return web.json_response({"object": "list", "data": [card]})

    if has_tokenize:

        @routes.post("/tokenize")
        async def tokenize(request: web.Request) -> web.Response:
            body = await request.json()
            ids = tokenizer.encode(body["prompt"], add_special_tokens=False).ids
            return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 4096})

        @routes.post("/detokenize")
        async def detokenize(request: web.Request) -> web.Response:
            body = await request.json()
            return web.json_response({"prompt": tokenizer.decode(body["tokens"], skip_special_tokens=False)})

    completion_bodies: list[dict[str, Any]] = []

    @routes.post("/v1/completions")
    async def completions(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        completion_bodies.append(body)
        name = (jit_lines or {}).get(len(completion_bodies))
        if name:  # the line a JIT monitor logs when this request's step compiles a kernel (NAME@CuTeDSL: vLLM's
            # line for its CuTeDSL backend)
            kernel, _, backend = name.partition("@")
            event = f"{backend} JIT compilation" if backend else "Triton kernel JIT compilation"
            print(f"WARNING {event} during inference: {kernel}. This causes a latency spike", flush=True)
        num_prompt = len(tokenizer.encode(body["prompt"], add_special_tokens=False).ids)
        num_tokens = int(body.get("max_tokens", 16))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": ping\n\n")
        await asyncio.sleep(ttft_ms / 1000)
        num_sent = 0
        while num_sent < num_tokens:
            num_chunk = min(tokens_per_event, num_tokens - num_sent)
            text = "".join(f" t{(num_sent + k) % 100}" for k in range(num_chunk))
            num_sent += num_chunk
            finish = "length" if num_sent == num_tokens else None
            event = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            if num_sent < num_tokens:
                await asyncio.sleep(itl_ms / 1000)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens, "total_tokens": num_prompt + num_tokens}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    chat_bodies: list[dict[str, Any]] = []
    chat_prompts: list[list[int]] = []
    counters = {"queries": 0, "hits": 0}

    if has_prefix_cache:

        @routes.get("/metrics")
        async def metrics(request: web.Request) -> web.Response:
            label = 'vllm:{}_total{{engine="{}",model_name="m"}} {}'
            lines = ["# TYPE vllm:prefix_cache_queries counter", label.format("prefix_cache_queries", 0,
                     float(counters["queries"])), "# TYPE vllm:prefix_cache_hits counter",
                     label.format("prefix_cache_hits", 0, float(counters["hits"] // 2)),
                     label.format("prefix_cache_hits", 1, float(counters["hits"] - counters["hits"] // 2))]  # fmt: skip
            return web.Response(text="\n".join(lines) + "\n")

    def longest_cached_prefix(ids: list[int]) -> int:
        best = 0
        for earlier in chat_prompts:
            n = 0
            for a, b in zip(earlier, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    @routes.post("/v1/chat/completions")
    async def chat(request: web.Request) -> web.StreamResponse:
        import base64
        import io

        from PIL import Image

        body: dict[str, Any] = await request.json()
        chat_bodies.append(body)
        num_request = len(chat_bodies) - 1
        num_prompt = 0
        prompt_ids: list[int] = []
        for message in body["messages"]:
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part["type"] == "text":
                    ids = tokenizer.encode(part["text"], add_special_tokens=False).ids
                    prompt_ids.extend(ids)
                    num_prompt += len(ids)
                elif part["type"] == "image_url":
                    header, data = part["image_url"]["url"].split(",", 1)
                    if header != "data:image/jpeg;base64":
                        return web.json_response({"error": {"message": header}}, status=400)
                    Image.open(io.BytesIO(base64.b64decode(data))).load()
                    num_prompt += FAKE_IMAGE_TOKENS
        num_tokens = int(body["max_completion_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(ttft_ms / 1000)
        num_cached = longest_cached_prefix(prompt_ids) if has_prefix_cache else None
        chat_prompts.append(prompt_ids)
        if num_cached is not None:
            counters["queries"] += len(prompt_ids)
            counters["hits"] += num_cached
        first = num_request if is_answer_per_request else 0
        for i in range(num_tokens):
            delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f" t{(first + i) % 100}"}
            finish = "length" if i == num_tokens - 1 else None
            event = {
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(itl_ms / 1000)
        usage: dict[str, Any] = {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_tokens,
            "total_tokens": num_prompt + num_tokens,
        }
        if num_cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": num_cached}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app[CHAT_BODIES] = chat_bodies
    app[COMPLETION_BODIES] = completion_bodies
    app.add_routes(routes)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ttft-ms", type=float, default=5.0)
    parser.add_argument("--itl-ms", type=float, default=1.0)
    parser.add_argument(
        "--jit-lines", default="", help="N:NAME[@BACKEND],...: log a JIT-compile line at the Nth completion"
    )
    parser.add_argument("--start-line", default=None, help="a line to log at start-up, as a server's start-up log")
    args = parser.parse_args()
    if args.start_line:
        print(args.start_line, flush=True)
    jit_lines = {int(n): name for n, name in (item.split(":") for item in args.jit_lines.split(",") if item)}
    app = build_app(Path(args.model), args.ttft_ms, args.itl_ms, jit_lines=jit_lines)
    web.run_app(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
