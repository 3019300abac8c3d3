"""CUDA graphs of the torch engine's decode step: one per (batch bucket, attended-length bucket, sampling flags).

    graphs = DecodeGraphs(step, slots=256, max_len=4096, device="cuda")  # step(n, kv_len, top_p_on, greedy_on)
    n, kv_len = graphs.shape(active, kv_len)                # the padded shape a replay runs at
    if not graphs.replay((n, kv_len, top_p_on, greedy_on)):
        step(active, kv_len, top_p_on, greedy_on)           # eager: graphs off, or a capture failed

The engine (samplers/torch_engine.py) makes ``step`` a pure function of fixed buffers (input tokens, positions,
sampling parameters, uniforms, the KV cache and weights; outputs: sampled tokens, log-probs, routes) with no
device->host read and no random draw inside, so a replay is the whole step: one launch instead of ~20 per layer.
Running ``step`` twice on the same inputs writes the same K/V and outputs, so the warm-up before a capture (on a
side stream, as torch.cuda.graphs asks) changes nothing. A graph is captured the first time its key is met; all
share one memory pool and one capture stream (they run one at a time and keep nothing in the pool that another
reads). The first capture that raises turns graphs off for this engine with one log line, and every step runs
eagerly from then on.

A capture that raises must not leave the process broken, and torch's own clean-up does not run then:
``CUDAGraph.capture_end`` raises at ``cudaStreamEndCapture`` (an invalidated capture, e.g. a host sync inside)
before it closes the capture's allocator pool and before the generators' capture epilogue. Left so (the first GPU
run, H200, torch 2.11), every later draw from the process's default CUDA generator raises "Offset increment outside
graph capture encountered unexpectedly" (capture_begin registers that generator and flags it capturing), and the
allocator still counts a capture under way (the next ``torch.cuda.empty_cache`` fails an internal assert; freed
blocks that other streams used are never recycled). ``torch.cuda.graph``'s ``__exit__`` also skips restoring the
caller's stream. So ``_capture`` runs ``capture_begin``/``capture_end`` itself inside its own stream context, and
``_recover`` closes and releases the pool (its id is known: a ``graph_pool_handle`` made here) and runs one trivial
capture, whose epilogue takes the generators out of capture mode.

This is the only code a CPU test cannot run (tests/test_cuda_graphs.py checks its shapes);
``pytest tests/test_torch_engine.py -k cuda`` runs it when CUDA is there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

Key = tuple[int, int, bool, bool]  # (rows, attended length, top_p on, greedy on): the step's static arguments

# the graphs of failed captures, kept as long as the process: torch's allocators may keep a callback into a graph
# whose capture_end raised (a capture filter that reads the graph), and a few bytes each is the price
_FAILED: list[torch.cuda.CUDAGraph] = []


def buckets(limit: int, first: int) -> list[int]:
    """Powers of two from ``first`` below ``limit``, then ``limit``: a step pads to the next one (at most 2x)."""
    out, n = [], first
    while n < limit:
        out.append(n)
        n *= 2
    return [*out, limit]


class DecodeGraphs:
    def __init__(self, step: Callable[[int, int, bool, bool], None], slots: int, max_len: int,
                 device: torch.device | str = "cuda") -> None:
        self.step, self.device = step, torch.device(device)
        self.rows, self.lengths = buckets(slots, 1), buckets(max_len, 256)  # the last length bucket: max_len
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self.pool = self.stream = None  # at the first capture: the graphs' memory pool and capture stream
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
                torch.cuda.synchronize(self.device)
                return False
        graph.replay()
        return True

    def _capture(self, key: Key) -> torch.cuda.CUDAGraph:
        with torch.cuda.device(self.device):  # capture_begin reads the current device (and its generator)
            if self.stream is None:
                self.stream, self.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy initialisation (cuBLAS handles, ...) outside the capture
                self.step(*key)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()  # as torch.cuda.graph: nothing in flight, the cache's free blocks returned
            torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(self.stream):  # its exit restores the caller's stream, whatever raised
                    self._record(graph, key)
            except BaseException:
                self._recover(graph)
                raise
            return graph

    def _record(self, graph: torch.cuda.CUDAGraph, key: Key) -> None:
        """The step captured into ``graph`` on the current (capture) stream. If the step raises, the capture is
        still ended and the step's error is the one raised (an invalidated capture makes ``capture_end`` raise
        too, with a message that names no cause)."""
        # thread_local: the sampler's IO threads may touch CUDA (weight transport) while this thread captures
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            self.step(*key)
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()
            raise
        graph.capture_end()

    def _recover(self, graph: torch.cuda.CUDAGraph) -> None:
        """What a failed capture into ``graph`` left behind, undone: its allocator pool closed and released
        (when ``capture_end`` did not get that far), the generators out of capture mode. Logs what it cannot
        undo; never raises (the caller logs the capture's own error)."""
        index = torch.cuda.current_device()
        end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
            torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
        if end is None:
            _FAILED.append(graph)
            log.warning("this torch has no binding to close a failed CUDA graph capture's memory pool: the "
                        "allocator counts a capture under way from now on (torch.cuda.empty_cache would fail)")
        else:
            try:
                end(index, self.pool)
            except RuntimeError:  # not recording to it: capture_begin failed before, or capture_end closed it
                pass
            else:  # capture_begin took a use of the pool that only a completed capture gives back
                _FAILED.append(graph)
                try:
                    torch._C._cuda_releasePool(index, self.pool)
                except Exception as e:
                    log.warning("could not release a failed CUDA graph capture's memory pool (%s: %s)",
                                type(e).__name__, e)
        try:
            x = torch.zeros(1, device=self.device)
            reset = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self.stream):  # prologue at capture_begin, epilogue at capture_end
                reset.capture_begin(capture_error_mode="thread_local")
                x.add_(1)  # one node (an empty graph warns); no allocation, no random draw
                reset.capture_end()
        except Exception as e:
            log.error("after a failed CUDA graph capture, a trivial capture meant to take the CUDA generators "
                      "out of capture mode failed too (%s: %s): random draws on %s may fail from now on",
                      type(e).__name__, e, self.device)
