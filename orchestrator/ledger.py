"""The ledger: every training rollout by id, from dispatch to its one terminal fate.

Each rollout of a training group gets its id at dispatch (``{group}/{index}``, orchestrator/groups.py) and
ends in exactly one fate, written as one line of ``<run_dir>/ledger.jsonl``:

    {"id": "s3g5/2", "group": "s3g5", "attempt": 1, "fate": "trained", "reason": "", "step": 3, "version": 3,
     "t": 1764850000.123}

* ``trained``: sent to the trainer in step ``step``'s batch (reason "masked" when its loss was masked);
* ``filtered``: dropped with the reason (a sampler or teacher error, uniform rewards under dynamic filtering);
* ``stale``: older than ``orchestrator.max_staleness`` allows;
* ``rolled_back``: its step came after the checkpoint the run went on from (a trainer or orchestrator restarted by
  the supervisor, or ``resume=true``): whatever it was before (trained in weights that were thrown away, or still in
  flight in a process that died), it is not in the run's history, and its prompt is drawn again.

A training group's dispatch is a line too, ``{"event": "dispatched", "group": "s3g5", "n": 4, "step": 3, "t": ...}``:
an id in flight when its orchestrator died is then known to the next one, which settles it ``rolled_back``. An id's
fate lines are one fate, or one fate followed by ``rolled_back``; the last is its terminal fate
(orchestrator/books.py ``audit`` checks a run's files by these rules).

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
import re
import time
from collections import Counter
from pathlib import Path

from cascade_rl.protocol import records
from cascade_rl.protocol.records import LEDGER_FILE, TRAINED_IDS_FILE

from .groups import Group

FATES = ("trained", "filtered", "stale", "rolled_back")
ROLLED_BACK = "rolled_back"
DUPLICATE = "duplicate"
DISPATCHED = "dispatched"  # the event of a group's dispatch (not a fate)
_GROUP = re.compile(r"^(s\d+)g(\d+)$")  # a training group's id: its step's scope and its number there


@dataclasses.dataclass
class Entry:
    group: str
    step: int
    attempt: int = 0
    fate: str = ""


class Ledger:
    def __init__(self, path: Path | None, resume_step: int = 0) -> None:
        """``path``: the ledger file (None: in memory only, for tests). A file that exists is the run's so far (a
        restart or a resume at ``resume_step``): its ids are read back, and every one of a step from
        ``resume_step`` on, or without a fate, is settled ``rolled_back``."""
        self.entries: dict[str, Entry] = {}
        self.reasons: Counter = Counter()  # filtered rollouts by reason
        self.duplicates = 0
        self.spans: Counter = Counter()  # trained rollouts by version span (newest - oldest token version)
        self.group_seq: Counter = Counter()  # the highest group number of each step's scope ("s3"): new ids follow
        self._out = None
        if path is not None:
            self._read_back(path)
            self._out = records.Appender(path)
            self._roll_back(resume_step)

    def _read_back(self, path: Path) -> None:
        """The ids of the file so far, each with its last fate."""
        for r in records.read(path):
            if r.get("event") == DISPATCHED:
                self._known(r["group"], r["step"])
                for i in range(r["n"]):
                    self.entries.setdefault(f"{r['group']}/{i}", Entry(r["group"], r["step"]))
            elif r.get("fate") in FATES:
                self._known(r["group"], r["step"])
                entry = self.entries.setdefault(r["id"], Entry(r["group"], r["step"]))
                entry.fate, entry.attempt = r["fate"], r.get("attempt", 0)

    def _known(self, group: str, step: int) -> None:
        if m := _GROUP.match(group):
            self.group_seq[m[1]] = max(self.group_seq[m[1]], int(m[2]))

    def _roll_back(self, step: int) -> None:
        """Every id of a step from ``step`` on (and any without a fate): ``rolled_back``, unless it already is."""
        reason = f"rolled back: the run went on from the checkpoint of step {step}"
        for rid, entry in self.entries.items():
            if entry.fate != ROLLED_BACK and (entry.step >= step or not entry.fate):
                entry.fate = ROLLED_BACK
                self._write(rid, entry, entry.attempt, ROLLED_BACK, reason, None)

    def dispatch(self, g: Group) -> None:
        for rid in g.ids():
            self.entries[rid] = Entry(g.group_id, g.step)
        if self._out is not None:
            self._out.write({"event": DISPATCHED, "group": g.group_id, "n": g.n, "step": g.step,
                             "t": round(time.time(), 3)})

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


def terminal_fates(path: Path) -> dict[str, dict]:
    """Each id's last fate line in the ledger at ``path`` (duplicates and dispatch events aside)."""
    return {r["id"]: r for r in records.read(path) if r.get("fate") in FATES}


def compare_trainer(run_dir: Path, show: int = 5) -> dict:
    """The trainer's ids (``trained_ids.jsonl``) against the ids whose terminal fate in the ledger is ``trained``,
    step by step: ``match`` when every (step, id) pair is in both exactly as often."""
    ledger = Counter((r["step"], r["id"]) for r in terminal_fates(run_dir / LEDGER_FILE).values()
                     if r["fate"] == "trained")
    trainer = Counter((r["step"], rid) for r in records.read(run_dir / TRAINED_IDS_FILE) for rid in r["ids"])
    return {
        "match": ledger == trainer,
        "ledger_trained": sum(ledger.values()),
        "trainer_trained": sum(trainer.values()),
        "not_trained": [f"step {s}: {rid}" for s, rid in sorted((ledger - trainer).elements())][:show],
        "not_in_ledger": [f"step {s}: {rid}" for s, rid in sorted((trainer - ledger).elements())][:show],
    }
