"""The order prompts are drawn in: a pure function of the seed and the draw count (no IO).

    order = DrawOrder(sizes=[1000, 50], weights=[3, 1], seed=0)
    source, row = order.next()       # the k-th draw
    order.skip(12_345)               # a resumed run continues exactly where the checkpoint's cursor was

Each draw picks a source by weight (one seeded block of ``BLOCK`` choices at a
time), then takes that source's next row in a shuffled epoch: every row of a
source is drawn once before any is drawn again, each epoch in a new order.
Several files without weights are one source (their concatenation), so a
row's chance does not depend on which file holds it. The state is the draw
count alone: ``skip(k)`` reproduces the state after k draws with one pass over
k / BLOCK blocks, whatever k is, which is how resume restores the data
position exactly.
"""

from __future__ import annotations

import numpy as np

BLOCK = 4096  # source choices drawn per seeded block


class DrawOrder:
    def __init__(self, sizes: list[int], weights: list[float] | None, seed: int) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"every source needs at least one row, got sizes {sizes}")
        weights = [1.0] * len(sizes) if weights is None else weights
        if len(weights) != len(sizes) or min(weights) <= 0:
            raise ValueError(f"one positive weight per source, got {weights} for {len(sizes)} sources")
        self.sizes, self.seed = list(sizes), seed
        self.p = np.asarray(weights, np.float64) / float(np.sum(weights))
        self.drawn = 0
        self.counts = np.zeros(len(sizes), np.int64)  # draws taken from each source so far
        self._block: tuple[int, np.ndarray] | None = None
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its permutation)

    def _choices(self, block: int) -> np.ndarray:
        if self._block is None or self._block[0] != block:
            if len(self.sizes) == 1:
                choices = np.zeros(BLOCK, np.int64)
            else:
                choices = np.random.default_rng([self.seed, 1, block]).choice(len(self.sizes), BLOCK, p=self.p)
            self._block = (block, choices)
        return self._block[1]

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, 2, source, epoch]).permutation(self.sizes[source]))
            self._perms[source] = cached
        return cached[1]

    def next(self) -> tuple[int, int]:
        """(source, row within the source) of the next draw."""
        block, i = divmod(self.drawn, BLOCK)
        source = int(self._choices(block)[i])
        epoch, pos = divmod(int(self.counts[source]), self.sizes[source])
        row = int(self._permutation(source, epoch)[pos])
        self.counts[source] += 1
        self.drawn += 1
        return source, row

    def skip(self, k: int) -> None:
        """Advance by ``k`` draws without making them."""
        end = self.drawn + k
        while self.drawn < end:
            block, i = divmod(self.drawn, BLOCK)
            j = min(BLOCK, i + end - self.drawn)
            self.counts += np.bincount(self._choices(block)[i:j], minlength=len(self.sizes))
            self.drawn += j - i
