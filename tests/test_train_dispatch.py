"""How a step's batch reaches the trainer ranks (issue 19): TrainBatch crosses processes as byte arrays (pickle 5 out of
band, as Ray sends it), and a prefetch's calls go out once the train call is sent, not while the driver sends it."""

from __future__ import annotations

import asyncio
import pickle
import random
import threading
import time
import warnings

import pytest
import torch

from slime_dsa.algorithms.specs import build_algorithm
from slime_dsa.config.schema import RecipeConfig
from slime_dsa.orchestrator import step as step_module
from tests.test_batching import ragged_samples
from trainers.base import TrainBatch


def _batch() -> TrainBatch:
    T = 12
    return TrainBatch(
        input_ids=torch.arange(T), seqlens=[5, 7], loss_mask=torch.ones(T), rollout_logprobs=-torch.rand(T),
        advantages=torch.randn(2 * T)[::2],  # not contiguous
        replay_topk=torch.randint(-1, T, (2, T, 3), dtype=torch.int32), prompt_lens=[2, 3],
        candidate_target_logprobs=torch.randn(T, 2).to(torch.bfloat16), candidate_mask=torch.ones(()))


def _same(a: TrainBatch, b: TrainBatch) -> None:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(x, y), name
        else:
            assert x == y, name


@pytest.mark.parametrize("out_of_band", [False, True])
def test_a_train_batch_round_trips_as_byte_arrays(out_of_band):
    batch = _batch()
    if out_of_band:  # as Ray does: the arrays' bytes travel beside the pickle and come back read-only
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
        assert len(buffers) >= 5  # every tensor's bytes out of band, none copied into the pickle
        assert len(data) < 2_000
        views = [memoryview(bytes(b.raw())) for b in buffers]  # read-only, like the object store's
        back = pickle.loads(data, buffers=views)
    else:
        back = pickle.loads(pickle.dumps(batch))
    _same(batch, back)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on tensors over read-only arrays: the copy avoids them
        back.advantages.mul_(2)  # the rank may write its batch's tensors
    assert torch.equal(back.advantages, batch.advantages * 2)


def _fake_run(trainers=None):
    """FAKE run: what train_on_samples reads, the default recipe (no colocation, no critic, no FLOP counter)."""
    recipe = RecipeConfig()
    return type("Run", (), dict(recipe=recipe, algorithm=build_algorithm(recipe.algorithm), trainers=trainers,
                                client=None, memory=None, train_flops=None, teachers=None))()


def test_the_prefetch_goes_out_after_the_train_call_is_sent():
    """train_on_samples starts `while_training` (a prefetch's send) from the train call's on_sent, so it runs while
    the ranks compute, not while the driver pickles and sends the batch."""
    events: list[str] = []

    class Trainers:  # FAKE trainer group: sends, computes for a while, answers
        def train(self, batch, num_mini_batches=1, recompute=False, detailed=True, role="policy", on_sent=None):
            assert threading.current_thread() is not threading.main_thread()  # off the event loop
            time.sleep(0.05)  # pickling and sending the batch
            events.append("sent")
            on_sent()
            time.sleep(0.2)  # the ranks compute
            events.append("answered")
            return None, {"trainer_dispatch_s": 0.01, "trainer_compiles": 2}

    async def prefetch() -> None:
        events.append("prefetch")

    samples = ragged_samples(random.Random(0), ["none"] * 4)
    metrics = asyncio.run(step_module.train_on_samples(_fake_run(Trainers()), 0, samples, while_training=prefetch))
    assert events == ["sent", "prefetch", "answered"]
    assert metrics["perf/trainer_dispatch_s"] == 0.01
    assert metrics["perf/trainer_compiles"] == 2  # trainer.compile's graph variants compiled in the call


def test_a_step_without_a_policy_call_still_prefetches(monkeypatch):
    """A step that sends no policy call (a critic's warm-up) prefetches once its calls are done."""
    events: list[str] = []

    async def no_policy(run, step, batch, samples, trains_policy, on_sent):
        events.append("critic")
        return {}

    async def prefetch() -> None:
        events.append("prefetch")

    monkeypatch.setattr(step_module, "_train_roles", no_policy)
    asyncio.run(step_module.train_on_samples(_fake_run(), 0, ragged_samples(random.Random(0), ["none"] * 2),
                                             while_training=prefetch))
    assert events == ["critic", "prefetch"]


def test_an_interrupt_during_the_critics_call_leaves_no_policy_call_unawaited(monkeypatch):
    """Ctrl-C during a colocated critic's train call printed "RuntimeWarning: coroutine '_train_policy' was never
    awaited" (and a tracemalloc hint) under the one line that names the checkpoint to resume from."""
    import gc  # noqa: PLC0415

    from slime_dsa.orchestrator import critic  # noqa: PLC0415

    async def estimates(trainers, spec, batch, samples):
        return {}

    async def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(critic, "critic_estimates", estimates)
    monkeypatch.setattr(critic, "train_critic", interrupted)
    recipe = RecipeConfig.model_validate({"algorithm": {"name": "sao"}, "rollout": {"n_samples_per_prompt": 1}})
    run = type("Run", (), dict(recipe=recipe, algorithm=build_algorithm(recipe.algorithm), trainers=None,
                               teachers=None))()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(step_module._train_roles(run, 0, _batch(), [], True, lambda: None))
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]
