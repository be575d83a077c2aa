"""Multimodal tests: media loading, the request-side processor and its parity with transformers' processors."""
