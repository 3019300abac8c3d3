"""Which rows the torch engine runs (samplers/torch_engine.py): admission of waiting rows and, with a paged KV cache
(samplers/paged_kv.py), preemption; host bookkeeping over a ``Run``, no device work.

    take = admissible(run, cache, paged, counters)   # waiting rows that join now
    out = preempt(run, cache, counters)              # paged, before a decode step: running slots to give up, or None

Policy (paged): blocks are taken lazily and preemption makes room, as vLLM's scheduler does. A waiting row is
admitted only when its context and its first decoded token fit in the free blocks, FIFO (the head waits, and the
rows behind it: a long row is never starved by short ones overtaking it). Before each decode step every running row
gets the block its next token needs, oldest row first; when none is free the newest running row is preempted: its
blocks freed, it goes back to the head of the queue with its sampled tokens and log-probs (``Run.resumed``), and on
re-admission its prompt and those tokens are prefilled again (recompute) and it samples on. Reserving prompt +
max_tokens at admission instead would reserve what the static cache does whenever rows share a max_tokens (an RL
batch), though most rows stop far earlier. A row that cannot fit even alone is refused before it runs
(``TorchEngine.check``), so the oldest row always fits and every row finishes. A preempted row's recomputed K/V is
that of the weights current at its re-admission (with ``inflight_kv="keep"`` too).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .decode_state import Run


def admissible(run: Run, cache, paged: bool, counters: Counter) -> list[int]:
    """The waiting rows that join now (taken off ``run.waiting``), FIFO: as many as there are free slots and,
    ``paged``, free blocks for each one's context and first decoded token beyond one for each running row (which
    its next token may need: a row admitted now is not preempted at the next step); ``counters["kv_waits"]``:
    admissions stopped for want of blocks."""
    take, free = [], cache.free_blocks - run.active if paged else 0  # each running row may need a block next step
    while run.waiting and run.active + len(take) < cache.slots:
        r = run.waiting[0]
        if paged:
            need = cache.blocks_for(len(run.requests[run.row_request[r]].prompt_ids) + run.resumed.get(r, 0) + 1)
            if need > free:
                counters["kv_waits"] += 1
                break
            free -= need
        take.append(run.waiting.popleft())
    if not take and not run.active and run.waiting:
        raise RuntimeError(f"row {run.waiting[0]} fits in no free KV block though no row runs")
    return take


def preempt(run: Run, cache, counters: Counter) -> np.ndarray | None:
    """Paged, before a decode step: every running slot gets the block its next token needs (``cache.make_room``);
    the rows of the slots it had to free wait again at the head of the queue. The mask of those slots over the
    running ones (the engine retires them), or None. Counts ``kv_preempted`` (rows) and ``kv_peak_blocks``."""
    s, b = run.slots, run.active
    victims = cache.make_room(s.pos[:b], run.admitted[s.row[:b]])
    counters["kv_peak_blocks"] = max(counters["kv_peak_blocks"], cache.used_blocks)
    if not victims:
        return None
    for slot in victims:  # newest first: the oldest ends at the head
        run.resumed[int(s.row[slot])] = int(s.n_gen[slot])
        run.waiting.appendleft(int(s.row[slot]))
    counters["kv_preempted"] += len(victims)
    return np.isin(np.arange(b), victims)
