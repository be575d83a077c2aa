"""`python -m tests.api.hostile_server PORT`: the hostile suite's server, the FakeEngine behind a real uvicorn, in
its own process, so that /health latencies measure the server alone (not the test client sharing its GIL)."""

from __future__ import annotations

import sys

import uvicorn

from deltaserve.api.server import build_app
from deltaserve.api.settings import ServerSettings

from .fake_engine import FakeEngine, build_tokenizer

MODEL_NAME = "fake-qwen"
BODY_LIMIT = 4 * 2**20
# the 256 MiB case writes its way to the bound: ~1.3 s on a loaded 2-core box (1 s timed out there first)
TEMPLATE_TIMEOUT_S = 3.0
TEMPLATE_MEMORY_BYTES = 256 * 2**20


def hostile_settings() -> ServerSettings:
    """Trusting request chat templates (so hostile ones are rendered), a 4 MiB body limit, a 3 s and 256 MiB
    template bound."""
    return ServerSettings(
        model_root="/models/fake-qwen",
        served_model_names=[MODEL_NAME],
        reasoning_parser="qwen3",
        tool_call_parser="qwen3_coder",
        enable_auto_tool_choice=True,
        trust_request_chat_template=True,
        max_request_body_bytes=BODY_LIMIT,
        template_timeout_s=TEMPLATE_TIMEOUT_S,
        template_memory_bytes=TEMPLATE_MEMORY_BYTES,
    )


def main(port: int) -> None:
    app = build_app(FakeEngine(build_tokenizer()), hostile_settings())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(int(sys.argv[1]))
