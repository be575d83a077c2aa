"""Stage package: sampler."""
