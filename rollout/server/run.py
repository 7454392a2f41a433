"""Engine requests run to their final outputs: one, or the several of one HTTP call at once."""

from __future__ import annotations

from typing import Any

from rollout.engine.types import GenerateOutput, GenerateRequest


async def run_request(engine: Any, req: GenerateRequest) -> GenerateOutput:
    """Drive one request to its final output (the one with finish_reason)."""
    req.stream = False  # only the final state is used: the engine skips the per-step copies
    last = None
    gen = engine.generate(req)
    try:
        async for out in gen:
            last = out
    finally:
        await gen.aclose()
    if last is None or last.finish_reason is None:
        last = GenerateOutput(
            rid=req.rid, output_ids=list(last.output_ids) if last else [],
            output_token_logprobs=list(last.output_token_logprobs) if last else [],
            output_token_versions=list(last.output_token_versions) if last else [],
            finish_reason={"type": "abort", "message": "the engine ended the request without a finish reason"},
            prompt_tokens=len(req.input_ids), weight_version=str(engine.weight_version),
        )
    return last


async def run_all(engine: Any, requests: list[GenerateRequest]) -> list[GenerateOutput]:
    """Run the requests of one HTTP call concurrently to their final outputs (AsyncEngine.finals: one engine command
    and one wake-up for all of them); a refused request is raised and none of them runs."""
    return await engine.finals(requests)
