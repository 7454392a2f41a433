"""Test-wide setup: offline hubs and quiet libraries, and `gpu` tests skipped where CUDA is absent.

Kept light: nothing heavy is imported here, so `pytest --collect-only` and small test files stay fast.
"""

from __future__ import annotations

import os

import pytest

# Set before any test module imports huggingface_hub / transformers / wandb, which read them at import time.
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never download; anything they need is built locally
os.environ["WANDB_MODE"] = "offline"
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # avoids the fork-after-use warning and deadlocks in Ray workers



@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one costs seconds). Logical CPUs exceed the
    machine's cores on purpose: actors of a tiny model mostly wait on each other, and a worker's tests share them."""
    import ray  # noqa: PLC0415

    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < 16:
        ray.shutdown()  # a test's real Ray call started a local one of this machine's cores: runs would starve
    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: tiny matmuls run faster on one, the machine is shared, and an engine
    and a trainer compared bit for bit must share a thread count (slime_dsa/ops/invariant.py)."""
    import torch  # noqa: PLC0415

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine_actor_kwargs(monkeypatch) -> dict:
    """What `rollout.actors.create_engine_actors` would build the Ray engine actors with, recorded instead of built
    (FAKE: no actors start)."""
    made: dict = {}

    def create_engine_actors(count, **kwargs):
        made.update(kwargs)
        return []

    monkeypatch.setattr("rollout.actors.create_engine_actors", create_engine_actors)
    return made


@pytest.fixture(scope="session")
def figures():
    """Numbers the fault tests measure, by test; written as JSON to $SLIME_DSA_FAULT_FIGURES at the session's end
    (benchmarks/RESULTS.md quotes them)."""
    found: dict = {}
    yield found
    path = os.environ.get("SLIME_DSA_FAULT_FIGURES")
    if path and found:
        import json  # noqa: PLC0415

        with open(path, "w") as f:
            json.dump(found, f, indent=2, sort_keys=True, default=str)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that starts Ray is `slow` (the fast lane, `pytest -m "not slow"`, never waits on a cluster); skip
    tests marked `gpu` when torch sees no CUDA device."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when gpu tests were collected: importing torch costs seconds

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
