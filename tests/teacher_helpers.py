"""Helpers for the teacher tests: tiny expert checkpoints with the built-in tokenizer, an embedded server on a
background event loop, and the direct forward a teacher's scores must equal."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch


def make_expert(directory: Path, seed: int, preset: str = "tiny") -> Path:
    """A randomly initialised GLM-MoE-DSA checkpoint (float32) with the built-in tokenizer, as a teacher's path; its
    logits are as many as a student built from scratch has (one per token of the tokenizer)."""
    from slime_dsa.checkpoint import build_model, save_pretrained
    from slime_dsa.data.tokenizer import build_tokenizer, save_tokenizer
    from slime_dsa.models.presets import preset_config

    tokenizer = build_tokenizer()
    config = preset_config(preset, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    save_pretrained(build_model(config, seed=seed), directory)
    save_tokenizer(directory)
    return directory


def direct_scores(model_dir: Path, sequence: list[int], prompt_len: int, temperature: float = 1.0,
                  top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log π_T of the tokens after the prompt (R,) and the top-k (R, k) ids and log-probs, from one plain forward."""
    import slime_dsa

    model = slime_dsa.load_model(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor(sequence)[None]).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)[prompt_len - 1:-1]  # row p predicts token p + 1
    chosen = logp.gather(1, torch.tensor(sequence[prompt_len:])[:, None]).squeeze(1)
    if not top_k:
        return chosen, None, None
    values, ids = logp.topk(top_k, -1)
    return chosen, ids, values


class ServerThread:
    """An EmbeddedServer on 127.0.0.1 in its own event loop thread (engine_kwargs go to load_engine)."""

    def __init__(self, model_dir: Path, **engine_kwargs) -> None:
        from rollout.server.launch import EmbeddedServer, load_engine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        engine, tokenizer = load_engine(model_dir, max_cache_tokens=1024, **engine_kwargs)
        weight_dirs = [str(d) for d in engine_kwargs.get("preload_weights") or []]  # what a swap may load
        self.server = self.run(EmbeddedServer.start(engine, tokenizer, model_path=str(model_dir),
                                                    weight_dirs=weight_dirs))
        self.url = self.server.url

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)



def make_peaked_teacher(directory: Path, student_dir: Path, tokens: list[int], steps: int = 30, seed: int = 0) -> Path:
    """A copy of the student trained to spread nearly all its mass evenly over `tokens` after any prefix: a teacher
    far from the student (reverse KL of several nats a token) but one that the student can match with a shift of its
    output layer alone."""
    import slime_dsa
    from slime_dsa.checkpoint import save_pretrained
    from slime_dsa.data.tokenizer import save_tokenizer

    model = slime_dsa.load_model(student_dir, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(seed)
    chosen = torch.tensor(tokens)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(3, model.config.vocab_size, (32,), generator=g)
        logp = torch.log_softmax(model(ids).logits.float(), -1)
        loss = -logp[:, chosen].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model, directory)
    save_tokenizer(directory)
    return directory
