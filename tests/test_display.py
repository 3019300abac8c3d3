"""The supervisor's console lines that name a path keep it on one line, whatever the terminal's width: a path
broken by an inserted newline cannot be pasted (the stall report's, the logs' of a failed run)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from cascade_rl.supervisor.display import Display


def test_a_long_path_is_printed_unbroken():
    display = Display("plain", 3, Path("/tmp/" + "d" * 120 + "/run"))
    out = io.StringIO()
    display.console = Console(file=out, width=80)
    display.notice(f"stalled\n(every worker: {display.run_dir / 'stall.txt'})")
    display.failed("interrupted")
    assert str(display.run_dir / "stall.txt") in out.getvalue()
    assert str(display.run_dir / "logs") in out.getvalue()
