"""`slime-dsa sft RECIPE`: supervised fine-tuning on the tasks' reference solutions (one process, no Ray).

It makes the starting policy of an RL recipe: the quickstart's policy is this module's output on arithmetic,
stopped early (sft.stop_at_pass) so that RL has room to improve it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime_dsa.config import RecipeConfig
from slime_dsa import interrupts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisedExample:
    """A prompt and its reference response; loss_mask (one per response token) is 0 on tool output, which the model
    reads but is not taught to write."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]


def supervised_examples(prompts: list[Any], tokenizer: Any) -> list[SupervisedExample]:
    """One example per prompt from the task's `solution` column: a response string (+ EOS), or a multi-turn trajectory
    (a list of assistant/tool turns, laid out as the agent loop lays them out: slime_dsa.data.tool_calls)."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.data.tool_calls import ChatFormat, solution_ids  # noqa: PLC0415

    eos = tokenizer.eos_token_id
    chat_format = None
    out = []
    for p in prompts:
        solution = p.metadata.get("solution")
        if solution is None:
            raise UserError(f"task {p.task!r} row {p.index}: sft learns each row's 'solution' column (the reference "
                            "response: a string, or a list of assistant/tool turns), and this row has none")
        if isinstance(solution, str):
            ids = tokenizer.encode(solution, add_special_tokens=False) + [eos]
            mask = [1] * len(ids)
        else:
            chat_format = chat_format or ChatFormat.from_tokenizer(tokenizer)
            try:
                ids, mask = solution_ids(solution, chat_format)
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                raise UserError(f"task {p.task!r} row {p.index}, column 'solution': expected a string or a list of "
                                f"{{role, content}} turns ({e})") from None
        out.append(SupervisedExample(list(p.prompt_ids), ids, mask))
    return out


def sft_loss(model, examples: list[SupervisedExample], loss_tokens: float | None = None) -> torch.Tensor:
    """Negative log-likelihood of the response tokens whose loss_mask is 1, over one packed batch, divided by
    loss_tokens (None: those tokens' count, the batch's mean; a micro-batch passes its step's count)."""
    from slime_dsa.models import PackedBatch  # noqa: PLC0415

    ids = torch.tensor([t for e in examples for t in e.prompt_ids + e.response_ids], device=model.device)
    mask = torch.tensor([float(m) for e in examples for m in [0] * len(e.prompt_ids) + e.loss_mask],
                        device=model.device)
    batch = PackedBatch.from_seqlens([len(e.prompt_ids) + len(e.response_ids) for e in examples], model.device)
    logp, _ = model.token_logprobs(ids, batch)
    return -(logp * mask).sum() / (mask.sum() if loss_tokens is None else loss_tokens)


def sft_step(model, optimizer, examples: list[SupervisedExample], micro_batch_tokens: int, max_grad_norm: float,
             autocast: bool = False) -> dict[str, float]:
    """One optimizer step over `examples`, in micro-batches of at most micro_batch_tokens tokens (whole examples in
    order; one longer than that is a micro-batch alone: trainers.base.split_by_tokens, the trainers' packing) whose
    gradients accumulate. Each micro-batch's loss is divided by the step's loss tokens, so the step's loss and
    gradients are the unsplit batch's mean. Returns train/loss, train/grad_norm (before clipping; max_grad_norm 0 =
    none) and train/micro_batches."""
    from trainers.base import split_by_tokens  # noqa: PLC0415

    groups = split_by_tokens([len(e.prompt_ids) + len(e.response_ids) for e in examples], micro_batch_tokens)
    loss_tokens = float(sum(sum(e.loss_mask) for e in examples))
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=model.device)
    for group in groups:
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = sft_loss(model, [examples[i] for i in group], loss_tokens)
        loss.backward()
        total += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    optimizer.step()
    return {"train/loss": total.item(), "train/grad_norm": float(grad_norm), "train/micro_batches": len(groups)}


def greedy_eval(model, tokenizer, tasks: list[Any], max_prompts: int, max_new_tokens: int,
                stop: Sequence[str] = (), reward_timeout_s: float | None = None,
                model_dir: Path | None = None) -> dict[str, float]:
    """The RL loop's evaluation (rollout.evaluation.Evaluator: greedy answers on every task's eval split, eval/
    metrics) through an embedded engine in this process; each reward call may run reward_timeout_s (None: the
    default of rollout.reward_timeout_s). The engine stops where the run's engines do: on the model's EOS ids,
    model_dir's generation_config.json's and the tokenizer's eos_token."""
    from rollout.engine import AsyncEngine, Engine  # noqa: PLC0415
    from rollout.engine.stop import engine_eos_token_ids  # noqa: PLC0415
    from rollout.evaluation import Evaluator, eval_prompts  # noqa: PLC0415
    from rollout.server.in_process import InProcessClient  # noqa: PLC0415
    from slime_dsa.config.schema import RolloutSection  # noqa: PLC0415
    from slime_dsa.models.config import generation_eos_token_ids  # noqa: PLC0415

    generation_ids = generation_eos_token_ids(model_dir) if model_dir is not None else []
    eos_ids = engine_eos_token_ids(model.config.eos_token_ids, generation_ids, tokenizer)
    # No deadline per request: a CPU eval of many long answers can outlast any, and SFT has no engine to give up on.
    timeout = {} if reward_timeout_s is None else {"reward_timeout_s": reward_timeout_s}
    rollout = RolloutSection(max_response_length=max_new_tokens, stop=list(stop), request_timeout_s=math.inf, **timeout)
    prompts = eval_prompts(tasks, max_prompts)
    longest = max((len(p.prompt_ids) for p in prompts), default=1) + max_new_tokens

    async def evaluate() -> dict[str, float]:
        engine = AsyncEngine(Engine(model, max_cache_tokens=max(4096, longest * min(len(prompts), 256)),
                                    tokenizer=tokenizer, eos_token_ids=eos_ids))
        await engine.start()
        try:
            client = InProcessClient(engine, tokenizer)
            return await Evaluator(client, tasks, tokenizer, rollout, show_progress=False).evaluate(max_prompts)
        finally:
            await engine.stop()

    model.eval()
    try:
        return interrupts.run(evaluate())
    finally:
        model.train()


def run_sft(recipe: RecipeConfig) -> Path:
    """Fine-tune, evaluating every sft.eval_every steps; write the HF directory and return its path."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.config.sft import check_sft_keys  # noqa: PLC0415
    from slime_dsa.run_dir import open_run_dir  # noqa: PLC0415

    check_sft_keys(recipe)  # `slime-dsa sft` has refused them already; a caller of this function gets the same
    if recipe.model.dtype == "bfloat16" and not torch.cuda.is_available():  # the device is known only here
        raise UserError("model.dtype 'bfloat16': slime-dsa sft computes in bfloat16 on a GPU only (autocast), and this "
                        "machine has none: on a CPU it trains in float32; set float32 or auto")
    with open_run_dir(recipe, "sft.log", "sft.output_dir") as run_dir:  # sft.output_dir locked from here
        return _fine_tune(recipe, run_dir)


def _fine_tune(recipe: RecipeConfig, run_dir: Path) -> Path:
    """The fine-tuning itself, inside its run directory."""
    from rollout.progress import SampleProgress  # noqa: PLC0415
    from slime_dsa import ops  # noqa: PLC0415
    from slime_dsa.checkpoint import load_model  # noqa: PLC0415
    from slime_dsa.data.prompts import TaskMixture, build_tasks  # noqa: PLC0415
    from slime_dsa.logging import MetricsLogger  # noqa: PLC0415
    from slime_dsa.run_dir import load_tokenizer, output_dir, prepare_model_dir, save_output_model  # noqa: PLC0415
    from trainers.optim import build_optimizer, build_scheduler  # noqa: PLC0415

    tr, sft = recipe.trainer, recipe.sft
    torch.manual_seed(tr.seed)
    ops.set_backend(recipe.model.ops_backend)  # as the trainer workers do; the evaluation's engine runs them too
    model_dir = prepare_model_dir(recipe, run_dir)
    tokenizer = load_tokenizer(recipe, model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(model_dir, dtype=torch.float32, device=device)  # float32 master weights
    model.gradient_checkpointing = recipe.model.gradient_checkpointing
    # bf16 compute on a GPU when the recipe asks for bf16 (model.dtype) or mixed precision.
    autocast = device.type == "cuda" and (recipe.model.dtype != "float32" or tr.mixed_precision)
    tasks = build_tasks(recipe.data, tokenizer)
    mixture = TaskMixture(tasks, seed=recipe.data.seed)
    optimizer = build_optimizer(model, tr.learning_rate, tr.weight_decay, tuple(tr.adam_betas))
    scheduler = build_scheduler(optimizer, tr.warmup_steps, tr.num_steps, tr.lr_schedule)
    log = MetricsLogger(run_dir, recipe.logging.project, recipe.logging.run_name or run_dir.name, recipe.logging.wandb_mode,
                        config=recipe.model_dump(mode="json"))
    out_dir = output_dir(recipe, run_dir, "sft.output_dir")
    ro = recipe.rollout
    eval_args = (tokenizer, tasks, sft.eval_prompts, ro.max_response_length, ro.stop, ro.reward_timeout_s)
    metrics: dict[str, float] = {}
    try:
        with SampleProgress("sft", total=tr.num_steps) as progress:
            for step in range(1, tr.num_steps + 1):
                interrupts.raise_if_terminated()
                start = time.perf_counter()
                examples = supervised_examples(mixture.take(sft.batch_size), tokenizer)
                metrics = sft_step(model, optimizer, examples, tr.micro_batch_tokens, tr.max_grad_norm, autocast)
                scheduler.step()
                progress.advance(1)
                metrics.update({"train/lr": scheduler.get_last_lr()[0], "perf/step_time_s": time.perf_counter() - start})
                evaluated = (sft.eval_every and step % sft.eval_every == 0) or step == tr.num_steps
                if evaluated:
                    metrics.update(greedy_eval(model, *eval_args, model_dir=model_dir))
                    logger.info("sft step %d: loss %.4f, eval pass@1 %.3f", step, metrics["train/loss"],
                                metrics.get("eval/pass@1", math.nan))  # no eval split: no eval metrics
                if step % recipe.logging.log_every == 0 or evaluated:
                    log.log(metrics, step=step)
                if sft.stop_at_pass is not None and metrics.get("eval/pass@1", 0.0) >= sft.stop_at_pass:
                    logger.info("sft: eval pass@1 %.3f reached sft.stop_at_pass at step %d", metrics["eval/pass@1"], step)
                    break
    finally:
        log.close()

    def extra(tmp: Path) -> None:  # published with the weights, not written after them
        tokenizer.save_pretrained(tmp)
        (tmp / "sft_summary.json").write_text(json.dumps({"steps": step, **metrics}, indent=2))

    save_output_model(model, out_dir, "sft.output_dir", extra, model_dir)
    return out_dir
