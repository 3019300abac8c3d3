"""Learner side: orchestrator (data-plane hub), trainer, losses, SFT, tasks, tiny-model builder."""
