"""Multi-turn rows' K/V (and Mamba states) kept between their turns by the torch engine (samplers/torch_engine.py,
``GenerationRequest.prefix_keys``): key -> (token ids, the cache's save of them, their routes or None), least
recently kept dropped first beyond a token budget.

    prefixes = PrefixCache(max_tokens=1 << 18, counters=engine.counters)
    prefixes.put(key, ids, cache.save(slot, len(ids)), routes)   # a row stopped
    hit = prefixes.take(key, next_prompt)                        # its next turn: None unless the prompt extends ids
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
from torch import Tensor

Kept = tuple[np.ndarray, object, Tensor | None]  # token ids, the cache's save of them, their routes or None


class PrefixCache:
    def __init__(self, max_tokens: int, counters: Counter) -> None:
        """``max_tokens``: most kept tokens (0: nothing kept); ``counters``: the engine's, which get
        ``prefix_hits`` and ``prefix_tokens_reused``."""
        self.kept: OrderedDict[str, Kept] = OrderedDict()
        self.tokens, self.max_tokens, self.counters = 0, max_tokens, counters

    def take(self, key: str, prompt: np.ndarray) -> Kept | None:
        """What is kept under ``key`` if ``prompt`` extends its tokens (taken either way: the row keeps its K/V
        again when it stops)."""
        hit = self.kept.pop(key, None)
        if hit is None:
            return None
        ids = hit[0]
        self.tokens -= len(ids)
        if len(ids) >= len(prompt) or not np.array_equal(prompt[: len(ids)], ids):
            return None
        self.counters["prefix_hits"] += 1
        self.counters["prefix_tokens_reused"] += len(ids)
        return hit

    def put(self, key: str, ids: np.ndarray, saved: object, routes: Tensor | None) -> None:
        self.kept[key] = (ids, saved, routes)
        self.tokens += len(ids)
        while self.tokens > self.max_tokens and self.kept:
            self.tokens -= len(self.kept.pop(next(iter(self.kept)))[0])

    def clear(self) -> None:
        """Everything kept was computed by the old weights."""
        self.kept.clear()
        self.tokens = 0
