"""vllm.entrypoints.cli of the stand-in package (see vllm/__init__.py)."""
