"""Verifiers: reward functions by domain and the verifier worker."""
