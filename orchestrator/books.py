"""A run's books from its files alone: what a chaos run (bench/chaos.py) and the fault tests check after the fact.

The orchestrator keeps its books in memory and writes them as it goes (orchestrator/ledger.py); a process that is
killed takes the memory with it, so what counts is what the files say:

* every dispatched id (``ledger.jsonl``'s dispatch events) has a fate, and its fate lines are one fate, or one fate
  followed by ``rolled_back``: nothing lost, nothing settled twice;
* the trainer's ids (``trained_ids.jsonl``) are, step by step, the ids whose terminal fate is ``trained``;
* the history of the final weights trains every step once: each step's line once in ``trained_ids.jsonl``, steps
  ``0 .. steps - 1`` and no others.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from cascade_rl.protocol import records
from cascade_rl.protocol.records import LEDGER_FILE, TRAINED_IDS_FILE

from .ledger import DISPATCHED, FATES, ROLLED_BACK, compare_trainer

SHOW = 5  # examples of each problem in the audit


def audit(run_dir: Path, steps: int) -> dict:
    """The books of ``run_dir`` by the rules above; ``ok`` when every rule holds, ``problems`` what breaks them."""
    run_dir = Path(run_dir)
    dispatched, fates = set(), defaultdict(list)
    for r in records.read(run_dir / LEDGER_FILE):
        if r.get("event") == DISPATCHED:
            dispatched.update(f"{r['group']}/{i}" for i in range(r["n"]))
        elif r.get("fate") in FATES:
            fates[r["id"]].append(r["fate"])
    unsettled = sorted(dispatched - set(fates))
    undispatched = sorted(set(fates) - dispatched)
    twice = sorted(rid for rid, fs in fates.items() if not _one_fate(fs))
    history = Counter(r["step"] for r in records.read(run_dir / TRAINED_IDS_FILE))
    trainer = compare_trainer(run_dir, SHOW)
    problems = {
        "unsettled": unsettled[:SHOW],  # dispatched, never settled: lost
        "undispatched": undispatched[:SHOW],
        "settled_twice": [f"{rid}: {fates[rid]}" for rid in twice[:SHOW]],
        "steps_not_once": [f"step {s}: {history[s]} times" for s in range(steps) if history[s] != 1][:SHOW],
        "steps_beyond": sorted(s for s in history if not 0 <= s < steps)[:SHOW],
        "trainer_ids": [] if trainer["match"] else trainer["not_trained"] + trainer["not_in_ledger"],
    }
    terminal = Counter(fs[-1] for fs in fates.values())
    return {
        "ok": not any(problems.values()),
        "dispatched": len(dispatched),
        "fates": {fate: terminal[fate] for fate in FATES},
        "rolled_back_after_a_fate": sum(len(fs) == 2 for fs in fates.values()),
        "steps_trained": len(history),
        "trainer_ids": trainer,
        "problems": {k: v for k, v in problems.items() if v},
    }


def _one_fate(fates: list[str]) -> bool:
    """One fate, or one fate then ``rolled_back``."""
    return len(fates) == 1 or (len(fates) == 2 and fates[1] == ROLLED_BACK and fates[0] != ROLLED_BACK)
