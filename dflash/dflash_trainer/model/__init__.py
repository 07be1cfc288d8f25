"""The drafter and its objective: the DFlash drafter, anchors, the block mask, attention, the loss and
its CE kernel, FLOP counts and the optimizer. The math never sees the run config."""
