"""Environments by name: a multi-turn row names the environment its tool calls run in.

Built in (environments/builtin.py): ``python`` (a stateful Python executor in the code sandbox) and
``calculator`` (safe arithmetic); ``swe`` (environments/swe.py: a repository to read, edit and test). Add your
own in a module listed in ``environment.plugins``, by module name (``mypkg.envs``: importable by the
environment workers, which do not have the cwd on ``sys.path``) or by path to a ``.py`` file; the launcher and
every environment worker import them first (``load_environments``).

A registered environment is a factory ``factory(settings: EnvSettings) -> Environment``, called once per
worker: usually a class. Its ``step(messages, state, metadata) -> StepResult`` is called from several threads
at once, for different trajectories: keep per-trajectory data in ``state``, not on ``self``
(environments/base.py says what a step gets and returns).

Example plugin, ``envs.py`` (``environment.plugins=[envs.py]``)::

    from cascade_rl.environments.base import ToolEnvironment, ToolOutcome, string_argument
    from cascade_rl.environments.registry import register_environment

    def shout(arguments: dict, state: dict) -> ToolOutcome:
        state["shouts"] = state.get("shouts", 0) + 1
        return ToolOutcome(string_argument(arguments, "text").upper())

    @register_environment("shouting")
    class Shouting(ToolEnvironment):
        def __init__(self, settings):
            super().__init__(settings, {"shout": shout})
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TypeVar

from cascade_rl.protocol.registry import Registry
from cascade_rl.verifiers.registry import PluginError
from cascade_rl.verifiers.registry import load_plugins as _load_plugins

from .base import Environment, EnvSettings

F = TypeVar("F", bound=Callable[..., Environment])

ENVIRONMENTS = Registry("environment")  # name -> factory(settings) -> Environment

__all__ = ["ENVIRONMENTS", "PluginError", "build_environment", "load_environments", "load_plugins",
           "register_environment"]


def register_environment(name: str) -> Callable[[F], F]:
    """Decorator: ``factory(settings) -> Environment`` is the environment ``name``; a second one raises
    ValueError."""
    return ENVIRONMENTS.register(name)


def build_environment(name: str, settings: EnvSettings | None = None) -> Environment:
    """The environment ``name``, built with ``settings`` (default: ``EnvSettings()``); KeyError naming the
    registered ones if there is none of that name."""
    return ENVIRONMENTS[name](settings or EnvSettings())


def load_environments(entries: Iterable[str]) -> list[ModuleType]:
    """Import the ``environment.plugins`` entries (module names or .py paths: the verifiers' ``load_plugins``),
    whose ``@register_environment``s run; PluginError names a bad entry. Loading again is harmless."""
    return _load_plugins(entries, setting="environment.plugins")


load_plugins = load_environments  # the name the verifiers' registry uses for the same thing


from . import builtin, swe  # noqa: E402, F401  (register the built-in environments; they import register_environment)
