"""PrimeIntellect's ``verifiers`` package (PyPI, not this folder) and the environment ``data.verifiers_env`` names:
loaded the same way by the supervisor (its dataset: data/verifiers_source.py) and by the environment workers (its
rollouts: environments/verifiers_rollout.py).

``import verifiers`` must find the PyPI package, not this repository's ``verifiers/`` folder: the workers run with
``python -P``, the supervisor drops the checkout from sys.path first (supervisor/run_data.py).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .registry import load_plugin


def import_vf() -> ModuleType:
    """PrimeIntellect's ``verifiers`` package; ImportError saying why when it is missing or shadowed."""
    try:
        import verifiers
    except ImportError as e:
        raise ImportError(f"data.verifiers_env needs PrimeIntellect's `verifiers` package (make install): {e}") from e
    if getattr(verifiers, "Environment", None) is None:
        raise ImportError(f"`import verifiers` found {verifiers.__file__}, not PrimeIntellect's package: run with "
                          "`python -P` (or from another folder) so the repository root is not on sys.path")
    return verifiers


def load_verifiers_env(entry: str, args: dict[str, Any] | None = None, setting: str = "data.verifiers_env"):
    """The environment of ``entry`` (a module name or a .py path exposing ``load_environment``), built with
    ``args``; PluginError (cascade_rl/verifiers/registry.py) or TypeError naming what is wrong."""
    vf = import_vf()
    module = load_plugin(entry, setting)
    build = getattr(module, "load_environment", None)
    if not callable(build):
        raise TypeError(f"{setting}: {entry} has no load_environment() function")
    env = build(**dict(args or {}))
    if not isinstance(env, vf.Environment):
        raise TypeError(f"{setting}: {entry}'s load_environment() returned a {type(env).__name__}, not a "
                        "verifiers Environment")
    return env
