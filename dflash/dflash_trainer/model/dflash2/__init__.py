"""DFlash 2 (z-lab): grouped dynamic causal convolutions in every drafter layer, and a candidate selector."""
