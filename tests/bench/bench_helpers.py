"""Helpers shared by the benchmark-harness tests: a fast tokenizer adapter and an in-thread server.

The adapter wraps the `tokenizers` library with the four attributes the dataset needs, so most tests do not
import transformers (seconds on a loaded machine); the CPU grid test covers the real transformers path.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web
from tokenizers import Tokenizer

from tests.support.ports import free_port


class WordTokenizer:
    """The Hugging Face tokenizer surface the random dataset uses, over a tokenizers.Tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.all_special_ids = [self.vocab_size - 1]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def num_special_tokens_to_add(self) -> int:
        return 0


def serve_in_thread(app: web.Application) -> Iterator[str]:
    """Run an aiohttp app on a free port in a background event loop; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()
