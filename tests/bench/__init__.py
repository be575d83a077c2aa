"""Benchmark-harness tests: the client, datasets, metrics, the grid and its report, against fake and real servers."""
