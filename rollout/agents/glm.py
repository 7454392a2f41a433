"""The default agent loop: the model calls tools in GLM-4.5's format, until it answers without a call or a limit.

Each turn: generate; no <tool_call> in the turn = the answer, the trajectory is complete; well-formed calls = run
them (at once) and append their results as one observation; a malformed call = an observation that says what is
wrong, so the model can try again (a turn cut by its token budget ends the trajectory instead).
"""

from __future__ import annotations

from rollout.agents.base import AgentEnv
from rollout.agents.trajectory import Trajectory
from slime_dsa.data.sample import Sample
from slime_dsa.data.tool_calls import parse_tool_calls


class GLMToolAgent:
    """The `glm` agent loop."""

    async def run(self, sample: Sample, env: AgentEnv) -> Sample:
        trajectory = Trajectory(sample, env)
        while not trajectory.done:
            turn = await trajectory.generate()
            if turn is None or trajectory.done:
                break
            calls, error = parse_tool_calls(turn.text)
            if not calls and error is None:
                break
            outputs = [f"error: {error}"] if error else await trajectory.call_tools(calls)
            if trajectory.done:  # the calls ran out the trajectory's wall time
                break
            trajectory.observe(outputs)
        return trajectory.finish()
