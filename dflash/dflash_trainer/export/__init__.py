"""dflash-export: a published drafter in another project's format (speculators' so far)."""
