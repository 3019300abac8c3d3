"""What the console of a launch or a cascade may hold (supervisor/console.py): the supervisor's own lines only.

    sys.path.insert(0, "tests/helpers"); from console_lines import foreign_lines
    assert not foreign_lines(out), foreign_lines(out)     # out: the run's stdout and stderr together
"""

from __future__ import annotations

import re

# a dependency's output: Python warnings, a library's logging or traceback frames, math-verify's warning, tqdm bars
DEPENDENCY = re.compile(r"Warning:|warnings\.warn|Timeout is disabled|FutureWarning|UserWarning|DeprecationWarning"
                        r"|site-packages/|dist-packages/|\[transformers\]|it/s\]|Loading weights|Writing model shards")

# what the supervisor prints itself (supervisor/display.py in plain mode, run_data.py, cascade.py): the run dir, the
# data it prepared, a progress line per step, the summary table (rich's box), its notices, the cascade's lines
SUPERVISOR = re.compile(r"run_dir: |summary: |data: |step \d+/\d+ \| |cascade: |\s*run summary\s*$|[┌┬┐├┼┤└┴┘│─┏┃┡━╇┗┛┓┳┻╋]"
                        r"|run failed: |stall|restart|logger=\w+ failed")


def foreign_lines(out: str) -> list[str]:
    """The lines of ``out`` the supervisor does not print, and every line that looks like a dependency's."""
    return [line for line in out.splitlines()
            if line.strip() and (DEPENDENCY.search(line) or not SUPERVISOR.match(line))]
