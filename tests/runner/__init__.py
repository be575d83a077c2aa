"""Runner tests: warm-up plans, tensor parallelism across processes, the decode CUDA graphs and async scheduling."""
