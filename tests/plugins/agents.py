"""An agent loop the tests load by import path, as a user's plugin would be: one model turn, no tools."""

from __future__ import annotations

from rollout.agents.base import AgentEnv
from rollout.agents.trajectory import Trajectory
from slime_dsa.data.sample import Sample


class OneTurn:
    """Answers in one turn whatever the model writes (a tool call is not run)."""

    async def run(self, sample: Sample, env: AgentEnv) -> Sample:
        trajectory = Trajectory(sample, env)
        await trajectory.generate()
        return trajectory.finish()
