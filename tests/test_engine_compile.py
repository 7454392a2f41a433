"""rollout.enable_torch_compile: an engine's pointwise chains (norms, rotations, routing, activations) through
torch.compile in its paged decode steps (slime_dsa/models/fused_pointwise.py), on CPU with inductor's C++ kernels.
The compiled chains keep eager's roundings, so the engine's tokens are the plain engine's and its log-probs within
float32 noise."""

from __future__ import annotations

import pytest
import torch

from rollout.engine import Engine, GenerateRequest, SamplingParams
from slime_dsa.checkpoint import build_model
from slime_dsa.models import PackedBatch, fused_pointwise
from slime_dsa.models.presets import preset_config
from slime_dsa.ops import invariant

CONFIG = preset_config("tiny", vocab_size=97, eos_token_id=1)


def _requests() -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(12):
        prompt = torch.randint(2, 97, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        sampling = SamplingParams(max_new_tokens=10 + i % 4, temperature=0.0 if i % 3 == 0 else 1.0, top_p=0.9,
                                  sampling_seed=50 + i, stop_token_ids=[5])
        reqs.append(GenerateRequest(input_ids=prompt, sampling=sampling, rid=str(i), return_logprob=True, stream=False))
    return reqs


def _generate(engine: Engine) -> dict:
    for req in _requests():
        engine.add_request(req)
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finish_reason is not None:
                finals[out.rid] = out
    return finals


@pytest.mark.slow
def test_a_compiled_engine_decodes_the_plain_engines_tokens():
    """Prefill and paged decode steps with the chains compiled (12 requests, greedy and sampled, a stop token)."""
    plain = _generate(Engine(build_model(CONFIG, seed=0).eval(), max_cache_tokens=2048, block_size=4, seed=0))
    engine = Engine(build_model(CONFIG, seed=0).eval(), max_cache_tokens=2048, block_size=4, seed=0,
                    enable_torch_compile=True)
    compiled = _generate(engine)
    assert engine.stats["paged_decode_steps"] > 5 and fused_pointwise._compiled
    assert compiled.keys() == plain.keys()
    for rid, out in plain.items():
        assert compiled[rid].output_ids == out.output_ids, rid
        assert compiled[rid].output_token_logprobs == pytest.approx(out.output_token_logprobs, abs=1e-5), rid


def test_the_chains_run_compiled_only_inside_an_enabled_models_decode_switch(monkeypatch):
    """fused_pointwise.enable flags the model's modules; they run compiled only inside `fusing` (an engine's decode
    forward) on that thread: a forward outside it (prefill, a trainer's) runs the eager ops, and so does a model not
    enabled inside it."""
    model = build_model(CONFIG, seed=0).eval()
    called = []
    monkeypatch.setattr(fused_pointwise, "run", lambda fn, *a, **k: called.append(fn.__name__) or fn(*a, **k))
    ids = torch.tensor([3, 4, 5, 6, 7, 8, 9])

    def forward() -> None:
        with torch.inference_mode():
            model.forward_packed(ids, PackedBatch.from_seqlens([7]))

    with fused_pointwise.fusing():
        forward()
    assert not called
    fused_pointwise.enable(model)
    assert all(m.fused_pointwise for m in model.modules() if hasattr(m, "fused_pointwise"))
    forward()
    assert not called
    with fused_pointwise.fusing():
        forward()
    assert set(called) == {"rms_norm", "apply_interleaved_rope", "rope_first", "gated_mlp", "score_and_route"}
    assert not fused_pointwise.active()


def test_a_compiled_engine_needs_paged_decode_and_no_batch_invariant_mode():
    with invariant.enabled(), pytest.raises(ValueError, match="batch-invariant mode"):
        Engine(build_model(CONFIG, seed=0).eval(), max_cache_tokens=256, enable_torch_compile=True)
    with pytest.raises(ValueError, match="it needs paged_decode"):
        Engine(build_model(CONFIG, seed=0).eval(), max_cache_tokens=256, paged_decode=False, enable_torch_compile=True)
