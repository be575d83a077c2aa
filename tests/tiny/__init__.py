"""Tests of the tiny checkpoints: the generator, the trained recipe and the vision variants."""
