"""The engine's warm-up (rollout/engine/warmup.py): what it runs and captures, and that an engine after it answers
as a fresh one does. Its point, compiling and capturing on the GPU, is checked by tests/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

import slime_dsa
from rollout.engine import Engine, GenerateRequest, SamplingParams
from rollout.engine.warmup import (graph_widths, prefill_rounds, warm_up_engine, warm_up_or_recover,
                                   warmup_prompt_lengths)
from tests.hf_reference import TINY, make_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_graph_widths_run_from_one_block_to_the_longest_samples_width():
    assert graph_widths(416, 16) == [1, 2, 4, 8, 16, 32]  # 26 blocks: width 32
    assert graph_widths(512, 16) == [1, 2, 4, 8, 16, 32]
    assert graph_widths(513, 16) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_widths(20, 16) == [1, 2]
    assert graph_widths(3, 16) == [1]


def test_warmup_prompts_prefill_within_and_past_index_topk():
    assert warmup_prompt_lengths(416, 256) == [64, 63, 412]
    assert warmup_prompt_lengths(200, 256) == [64, 63]
    assert warmup_prompt_lengths(12, 4) == [4, 3, 8]
    assert prefill_rounds(416, 256) == [[64], [63], [64, 64], [64, 63], [412]]  # rows 128 and 127 with two prompts


def test_an_engine_after_its_warmup_answers_as_a_fresh_one(tmp_path):
    """Seeded sampling with log-probs and top-k rows, after the warm-up, equals a fresh engine's; nothing of the
    warm-up's prompts stays in the prefix cache."""
    make_hf_checkpoint(tmp_path, index_topk=4, num_hidden_layers=4, index_topk_freq=2)
    model = slime_dsa.load_model(tmp_path).eval()
    g = torch.Generator().manual_seed(1)
    requests = [(torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist(), seed)
                for seed, n in enumerate((5, 9, 14))]

    def answers(warm: bool) -> list[tuple]:
        engine = Engine(model, max_cache_tokens=512, keep_indexer_topk=True)
        if warm:
            assert warm_up_engine(engine, 24) > 0
            assert not engine.has_work and engine.num_running == 0
        for ids, seed in requests:
            engine.add_request(GenerateRequest(ids, SamplingParams(max_new_tokens=6, ignore_eos=True, sampling_seed=seed),
                                               rid=str(seed), return_logprob=True, return_indexer_topk=True, stream=False))
        finals = {}
        while engine.has_work:
            finals.update({out.rid: out for out in engine.step() if out.finish_reason is not None})
        return [(o.output_ids, o.output_token_logprobs, o.cached_tokens) for o in (finals[r] for r in sorted(finals))]

    assert answers(warm=True) == answers(warm=False)


def _engine_with_fake_captures(tmp_path, monkeypatch, out_of_memory_at_width: int | None = None):
    """A CPU engine whose decoder "captures" graphs through a FAKE _capture (no GPU): each capture recorded as (batch,
    width, inference mode on); at `out_of_memory_at_width` it raises the device's out-of-memory error instead."""
    from rollout.engine.decode import PagedDecoder

    make_hf_checkpoint(tmp_path, index_topk=4, num_hidden_layers=2)
    engine = Engine(slime_dsa.load_model(tmp_path).eval(), max_cache_tokens=512, max_running_requests=8)
    captured = []

    def fake_capture(self, B, width):
        if width == out_of_memory_at_width:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        captured.append((B, width, torch.is_inference_mode_enabled()))
        self._graphs[(B, width)] = object()
        return self._graphs[(B, width)]

    monkeypatch.setattr(PagedDecoder, "_capture", fake_capture)
    engine.decoder.use_cuda_graphs = True
    return engine, captured


def test_the_warmups_graph_captures_run_in_inference_mode(tmp_path, monkeypatch):
    """The warm-up captures decode graphs outside an engine step; each capture runs in inference mode all the same
    (under autograd every graph's outputs kept its activations alive: 72 GB over 95 graphs on an H100). The CUDA
    capture itself is a FAKE here (no GPU): a stand-in _capture records the mode it ran in; tests/test_engine_gpu.py
    checks the real graphs' outputs."""
    engine, modes = _engine_with_fake_captures(tmp_path, monkeypatch)
    warm_up_engine(engine, 40)
    assert modes and {B for B, _, _ in modes} == set(engine.decoder.batch_ladder)
    assert {width for _, width, _ in modes} == set(graph_widths(40, engine.block_size))
    assert all(inference for _, _, inference in modes), modes


def test_a_failed_warmup_leaves_the_engine_as_a_fresh_one(tmp_path, monkeypatch, caplog):
    """A warm-up that fails midway (here a graph capture running out of memory: a FAKE capture, no GPU) is logged
    and undone: no request left, the prefix cache empty, no graph kept; the engine then answers as a fresh one."""
    # The prefill rounds' decode steps capture widths 1 and 4 (their own failures turn graphs off, a path of its
    # own); only the warm-up's graph phase reaches width 2, where the fake device runs out of memory.
    engine, captured = _engine_with_fake_captures(tmp_path, monkeypatch, out_of_memory_at_width=2)
    with caplog.at_level("ERROR"):
        assert warm_up_or_recover(engine, 40) is None
    assert "warm-up failed" in caplog.text
    assert {width for _, width, _ in captured} == {1, 4} and engine.decoder.use_cuda_graphs
    assert engine.decoder._graphs == {}
    assert not engine.has_work and engine.num_running == 0 and engine.blocks.num_cached_blocks == 0
    monkeypatch.undo()
    engine.decoder.use_cuda_graphs = False
    fresh = Engine(engine.model, max_cache_tokens=512, max_running_requests=8)

    def answer(e: Engine) -> list[int]:
        e.add_request(GenerateRequest([3, 5, 7, 9], SamplingParams(max_new_tokens=5, ignore_eos=True, sampling_seed=1),
                                      rid="a", stream=False))
        outs = []
        while e.has_work:
            outs += [o for o in e.step() if o.finish_reason is not None]
        return outs[0].output_ids

    assert answer(engine) == answer(fresh)


def test_a_served_engines_weights_take_no_gradient(tmp_path):
    """load_engine's model keeps no autograd graph whatever mode a forward runs in: its weights need no grad."""
    from rollout.server.launch import load_engine

    make_hf_checkpoint(tmp_path, index_topk=4, num_hidden_layers=2)
    engine, _ = load_engine(tmp_path, max_cache_tokens=256)
    model = engine.engine.model
    assert not any(p.requires_grad for p in model.parameters())
    out = model.forward_packed(torch.tensor([3, 5, 7]), slime_dsa.models.PackedBatch.from_seqlens([3]))
    assert out.logits.grad_fn is None
