"""samplers/cuda_graphs.py without CUDA: the padded shapes a graph replays at. The captures, replays and the
recovery from a failed capture run in tests/test_torch_engine.py -k cuda (bench/gpu_checks.sh)."""

from __future__ import annotations

from cascade_rl.samplers.cuda_graphs import DecodeGraphs, buckets


def test_graph_buckets_pad_a_step_at_most_to_the_cache():
    """A replay's padded shape never has more rows than the slots nor attends past the cache's length (a step
    at a longer ``kv_len`` raises, samplers/kv_cache.py): at most 2x the rows and the length asked."""
    graphs = DecodeGraphs(lambda *a: None, slots=6, max_len=1000)
    assert graphs.rows == [1, 2, 4, 6] and graphs.lengths == [256, 512, 1000]
    assert graphs.shape(5, 1) == (6, 256) and graphs.shape(1, 513) == (1, 1000) and graphs.shape(6, 1000) == (6, 1000)
    assert DecodeGraphs(lambda *a: None, slots=3, max_len=128).shape(3, 100) == (3, 128)  # below the first bucket
    assert buckets(256, 1)[-1] == 256 and len(buckets(256, 1)) == 9
