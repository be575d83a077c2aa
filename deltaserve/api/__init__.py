"""deltaserve.api: the OpenAI-compatible HTTP server of `deltaserve serve`, with vLLM's API surface."""
