"""The experts' stacked copies after a weight update (issue 19): refilled in place (captured CUDA graphs read those
very buffers) by one foreach copy over every MoE layer, bit for bit what a fresh restack gives."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    """Counts the ATen ops dispatched under it, views included."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _engine():
    """The tiny preset with three MoE layers."""
    from rollout.engine import Engine
    from slime_dsa.checkpoint import build_model
    from slime_dsa.models.presets import preset_config

    config = preset_config("tiny", vocab_size=384, eos_token_id=0, num_hidden_layers=4,
                           indexer_types=["full", "shared", "full", "shared"])
    return Engine(build_model(config, seed=0).eval(), max_cache_tokens=1024, max_running_requests=8, seed=0)


def _experts(model):
    from slime_dsa.models.glm_moe_dsa import Experts

    found = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(found) == 3
    return found


def _update(engine, shift: float) -> None:
    engine.update_weights({k: v.detach().clone() + shift for k, v in engine.model.state_dict().items()}, None)


def test_an_update_refills_the_stacked_experts_in_place_bit_for_bit():
    engine = _engine()
    experts = _experts(engine.model)
    buffers = [module.stacked() for module in experts]
    for shift in (0.01, -0.03):  # twice: the second reuses the views made by the first
        _update(engine, shift)
        for module, (gate_up, down) in zip(experts, buffers):
            now = module._stacked
            assert now[1] is gate_up and now[2] is down  # the same tensors: captured graphs keep reading them
            fresh_gate_up, fresh_down = module._stack()
            assert torch.equal(gate_up, fresh_gate_up) and torch.equal(down, fresh_down)
            assert module.stacked()[0] is gate_up  # current: no second refill


def test_the_refill_after_an_update_is_one_foreach_copy_for_every_layer():
    engine = _engine()
    experts = _experts(engine.model)
    for module in experts:
        module.stacked()
    _update(engine, 0.01)  # makes the views once
    new = {k: v.detach().clone() - 0.02 for k, v in engine.model.state_dict().items()}
    params = engine.parameters_by_name()
    with torch.no_grad():  # the update's copy, outside the count
        torch._foreach_copy_([params[k] for k in new], list(new.values()))
    counter = _Ops()
    with counter:
        engine.model.refresh_inference_caches()
    assert counter.ops == Counter({"_foreach_copy_": 1}), counter.ops
    for module in experts:
        assert torch.equal(module._stacked[1], module._stack()[0]) and torch.equal(module._stacked[2], module._stack()[1])


def test_a_stack_of_another_dtype_is_rebuilt_and_a_dropped_one_stays_dropped():
    engine = _engine()
    first, second = _experts(engine.model)[:2]
    gate_up, _ = first.stacked()
    first.to(torch.float64)
    assert first.stale_refill() is None  # rebuilt in the new dtype, not refilled
    assert first._stacked[1] is not gate_up and first._stacked[1].dtype == torch.float64
    assert torch.equal(first._stacked[1], first._stack()[0])
    second.drop_stacked()
    engine.model.refresh_inference_caches()
    assert second._stacked is None
