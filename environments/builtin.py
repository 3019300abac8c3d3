"""The built-in environments, registered by name (environments/registry.py imports this module).

- ``python``: one tool, ``python`` with arguments ``{"code": str}``: a stateful Python executor per trajectory,
  each call run in the code sandbox, its state kept by replaying the earlier cells (environments/python_tool.py).
- ``calculator``: one tool, ``calculator`` with arguments ``{"expression": str}``: arithmetic on numbers,
  evaluated from the syntax tree with bounded sizes (environments/calculator.py).

Both are ``ToolEnvironment``s (environments/base.py): the calls of the turn parsed from its text, at most
``max_calls_per_turn`` run, each output cut to ``max_output_chars``.
"""

from __future__ import annotations

from .base import EnvSettings, ToolEnvironment
from .calculator import calculator
from .python_tool import PythonTool
from .registry import register_environment


@register_environment("python")
class PythonEnvironment(ToolEnvironment):
    def __init__(self, settings: EnvSettings) -> None:
        super().__init__(settings, {"python": PythonTool(settings)})


@register_environment("calculator")
class CalculatorEnvironment(ToolEnvironment):
    def __init__(self, settings: EnvSettings) -> None:
        super().__init__(settings, {"calculator": calculator})
