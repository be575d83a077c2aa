"""A stand-in `vllm` package for the CPU image grid: `python -m vllm.entrypoints.cli.main serve MODEL FLAGS` runs
`deltaserve serve MODEL FLAGS` (deltaserve takes vLLM's serve flags), so the registry's exact peer command line,
with or without --language-model-only, is what a real server answers images with."""

__version__ = "0.26.0+deltaserve-stand-in"
