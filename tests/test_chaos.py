"""Two minutes of chaos over every role (bench/chaos.py --smoke): a SIGKILL every 8 s to a running sampler,
verifier, teacher, environment, trainer or orchestrator, each in turn; the run goes on by itself, and the books from
the files close: every dispatched id one terminal fate, the trainer's ids the ledger's, each step once in the final
weights' history. About 3 minutes of CPU (an undisturbed launch, the chaos, a closing resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
ROLES = {"sampler", "verifier", "teacher", "environment", "trainer", "orchestrator"}


@pytest.mark.slow
def test_two_minutes_of_chaos_over_every_role_leave_the_books_closed(tmp_path):
    env = dict(os.environ, CASCADE_BENCH_RESULTS=str(tmp_path))
    r = subprocess.run([sys.executable, str(BENCH / "chaos.py"), "--smoke", "--work", str(tmp_path / "work")],
                       capture_output=True, text=True, env=env, timeout=900, cwd=BENCH.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    record = json.loads((tmp_path / "chaos.json").read_text())
    chaos, books = record["chaos"], record["books"]
    assert set(chaos["kills"]) == ROLES and min(chaos["kills"].values()) >= 2, chaos["kills"]  # each role, twice
    assert chaos["rewinds"] == chaos["kills"]["trainer"] + chaos["kills"]["orchestrator"]
    for role in ROLES - {"orchestrator", "trainer"}:  # every worker killed came back (a rewind restarts samplers too)
        assert chaos["restarts"][f"{role}-0"] >= chaos["kills"][role], chaos["restarts"]
    assert books["ok"], books["problems"]
    assert books["fates"]["rolled_back"] > 0 and books["steps_trained"] == record["steps"]
    assert books["fates"]["trained"] == record["steps"] * 8 * 4  # every step's rollouts, once
    assert record["summary_books"]["lost"] == 0 and record["summary_books"]["trainer_ids"]["match"]
    assert record["steps_lost_to_rewinds"] > 0
