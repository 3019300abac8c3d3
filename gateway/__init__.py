"""The run's OpenAI-compatible gateway for users' agents (docs/ARCHITECTURE.md §14)."""
