"""The colocated synchronous step's trainer calls between training and the push (issue 19): the trainers' memory
release and the cuda_ipc buffer fill are one Ray call per rank, where they were two. GPU-only in a run (cuda_ipc), so
the orchestration is checked here with the real MemoryHandOver, CudaIpcTransport and sync step over FAKE trainers
and engines; the rank side (share_then_release) over a FAKE rank."""

from __future__ import annotations

import asyncio

from slime_dsa.orchestrator import train
from tests.fake_step_run import FakeStepRun


class _Client:  # FAKE: one engine that keeps its KV cache; records the control calls
    engines = {"e": None}
    staged: list = []

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def admit_staged(self):
        return []

    async def broadcast(self, path, body=None, **options):
        self.calls.append(f"{path} {body.get('mode') or body.get('pause_mode') or ''}".strip())
        tensors = body.get("serialized_named_tensors")
        if tensors:
            self.calls.append(f"table {tensors[0]['version']}")
        return {"e": {"success": True}}


class _Trainers:  # FAKE trainer group: the weights' version moves with each train call
    def __init__(self, calls: list[str], combined: bool) -> None:
        self.calls, self.version = calls, 0
        if combined:
            self.release_memory_and_share_weights = self._combined

    def release_memory(self, min_free_share=None):
        self.calls.append("trainer release")

    def share_weights(self, dtype):
        self.calls.append("trainer share")
        return {"version": self.version}

    def _combined(self, dtype, min_free_share=None):
        self.calls.append("trainer share+release")
        return {"version": self.version}


def _steps(monkeypatch, combined: bool, steps: int = 2) -> list[str]:
    from slime_dsa.orchestrator.colocation import MemoryHandOver
    from slime_dsa.orchestrator.weight_sync import CudaIpcTransport

    calls: list[str] = []
    client, trainers = _Client(calls), _Trainers(calls, combined)
    weights = CudaIpcTransport(client, trainers, "bfloat16")
    weights.engines_pause = True

    run = FakeStepRun(client, weights, memory=MemoryHandOver(client, trainers, "keep"))

    # The colocated hand-over of step.train_on_samples, without the batch and the training call.
    async def train_on_samples(run, step, samples, resume_engines=True, clock=None, while_training=None):
        await run.memory.to_trainer()
        trainers.version += 1
        calls.append("train")
        release = None if resume_engines else getattr(run.weights, "release_and_prepare", None)
        await run.memory.to_engines(resume=resume_engines, release=release)
        return {}
    monkeypatch.setattr(train, "train_on_samples", train_on_samples)
    for i in range(steps):
        asyncio.run(train._one_step(run, i))
    return calls


def test_the_colocated_push_fills_its_buffer_in_the_release_call(monkeypatch):
    calls = _steps(monkeypatch, combined=True)
    step = ["/pause_generation retract", "train", "trainer share+release", "/update_weights_from_tensor abort"]
    assert calls == [*step, "table 1", *step, "table 2"]  # one trainer call; each push sends its step's weights


def test_trainers_without_the_combined_call_get_two(monkeypatch):
    calls = _steps(monkeypatch, combined=False, steps=1)
    assert calls == ["/pause_generation retract", "train", "trainer release", "trainer share",
                     "/update_weights_from_tensor abort", "table 1"]


def test_a_rank_shares_then_releases_in_one_call():
    from trainers.group import share_then_release

    class Rank:  # FAKE rank: share_weights needs CUDA (the real one: test_cuda_ipc.py)
        def __init__(self):
            self.calls = []

        def share_weights(self, dtype):
            self.calls.append(f"share {dtype}")
            return {"rank": 0}

        def release_memory(self, min_free_share=None):
            self.calls.append("release")

    rank = Rank()
    assert share_then_release(rank, "bfloat16") == {"rank": 0} and rank.calls == ["share bfloat16", "release"]
