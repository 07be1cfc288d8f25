"""Compiling safely: one GPU per process before CUDA starts, the shared compile cache, the variants a
step compiles, and the fail-fast guard once training runs (no recompiles, no dense fallback)."""
