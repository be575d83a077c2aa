"""Scheduler tests: the real scheduler driven with plain-data plans and fake runner results."""
