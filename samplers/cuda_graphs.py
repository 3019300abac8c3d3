"""CUDA graphs of the torch engine's decode step: one per (batch bucket, attended-length bucket, sampling flags).

    graphs = DecodeGraphs(step, slots=256, max_len=4096)   # step(n, kv_len, top_p_on, greedy_on): static shapes
    n, kv_len = graphs.shape(active, kv_len)                # the padded shape a replay runs at
    if not graphs.replay((n, kv_len, top_p_on, greedy_on)):
        step(active, kv_len, top_p_on, greedy_on)           # eager: graphs off, or a capture failed

The engine (samplers/torch_engine.py) makes ``step`` a pure function of fixed buffers (input tokens, positions,
sampling parameters, uniforms, the KV cache and weights; outputs: sampled tokens, log-probs, routes) with no
device->host read inside, so a replay is the whole step: one launch instead of ~20 per layer. Running ``step``
twice on the same inputs writes the same K/V and outputs, so the warm-up before a capture (on a side stream, as
torch.cuda.graphs asks) changes nothing. A graph is captured the first time its key is met; all share one memory
pool (they run one at a time and keep nothing in it that another reads). The first capture that raises turns
graphs off for this engine with one log line, and every step runs eagerly from then on.

This is the only code a CPU test cannot run; ``pytest tests/test_torch_engine.py -k cuda`` runs it
when CUDA is there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

Key = tuple[int, int, bool, bool]  # (rows, attended length, top_p on, greedy on): the step's static arguments


def buckets(limit: int, first: int) -> list[int]:
    """Powers of two from ``first`` below ``limit``, then ``limit``: a step pads to the next one (at most 2x)."""
    out, n = [], first
    while n < limit:
        out.append(n)
        n *= 2
    return [*out, limit]


class DecodeGraphs:
    def __init__(self, step: Callable[[int, int, bool, bool], None], slots: int, max_len: int) -> None:
        self.step = step
        self.rows, self.lengths = buckets(slots, 1), buckets(max_len, 256)
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.enabled = True

    def shape(self, rows: int, kv_len: int) -> tuple[int, int]:
        """The bucket a step of ``rows`` rows attending to ``kv_len`` positions is padded to."""
        return next(b for b in self.rows if b >= rows), next(b for b in self.lengths if b >= kv_len)

    def replay(self, key: Key) -> bool:
        """Run the step of ``key`` as a graph (captured first if new); False when graphs are off."""
        if not self.enabled:
            return False
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.graphs[key] = self._capture(key)
            except Exception as e:  # any failure: this engine decodes eagerly from now on
                self.enabled = False
                self.graphs.clear()
                log.warning("CUDA graph capture of the decode step %s failed, decoding eagerly: %s: %s",
                            key, type(e).__name__, e)
                torch.cuda.synchronize()
                return False
        graph.replay()
        return True

    def _capture(self, key: Key) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisation (cuBLAS handles, ...) outside the capture
            self.step(*key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the sampler's IO threads may touch CUDA (weight transport) while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.step(*key)
        self.pool = graph.pool()
        return graph
