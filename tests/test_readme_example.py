"""The README's worked example, run verbatim: a user's JSONL (math and a domain of their own, chat messages,
metadata) and reward module in a directory outside the repository, checked and trained through
`cascade-rl launch` with every role a real process. Two domains: the books close and the held-out accuracy
is reported per domain."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def worked_example() -> str:
    text = README.read_text()
    block = re.search(r"<!-- worked-example:start -->\n```bash\n(.*?)```\n<!-- worked-example:end -->", text, re.S)
    assert block, "README.md lost its worked example (the markers around it)"
    return block[1]


@pytest.mark.slow
def test_the_readme_worked_example_trains_a_users_data_and_reward(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    venv = README.parent / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve():  # run by another interpreter: activate that one instead
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    script = worked_example()
    if Path(sys.prefix).resolve() != venv.resolve():
        script = script.replace("source .venv/bin/activate\n", "")
    # from the clone's root, as a user types it; the example moves itself to a fresh directory (mktemp -d)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                       env=env, cwd=README.parent, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (work,) = [p for p in tmp_path.iterdir() if (p / "my_rewards.py").exists()]  # mktemp -d, outside the repo
    assert "every row is valid" in r.stdout and "brevity" in r.stdout  # data check, before the launch

    summary = json.loads((work / "run" / "summary.json").read_text())
    books, steps, groups, g = summary["books"], 3, 8, 4  # configs/run/tiny.yaml
    assert books["trained"] == steps * groups * g and books["lost"] == 0 and books["in_flight"] == 0
    assert books["dispatched"] == books["trained"] + books["filtered"] + books["stale"]
    assert set(summary["heldout_domains"]) == {"math", "brevity"}  # per-domain held-out accuracy
    assert all(0.0 <= d["before"] <= 1.0 and 0.0 <= d["after"] <= 1.0 for d in summary["heldout_domains"].values())
    data = summary["data"]
    assert data["bad_rows"] == {} and sum(data["rows"].values()) + sum(data["dropped"].values()) == 400
    assert 0 < data["domains"]["eval"]["math"] <= 16 and 0 < data["domains"]["eval"]["brevity"] <= 16  # ~10 %
    assert data["domains"]["train"]["math"] > 150  # held out by prompt hash; the tiny preset evaluates <= 16
    # the user's reward scored its domain in the verifier workers (a verifier that failed would say why)
    verifiers = [w for w in summary["workers"] if w["role"] == "verifier"]
    assert sum(w["counters"]["scored"] for w in verifiers) >= books["trained"]
    assert all(w["counters"]["failed"] == 0 for w in verifiers)
    config = (work / "run" / "config.yaml").read_text()
    assert str(work / "my_rewards.py") in config  # handed to the workers as an absolute path
