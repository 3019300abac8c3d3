"""``data.map``: a row transform of yours, applied to every raw record before its fields are read.

    fn = load_row_map("my_layout.py:to_row")   # DataError naming data.map when it cannot be loaded
    fn({"question": "2+2?", "meta": {"answer": "4"}})  # -> {"prompt": "2+2?", "answer": "4"}, or None: skip

Loaded once, at the start of preparation (data/prepare.py), with the same loader
as ``verifier.plugins`` (a dotted module name, or a path to a ``.py`` file). What
the function raises on a row is that row's problem, reported as
``FILE:LINE: data.map raised ValueError: ...``; returning None skips the row
(counted as "dropped by data.map", not a bad row: a filter is on purpose).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .rows import BadRow
from .sources import DataError

RowMap = Callable[[dict], dict | None]
DROPPED = "dropped by data.map"


def load_row_map(entry: str) -> RowMap | None:
    """The function ``data.map`` names (None for ""); DataError saying what is wrong."""
    if not entry:
        return None
    from cascade_rl.verifiers.registry import PluginError, load_plugin

    module_name, _, name = entry.rpartition(":")
    if not module_name or not name:
        raise DataError(f"data.map={entry}: not module:function or path/to/file.py:function")
    try:
        module = load_plugin(module_name, "data.map")
    except PluginError as e:
        raise DataError(str(e)) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise DataError(f"data.map={entry}: {module_name} has no function {name!r}")
    return fn


def apply_row_map(fn: RowMap, raw: Any) -> Any:
    """``fn(raw)``; what it raises becomes a bad row (BadRow), never a traceback."""
    try:
        return fn(raw)
    except Exception as e:  # the user's code: any exception is this row's problem
        raise BadRow("data.map raised", f"data.map raised {type(e).__name__}: {e}") from None
