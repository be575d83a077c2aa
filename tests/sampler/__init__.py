"""Sampler tests: each sampling rule against a hand computation in plain torch."""
