"""The frozen target: its tapped forward that yields the drafter's features, the family checks, the
RoPE and scales the drafter borrows, FP8 GEMMs, and the target sharded over a tensor-parallel group."""
