"""Ranks and what travels between them: process groups and roles, the feature transport from target
ranks to drafter ranks, the feature sources of a step, and the drafter's DDP/FSDP sharding."""
