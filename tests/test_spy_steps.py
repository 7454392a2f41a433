"""benchmarks/spy_steps.py: py-spy's folded samples charged to the engine step's frames."""

from __future__ import annotations

from benchmarks.spy_steps import step_samples

FOLDED = [  # the shape of `py-spy record -f raw` lines (thread; frames outermost first; count)
    "thread (1): MainThread;main (bench.py:9);run (asyncio/runners.py:118) 40\n",
    "thread (2): engine;_loop (rollout/engine/async_engine.py:200);step (rollout/engine/engine.py:485);"
    "_schedule (rollout/engine/engine.py:682) 7\n",
    "thread (2): engine;_loop (rollout/engine/async_engine.py:200);step (rollout/engine/engine.py:485);"
    "_launch (rollout/engine/engine.py:830);sample (rollout/engine/sampling.py:120);softmax (torch/functional.py:5) 3\n",
    "thread (2): engine;_loop (rollout/engine/async_engine.py:200);step (rollout/engine/engine.py:512);"
    "_resolve (rollout/engine/engine.py:537);synchronize (torch/cuda/streams.py:245) 5\n",
]


def test_samples_outside_the_step_are_left_out_and_the_rest_go_to_their_frames():
    total, by_project, by_leaf = step_samples(FOLDED)
    assert total == 15
    assert by_project["_schedule (rollout/engine/engine.py:682)"] == 7
    assert by_project["sample (rollout/engine/sampling.py:120)"] == 3  # torch's frame is charged to the caller
    assert by_project["_resolve (rollout/engine/engine.py:537)"] == 5
    assert by_leaf["softmax (torch/functional.py:5)"] == 3 and by_leaf["synchronize (torch/cuda/streams.py:245)"] == 5
