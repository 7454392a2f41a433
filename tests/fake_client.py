"""A GenerateClient without a model, for fast tests of the rollout pieces: answers as SGLang's /generate does, with
tokens drawn from the prompt and the sample's seed (so equal requests get equal answers)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence


class FakeClient:
    """generate / generate_batch like EngineClient's. held: sessions whose requests wait for `release`;
    abort_once: sampling seeds answered with finish_reason abort the first time they are seen."""

    def __init__(self, vocab_size: int = 50, held: Sequence[str] = (), abort_once: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.held, self.release = set(held), asyncio.Event()
        self.abort_once = set(abort_once)
        self.requests: list[tuple[str | None, int]] = []  # (session_id, samples) of each request

    async def generate(self, input_ids: Sequence[int], sampling_params: dict | None = None, *,
                       session_id: str | None = None, **options) -> dict | list[dict]:
        """n > 1: n samples, sample j seeded sampling_seed + j, as our embedded server expands n."""
        params = dict(sampling_params or {})
        n = params.pop("n", 1)
        if n == 1:
            return (await self._answer([input_ids], [params], session_id))[0]
        seed = params.get("sampling_seed")
        samples = [params if seed is None else {**params, "sampling_seed": seed + j} for j in range(n)]
        return await self._answer([input_ids] * n, samples, session_id)

    async def generate_batch(self, prompts: Sequence[Sequence[int]], sampling_params: Sequence[dict], *,
                             session_id: str | None = None, **options) -> list[dict]:
        return await self._answer(prompts, sampling_params, session_id)

    async def _answer(self, prompts, params, session_id) -> list[dict]:
        self.requests.append((session_id, len(prompts)))
        if session_id in self.held:
            await self.release.wait()
        await asyncio.sleep(0)
        return [self._one(list(p), sp) for p, sp in zip(prompts, params)]

    def _one(self, prompt: list[int], params: dict) -> dict:
        seed = params.get("sampling_seed")
        greedy = params.get("temperature", 1.0) == 0.0
        rng = random.Random(f"{prompt}" if greedy else f"{prompt}/{seed}")
        ids = [rng.randrange(3, self.vocab_size) for _ in range(params["max_new_tokens"])]
        finish = {"type": "length", "length": len(ids)}
        if seed in self.abort_once:
            self.abort_once.discard(seed)
            ids, finish = ids[:1], {"type": "abort", "message": "weights updated"}
        meta = {"finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(ids),
                "weight_version": "0", "output_token_logprobs": [[-1.0, t, None] for t in ids]}
        return {"text": "", "output_ids": ids, "meta_info": meta}
