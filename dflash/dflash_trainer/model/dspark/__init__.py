"""DSpark (speculators): a DFlash drafter with a low-rank Markov logit-bias head and a confidence head."""
