"""Kernel tests: every Triton launcher against its torch `*_ref` twin (the interpreter on CPU, native on CUDA)."""
