"""FAKE: the run object that `orchestrator.train._one_step` reads, without Ray, engines or trainers, for tests of
what one synchronous step sends between two rollouts."""

from __future__ import annotations


class FakeManager:
    """FAKE rollout manager: one group of one placeholder sample a step."""

    async def collect_step(self):
        return [[object()]], {}

    def state_dict(self) -> dict:
        return {}


class FakeStepRun:
    """FAKE run: the given client, weight transport, engine stats and memory hand-over, the default recipe (no
    prefetch); no fleet, hooks or callbacks."""

    fleet = None
    on_weights = None
    last_hold_s = 0.0
    prefetch_held_back = False

    def __init__(self, client, weights, engine_stats=None, memory=None) -> None:
        from slime_dsa.config.schema import RecipeConfig
        from slime_dsa.orchestrator import train

        self.recipe = RecipeConfig()
        self.client, self.weights, self.engine_stats, self.memory = client, weights, engine_stats, memory
        self.manager = FakeManager()
        self.progress = train.StepProgress()

    def hook_wants_state(self, version: int) -> bool:
        return False
