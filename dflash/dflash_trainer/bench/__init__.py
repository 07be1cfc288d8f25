"""Benchmarks: the drafter step at a real model's shape, the start-up, the regeneration engine and the
evaluation loops, with random weights."""
