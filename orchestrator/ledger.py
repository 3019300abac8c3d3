"""The ledger: every training rollout by id, from dispatch to its one terminal fate.

Each rollout of a training group gets its id at dispatch (``{group}/{index}``, orchestrator/groups.py) and
ends in exactly one fate, written as one line of ``<run_dir>/ledger.jsonl``:

    {"id": "s3g5/2", "group": "s3g5", "attempt": 1, "fate": "trained", "reason": "", "step": 3, "version": 3,
     "t": 1764850000.123}

* ``trained``: sent to the trainer in step ``step``'s batch (reason "masked" when its loss was masked);
* ``filtered``: dropped with the reason (a sampler or teacher error, uniform rewards under dynamic filtering);
* ``stale``: older than ``orchestrator.max_staleness`` allows.

``t`` is when the fate was written (Unix time: a group is settled as soon as it is scored, a trained one as its part
goes to the trainer, which writes when each part came in ``trained_ids.jsonl``'s ``parts``). ``version`` is the
policy version that sampled it (null if it never arrived); a rollout whose tokens span
versions (in-flight weight updates: the sampler took new weights mid-generation) has ``version`` its oldest
token's and ``version_max`` its newest's, and ``version_span`` sums them up for ``summary.json``. A reply that arrives for a rollout
whose attempt was superseded (a re-dispatch) or that already has it is dropped and written as a line with fate
``duplicate`` and that reply's attempt: an event, not the rollout's fate (a teacher reply answers a whole group:
it is written against the group's first rollout). ``books`` counts ids, not residuals:
``lost`` is the dispatched ids with neither a fate nor a place among the groups still in flight. The trainer
writes the ids it actually trained to ``trained_ids.jsonl``; ``compare_trainer`` checks them against the
ledger's ``trained`` lines, step by step.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

from cascade_rl.protocol import records
from cascade_rl.protocol.records import LEDGER_FILE, TRAINED_IDS_FILE

from .groups import Group

FATES = ("trained", "filtered", "stale")
DUPLICATE = "duplicate"


@dataclasses.dataclass
class Entry:
    group: str
    step: int
    attempt: int = 0
    fate: str = ""


class Ledger:
    def __init__(self, path: Path | None, resume_step: int = 0) -> None:
        """``path``: the ledger file (None: in memory only, for tests); a run resumed at ``resume_step`` keeps
        the lines of the steps before it."""
        self.entries: dict[str, Entry] = {}
        self.reasons: Counter = Counter()  # filtered rollouts by reason
        self.duplicates = 0
        self.spans: Counter = Counter()  # trained rollouts by version span (newest - oldest token version)
        self._out = None
        if path is not None:
            records.keep_steps_before(path, resume_step)
            self._out = records.Appender(path)

    def dispatch(self, g: Group) -> None:
        for rid in g.ids():
            self.entries[rid] = Entry(g.group_id, g.step)

    def redispatch(self, g: Group) -> None:
        for rid in g.ids():
            self.entries[rid].attempt = g.attempt

    def settle(self, g: Group, fate: str, reason: str = "") -> None:
        """Every rollout of ``g`` ends in ``fate``."""
        assert fate in FATES, fate
        for i, rid in enumerate(g.ids()):
            entry = self.entries[rid]
            if entry.fate:
                raise RuntimeError(f"rollout {rid} already ended as {entry.fate}, now {fate}: a bug in the orchestrator")
            entry.fate = fate
            r = g.rollouts.get(i)
            newest = None
            if r is not None and r.token_versions is not None and len(r.token_versions):
                newest = int(r.token_versions.max())
            if fate == "trained" and r is not None:
                self.spans[(newest if newest is not None else r.policy_version) - r.policy_version] += 1
            self._write(rid, entry, g.attempt, fate, reason, r.policy_version if r else None, newest)
        if fate == "filtered":
            self.reasons[reason] += g.n

    def duplicate(self, rollout_id: str, attempt: int, reason: str) -> bool:
        """A dropped reply for ``rollout_id``; False when the id is none of the ledger's (an evaluation group's)."""
        entry = self.entries.get(rollout_id)
        if entry is None:
            return False
        self.duplicates += 1
        self._write(rollout_id, entry, attempt, DUPLICATE, reason, None)
        return True

    def books(self, live: set[str]) -> dict:
        """Counts of ids. ``live``: the ids of the training groups still in flight."""
        fates = Counter(e.fate for e in self.entries.values())
        lost = sorted(rid for rid, e in self.entries.items() if not e.fate and rid not in live)
        return {
            "dispatched": len(self.entries),
            **{fate: fates[fate] for fate in FATES},
            "in_flight": sum(1 for rid in live if rid in self.entries and not self.entries[rid].fate),
            "lost": len(lost),
            "lost_ids": lost[:10],
            "redispatched": sum(e.attempt for e in self.entries.values()),  # rollouts sent again
            "duplicates_dropped": self.duplicates,
            "filtered_reasons": dict(self.reasons),
        }

    def version_span(self) -> dict:
        """How many policy versions the trained rollouts' tokens span: the number spanning more than one, the
        largest span and the mean."""
        n = sum(self.spans.values())
        return {"trained": n, "spanning": n - self.spans[0], "max": max(self.spans, default=0),
                "mean": sum(k * v for k, v in self.spans.items()) / n if n else 0.0}

    def close(self) -> None:
        if self._out is not None:
            self._out.close()

    def _write(self, rid: str, entry: Entry, attempt: int, fate: str, reason: str, version: int | None,
               version_max: int | None = None) -> None:
        if self._out is not None:
            line = {"id": rid, "group": entry.group, "attempt": attempt, "fate": fate, "reason": reason,
                    "step": entry.step, "version": version, "t": round(time.time(), 3)}
            if version_max is not None and version_max != version:
                line["version_max"] = version_max
            self._out.write(line)


def compare_trainer(run_dir: Path, show: int = 5) -> dict:
    """The trainer's ids (``trained_ids.jsonl``) against the ledger's ``trained`` lines, step by step: ``match``
    when every (step, id) pair is in both exactly as often."""
    ledger = Counter((r["step"], r["id"]) for r in records.read(run_dir / LEDGER_FILE) if r["fate"] == "trained")
    trainer = Counter((r["step"], rid) for r in records.read(run_dir / TRAINED_IDS_FILE) for rid in r["ids"])
    return {
        "match": ledger == trainer,
        "ledger_trained": sum(ledger.values()),
        "trainer_trained": sum(trainer.values()),
        "not_trained": [f"step {s}: {rid}" for s, rid in sorted((ledger - trainer).elements())][:show],
        "not_in_ledger": [f"step {s}: {rid}" for s, rid in sorted((trainer - ledger).elements())][:show],
    }
