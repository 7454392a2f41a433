"""The decode graphs' batch ladder: which (batch, width) graphs the first step at a new width captures. CUDA graphs
need a GPU (their real test: tests/test_engine_gpu.py); here `_capture` is a labelled fake."""

from __future__ import annotations

from rollout.engine.decode import BATCH_BUCKETS, PagedDecoder


class _NoModel:  # FAKE model: what PagedDecoder's constructor reads
    device = type("D", (), {"type": "cpu"})()
    config = type("C", (), {"full_layer_ids": [0], "vocab_size": 8})()
    lm_head = None


def _decoder(max_batch: int) -> PagedDecoder:
    decoder = PagedDecoder(_NoModel(), None, 16, use_cuda_graphs=False, max_batch=max_batch)
    decoder.order = []

    def capture(B: int, width: int):  # FAKE capture: records the order, stores a placeholder
        decoder.order.append((B, width))
        decoder._graphs[(B, width)] = object()
    decoder._capture = capture
    return decoder


def test_a_new_width_captures_the_ladder_largest_first_and_a_known_width_one_graph():
    decoder = _decoder(max_batch=48)
    assert decoder.batch_ladder == (1, 2, 4, 8, 12, 16, 24, 32, 48)
    decoder.capture_width(24, 8)
    assert decoder.order == [(b, 8) for b in (48, 32, 24, 16, 12, 8, 4, 2, 1)]
    decoder.order.clear()
    decoder.capture_width(64, 8)  # beyond the ladder (not from this engine): just that graph
    decoder.capture_width(4, 16)
    assert decoder.order == [(64, 8)] + [(b, 16) for b in (48, 32, 24, 16, 12, 8, 4, 2, 1)]


def test_the_ladder_ends_at_the_bucket_of_max_running_requests():
    assert _decoder(200).batch_ladder[-1] == 256
    assert _decoder(1).batch_ladder == (1,)
    assert _decoder(10_000).batch_ladder == BATCH_BUCKETS
    # an RL recipe's cap with dynamic sampling (recipes/gpu_single.yaml: 64 prompts x 16 samples x 4): graphs up to it
    assert _decoder(4096).batch_ladder[-4:] == (1536, 2048, 3072, 4096)
