"""Hydra configs of cascade-rl (a package so that an installed wheel carries them)."""
