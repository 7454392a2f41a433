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


def test_the_thread_table_covers_the_processes_that_stepped_the_engine():
    from benchmarks.spy_steps import thread_samples

    engine = 'process 5:"ray::EngineActor"'
    lines = [f'process 1:"python -m slime_dsa.cli train";{engine};{line}' for line in FOLDED]
    lines.append(f'process 1:"python -m slime_dsa.cli train";{engine};thread (3): loop;run (asyncio/base_events.py:9);'
                 f'build_response (rollout/server/protocol.py:40);dumps (json/__init__.py:3) 4\n')
    lines.append('process 1:"python -m slime_dsa.cli train";thread (1): MainThread;wait (x.py:1) 9\n')  # no step here
    processes = thread_samples(lines)
    assert list(processes) == [engine]
    threads = processes[engine]
    assert sum(threads["thread (2): engine"].values()) == 15
    assert threads["thread (3): loop"] == {"build_response (rollout/server/protocol.py:40) <- dumps (json/__init__.py:3)": 4}
