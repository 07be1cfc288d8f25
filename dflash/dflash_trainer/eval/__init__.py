"""dflash-eval: judge a drafter by real speculative decoding on prompt sets (tau, speedup, a figure)."""
