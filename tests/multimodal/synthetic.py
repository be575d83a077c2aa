"""Deterministic synthetic images and videos (integer arithmetic only, numpy only), so the fixture script and the
tests build bit-identical inputs in any environment. They live in the package (the media token gate builds its
prompts from them); this module keeps the tests' import path."""

from __future__ import annotations

from deltaserve.tiny.media_prompts import synthetic_image, synthetic_video

__all__ = ["synthetic_image", "synthetic_video"]
