"""deltaserve's test suite: a package, so that its subpackages (tests.kernels, tests.model, ...) never shadow top-level
distributions such as Hugging Face's `kernels`, which transformers >= 5.25 imports."""
