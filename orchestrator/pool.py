"""The workers the orchestrator knows, and what each holds: credits and deadlines, no sockets.

A worker joins with ``Ready`` (its role, ``slots`` and domains). Every item the orchestrator hands it (a
group for a sampler, a score key for a verifier, a teacher key for a teacher) is ``assign``-ed with the
credit it takes (sequences or requests) and a deadline; a reply ``release``-s it. ``expired`` returns what
is past its deadline, ``leave`` what a worker that is gone held: the caller re-dispatches those.
"""

from __future__ import annotations

import dataclasses

from cascade_rl.protocol.messages import WorkKey


@dataclasses.dataclass
class Held:
    need: int  # credit it takes: a group's n sequences, one score, a group's n teacher sequences
    deadline: float
    since: float


@dataclasses.dataclass
class Worker:
    role: str
    slots: int  # capacity: sequences for a sampler or a teacher, score requests for a verifier
    version: int = 0
    domains: tuple[str, ...] = ()
    held: dict[str | WorkKey, Held] = dataclasses.field(default_factory=dict)  # a group id (sampler) or work key
    draining: bool = False  # retiring (a swap, a scale-down): finishes what it holds, gets nothing new
    rank: int = 0  # a trainer's rank (each rank of trainer.world_size joins on its own)

    @property
    def load(self) -> int:
        return sum(h.need for h in self.held.values())

    def fits(self, need: int) -> bool:
        """Room for ``need`` more; an idle worker takes any item (a group larger than its slots)."""
        return not self.draining and (self.load + need <= self.slots or not self.held)


class WorkerPool:
    def __init__(self) -> None:
        self.workers: dict[bytes, Worker] = {}

    def get(self, ident: bytes) -> Worker | None:
        return self.workers.get(ident)

    def join(self, ident: bytes, worker: Worker) -> Worker | None:
        """Add ``worker``; returns the one it replaces (a restart under the same id), whose items are lost."""
        old = self.workers.get(ident)
        self.workers[ident] = worker
        return old

    def leave(self, ident: bytes) -> Worker | None:
        return self.workers.pop(ident, None)

    def have(self, role: str) -> bool:
        return any(w.role == role for w in self.workers.values())

    def trainer(self, rank: int) -> bytes | None:
        """The trainer rank ``rank``'s identity (None until it joined)."""
        return next((i for i, w in self.workers.items() if w.role == "trainer" and w.rank == rank), None)

    def pick(self, role: str, need: int, domain: str | None = None,
             prefer: bytes | None = None) -> tuple[bytes, Worker] | None:
        """The least loaded worker of ``role`` (serving ``domain``) with room for ``need``; ``prefer`` first when it
        is one (a multi-turn row's next turn goes where its earlier turns' KV is cached)."""
        w = self.workers.get(prefer) if prefer is not None else None
        if w is not None and w.role == role and (domain is None or domain in w.domains) and w.fits(need):
            return prefer, w
        free = [(i, w) for i, w in self.workers.items()
                if w.role == role and (domain is None or domain in w.domains) and w.fits(need)]
        return min(free, key=lambda iw: iw[1].load) if free else None

    def assign(self, ident: bytes, key: str | WorkKey, need: int, now: float, timeout_s: float) -> None:
        self.workers[ident].held[key] = Held(need, now + timeout_s, now)

    def release(self, ident: bytes | None, key: str | WorkKey) -> bool:
        """Free ``key`` at ``ident``; False if that worker did not hold it."""
        w = self.workers.get(ident) if ident is not None else None
        return w is not None and w.held.pop(key, None) is not None

    def release_group(self, group_id: str) -> int:
        """Free everything any worker holds of group ``group_id`` (its sample request, scores, teacher and
        environment steps); how many items."""
        n = 0
        for w in self.workers.values():
            for key in [k for k in w.held if (k if isinstance(k, str) else k.group) == group_id]:
                del w.held[key]
                n += 1
        return n

    def items(self, role: str) -> int:
        """Items held by workers of ``role``."""
        return sum(len(w.held) for w in self.workers.values() if w.role == role)

    def expired(self, now: float) -> list[tuple[bytes, str | WorkKey]]:
        """Items past their deadline, released."""
        out = [(i, k) for i, w in self.workers.items() for k, h in w.held.items() if now > h.deadline]
        for ident, key in out:
            del self.workers[ident].held[key]
        return out

    def holdings(self, now: float, show: int = 4) -> dict[str, dict]:
        """Per worker: its role, state, what it holds (a few keys), the oldest item's age and the next deadline:
        what the stall report prints (supervisor/stall.py)."""
        out = {}
        for ident, w in self.workers.items():
            held = sorted(w.held.items(), key=lambda kv: kv[1].since)
            out[ident.decode(errors="replace")] = {
                "role": w.role, "draining": w.draining, "slots": w.slots, "load": w.load, "items": len(held),
                "keys": [str(k) for k, _ in held[:show]],
                "oldest_s": round(now - held[0][1].since, 1) if held else 0.0,
                "next_deadline_s": round(min(h.deadline for _, h in held) - now, 1) if held else None,
            }
        return out
