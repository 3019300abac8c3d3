"""Environments of multi-turn tool-using rollouts: the model's tool calls in, tool turns out, and the worker that
serves them (environments/worker.py). See environments/registry.py to add your own."""
