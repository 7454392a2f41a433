"""A tiny GLM-MoE-DSA model that calls tools: fine-tuned to memorise a few reference trajectories of the built-in
agentic tasks, so that decoding on those prompts writes GLM-style tool calls (agent tests and the robustness
benchmark need a model that uses tools; quality is not what they test).

Made once and shipped in tests/assets/agent-tiny (training takes minutes on a busy 2-core CPU):
    PYTHONPATH=. python -m tests.agent_model
`memorised_prompts()` gives the prompts it was trained on. The `boundary` prompt's first tool call writes
"calculator" one byte per token, where the tokenizer would merge it ("c" "alculator"): re-encoding the text of a
trajectory gives other ids than the model sampled, which the token-in-token-out test relies on.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime_dsa.data.tool_calls import ChatFormat, solution_ids
from slime_dsa.data.tokenizer import EOS_TOKEN, build_tokenizer, save_tokenizer
from slime_dsa.sft import SupervisedExample, sft_loss


ASSET = Path(__file__).resolve().parent / "assets" / "agent-tiny"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Memorised:
    """One trajectory the asset model was trained on."""

    name: str
    kind: str  # the built-in task it comes from
    prompt: str
    answer: str
    example: SupervisedExample


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A user prompt through the chat template, as data.apply_chat_template does it."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def task_examples(tokenizer: Any, kind: str, n: int, seed: int = 0) -> list[tuple[str, str, SupervisedExample]]:
    """(prompt text, answer, example) of `n` problems of a built-in agentic task."""
    from slime_dsa.data.tasks import get_task, task_params  # imports datasets: not at module level

    rng, params, fmt = random.Random(seed), task_params(kind), ChatFormat.from_tokenizer(tokenizer)
    out = []
    for _ in range(n):
        prompt, answer, turns = get_task(kind).make_problem(rng, params)
        ids, mask = solution_ids(turns, fmt)
        out.append((prompt, answer, SupervisedExample(chat_prompt_ids(tokenizer, prompt), ids, mask)))
    return out


def memorised_prompts(tokenizer: Any = None) -> list[Memorised]:
    """The trajectories of the asset model: two calc_chain, one fact_lookup, and the byte-spelled `boundary` one."""
    tokenizer = tokenizer or build_tokenizer()
    calc = task_examples(tokenizer, "calc_chain", 3, seed=1)
    (lookup,) = task_examples(tokenizer, "fact_lookup", 1, seed=2)
    out = [Memorised(f"calc{i}", "calc_chain", *calc[i]) for i in range(2)]
    out.append(Memorised("lookup", "fact_lookup", *lookup))
    prompt, answer, ex = calc[2]
    canonical = tokenizer.encode("calculator", add_special_tokens=False)
    spelled = list("calculator".encode())  # byte ids: id == byte value in the built-in tokenizer
    i = _find(ex.response_ids, canonical)
    ids = ex.response_ids[:i] + spelled + ex.response_ids[i + len(canonical):]
    mask = ex.loss_mask[:i] + [1] * len(spelled) + ex.loss_mask[i + len(canonical):]
    out.append(Memorised("boundary", "calc_chain", prompt, answer, SupervisedExample(ex.prompt_ids, ids, mask)))
    return out


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise ValueError("sub-sequence not found")


def overfit_model(directory: Path, examples: list[SupervisedExample], *, steps: int = 600, lr: float = 5e-3,
                  seed: int = 0) -> Path:
    """Train a tiny model on `examples` until it has memorised them; save it (with the tokenizer) to `directory`."""
    from slime_dsa.checkpoint.hf_format import build_model, save_pretrained
    from slime_dsa.models.presets import preset_config

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = preset_config("tiny", vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN))
    model = build_model(config, dtype=torch.float32, seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.05, 1 - step / steps))
    for step in range(steps):
        loss = sft_loss(model, examples)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0:
            logger.info("step %d: loss %.5f", step, loss.item())
        if loss.item() < 1e-4:
            break
    logger.info("final loss %.6f after %d steps", loss.item(), step + 1)
    save_pretrained(model.eval(), directory)
    save_tokenizer(directory)
    return directory


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    overfit_model(ASSET, [m.example for m in memorised_prompts()])
