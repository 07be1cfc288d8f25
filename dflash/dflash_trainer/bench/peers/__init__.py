"""Peers' DFlash drafters trained on our features: one adapter per peer (SpecForge, vLLM speculators), each
running the peer's own model, loss and step from its installed package; docs/quality.md says what is whose."""
