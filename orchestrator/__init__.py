"""The orchestrator: the hub of the data plane (docs/ARCHITECTURE.md §2)."""
