"""Supervisor: the cascade-rl CLI, launch config, process lifecycle and live display."""
