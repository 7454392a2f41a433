"""Dense indexer warm-up (DeepSeek-V3.2's first stage): train only the indexers, against the dense attention of their
IndexShare group, on a text corpus; the result is a DSA model whose top-k keeps the attention that matters.

One process, no Ray (like `slime-dsa sft`). The model runs dense attention throughout (index_topk override = the
window length), so the target is the attention the checkpoint was trained with; everything but the indexers is
frozen. The output directory holds the model with `index_topk` set to the sparse budget it was warmed up for.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from slime_dsa import interrupts
from slime_dsa.algorithms.indexer_loss import dsa_indexer_loss, topk_overlap
from slime_dsa.config import RecipeConfig
from slime_dsa.config.errors import UserError
from slime_dsa.config.schema import IndexerWarmupSection
from slime_dsa.indexer.evaluate import evaluate_indexers, indexer_selection
from slime_dsa.models import GlmMoeDsaForCausalLM, PackedBatch

logger = logging.getLogger(__name__)


def freeze_all_but_indexers(model: GlmMoeDsaForCausalLM) -> list[torch.nn.Parameter]:
    """requires_grad only on indexer parameters; returns them."""
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." in name)
        if p.requires_grad:
            params.append(p)
    if not params:
        raise ValueError("the model has no indexer parameters (no 'full' layer in indexer_types)")
    return params


@torch.no_grad()
def reinit_indexers(model: GlmMoeDsaForCausalLM, seed: int = 0) -> None:
    """Fresh random indexers (as a dense checkpoint without trained indexers would have), same init as init_weights."""
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    for name, module in model.named_modules():
        if name.endswith(".indexer"):
            for pname, p in module.named_parameters():
                if pname.endswith("weight") and p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p) * std)
                elif pname.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()


def task_corpus(recipe: RecipeConfig, tokenizer: Any, seed: int, tasks: list[Any] | None = None) -> Iterator[list[int]]:
    """Endless token documents from the recipe's tasks' training splits (`tasks`: those build_tasks made of it, else
    built here): prompt then reference solution then EOS (a multi-turn solution with its tool turns, as the agent
    loop lays them out)."""
    from slime_dsa.data.prompts import TaskMixture, build_tasks  # noqa: PLC0415

    mixture = TaskMixture(tasks if tasks is not None else build_tasks(recipe.data, tokenizer), seed=seed)
    while True:
        for p in mixture.take(64):
            yield task_document(p, tokenizer)


def held_out_documents(tasks: list[Any], tokenizer: Any) -> list[list[int]]:
    """The token documents of every task's eval split (its held-out prompts, as train's and sft's evaluations score),
    a prompt of each task in turn; none where no task has an eval split."""
    splits = [list(task.eval) for task in tasks if task.eval is not None]
    return [task_document(p, tokenizer) for turn in itertools.zip_longest(*splits) for p in turn if p is not None]


def task_document(p: Any, tokenizer: Any) -> list[int]:
    """One prompt's document: prompt, reference solution, EOS."""
    from slime_dsa.data.tool_calls import ChatFormat, solution_ids  # noqa: PLC0415

    solution = p.metadata.get("solution") or ""
    if isinstance(solution, str):
        return list(p.prompt_ids) + tokenizer.encode(solution, add_special_tokens=False) + [tokenizer.eos_token_id]
    return list(p.prompt_ids) + solution_ids(solution, ChatFormat.from_tokenizer(tokenizer))[0]


def dataset_corpus(path: str, split: str, column: str, tokenizer: Any) -> Iterator[list[int]]:
    """Endless token documents from a text column of an HF dataset or a local jsonl/json/parquet file."""
    from slime_dsa.data.prompts import load_prompt_dataset  # noqa: PLC0415

    ds = load_prompt_dataset(path, split=split)
    if column not in ds.column_names:
        raise UserError(f"indexer_warmup.text_column {column!r} is not a column of {path} ({ds.column_names})")
    eos = tokenizer.eos_token_id
    while True:
        used = 0
        for row in ds:
            if row[column] is None:  # a null cell is no text (str() made it the word "None")
                continue
            used += 1
            yield tokenizer.encode(str(row[column]), add_special_tokens=False) + [eos]
        if not used:  # else an endless loop that yields nothing
            raise UserError(f"{path}: column {column!r} holds no text (every row is null or the split is empty)")


def windows(documents: Iterator[list[int]], seq_len: int) -> Iterator[torch.Tensor]:
    """Documents concatenated and cut into windows of seq_len tokens."""
    buf: list[int] = []
    for doc in documents:
        buf.extend(doc)
        while len(buf) >= seq_len:
            yield torch.tensor(buf[:seq_len], dtype=torch.long)
            buf = buf[seq_len:]


def warmup_step(
    model: GlmMoeDsaForCausalLM, optimizer: torch.optim.Optimizer, sequences: list[torch.Tensor], target: str,
    max_grad_norm: float,
) -> dict[str, float]:
    """One Adam step of the dense-stage indexer loss over a packed batch of windows."""
    ids = torch.cat(sequences).to(model.device)
    batch = PackedBatch.from_seqlens([len(s) for s in sequences], model.device)
    out = model.forward_packed(ids, batch, capture_dsa=True, return_logits=False,
                               index_topk=max(len(s) for s in sequences))
    res = dsa_indexer_loss(out.dsa_layers, model.config.indexer_types, batch.cu_seqlens_q, batch.cu_seqlens_k,
                           stage="dense", target=target)
    loss = res.loss_sum / res.num_rows
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    optimizer.step()
    return {"indexer_kl": loss.item(), "grad_norm": float(grad_norm),
            **{k: float(v) / res.num_rows for k, v in res.metrics.items()}}


@torch.no_grad()
def probe_selection(model: GlmMoeDsaForCausalLM, sequences: list[torch.Tensor], topk: int) -> torch.Tensor:
    """(n_full_layers, T, topk) the indexers select on fixed probe windows: compared step to step for stability."""
    ids = torch.cat(sequences).to(model.device)
    batch = PackedBatch.from_seqlens([len(s) for s in sequences], model.device)
    out = model.forward_packed(ids, batch, capture_dsa=True, return_logits=False, index_topk=len(sequences[0]))
    return torch.stack(list(indexer_selection(out.dsa_layers, batch, topk).values()))


def train_indexers(
    model: GlmMoeDsaForCausalLM, train: Iterator[torch.Tensor], eval_sequences: list[torch.Tensor], *, topk: int,
    num_steps: int, batch_size: int, learning_rate: float, target: str = "group", eval_every: int = 0,
    max_grad_norm: float = 1.0, log=None, log_every: int = 1, on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Dense warm-up of the indexers only; returns {"before": eval, "after": eval, "history": [...]}.

    topk_overlap_prev_step costs a forward over the probe windows per step measured, so it is measured only on
    the steps that are logged (every log_every-th and the last), from a probe after the step before each. `log` gets
    those steps, the evaluated ones, and the evaluation before training as step 0 (the one after: the last step).
    No eval_sequences (no held-out prompts): no evaluation, before and after None, and the probe is the first
    training windows, held out of training.
    """
    params = freeze_all_but_indexers(model)
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)

    def evaluate(when: str) -> dict[str, float] | None:
        if not eval_sequences:
            return None
        result = evaluate_indexers(model, eval_sequences, topk, max(len(s) for s in eval_sequences), target)
        logger.info("%s: recall@%d %.3f, KL %.4f, LM loss sparse %.4f / dense %.4f", when, topk, result["recall"],
                    result["indexer_kl"], result["lm_loss_sparse"], result["lm_loss_dense"])
        return result

    before = after = evaluate("before warm-up")
    if log is not None and before is not None:
        log({f"eval/{k}": v for k, v in before.items()}, 0)
    probe = eval_sequences[:4] if eval_sequences else [next(train) for _ in range(4)]

    def logged(step: int) -> bool:
        return step % log_every == 0 or step == num_steps

    previous = probe_selection(model, probe, topk) if logged(1) else None
    history = []
    for step in range(1, num_steps + 1):
        interrupts.raise_if_terminated()  # a SIGTERM whose exception Python dropped (slime_dsa/interrupts.py)
        start = time.perf_counter()
        metrics = warmup_step(model, optimizer, [next(train) for _ in range(batch_size)], target, max_grad_norm)
        if logged(step) or logged(step + 1):
            current = probe_selection(model, probe, topk)
            if logged(step):
                metrics["topk_overlap_prev_step"] = float(topk_overlap(current, previous).mean())
            previous = current
        metrics["step_time_s"] = time.perf_counter() - start
        evaluated = step == num_steps or bool(eval_every and step % eval_every == 0)
        if evaluated and eval_sequences:
            after = evaluate(f"after {step} steps")
            metrics.update({f"eval/{k}": v for k, v in after.items()})
        history.append({"step": step, **metrics})
        if log is not None and (logged(step) or evaluated):
            log(metrics, step)
        if on_step is not None:
            on_step(step)
    for p in model.parameters():
        p.requires_grad_(True)
    return {"before": before, "after": after, "history": history}


def warmup_topk(cfg: IndexerWarmupSection, model_topk: int) -> int:
    """The budget the warm-up trains for: indexer_warmup.index_topk, else the model's; UserError when a window has no
    more keys than that (the recipe check refuses an explicit index_topk at or above seq_len; the model's is known
    only here)."""
    if cfg.index_topk is not None:
        return cfg.index_topk
    if model_topk >= cfg.seq_len:
        raise UserError(
            f"indexer_warmup.index_topk is null, so the model's index_topk ({model_topk}, model.index_topk or "
            f"model.path's config.json) is the budget, but it is not below indexer_warmup.seq_len ({cfg.seq_len}): "
            "every key would be selected; set indexer_warmup.index_topk (the sparse budget to warm up for)")
    return model_topk


def warmup_sequences(recipe: RecipeConfig, tokenizer: Any) -> tuple[Iterator[torch.Tensor], list[torch.Tensor]]:
    """(training windows, endless; evaluation windows) of the recipe's corpus. corpus tasks: training windows from
    the tasks' training splits, evaluation windows from their eval splits (none, and no evaluation, where no task has
    one: the recipe check refuses indexer_warmup.eval_every and eval_sequences set there); corpus dataset: one stream,
    whose first windows are held out."""
    from slime_dsa.data.prompts import build_tasks  # noqa: PLC0415

    cfg = recipe.indexer_warmup
    if cfg.corpus == "dataset":
        train = windows(dataset_corpus(cfg.dataset_path, cfg.dataset_split, cfg.text_column, tokenizer), cfg.seq_len)
        return train, [next(train) for _ in range(cfg.eval_sequences)]
    tasks = build_tasks(recipe.data, tokenizer)
    train = windows(task_corpus(recipe, tokenizer, recipe.data.seed, tasks), cfg.seq_len)
    held_out = held_out_documents(tasks, tokenizer)
    if not held_out:
        logger.info("no task holds prompts out (eval_size, eval_fraction): the warm-up evaluates nothing")
        return train, []
    eval_sequences = list(itertools.islice(windows(iter(held_out), cfg.seq_len), cfg.eval_sequences))
    if len(eval_sequences) < cfg.eval_sequences:
        tokens = sum(map(len, held_out))
        raise UserError(
            f"indexer_warmup.eval_sequences ({cfg.eval_sequences}) windows of indexer_warmup.seq_len ({cfg.seq_len}) "
            f"tokens need {cfg.eval_sequences * cfg.seq_len} held-out tokens, but the tasks' eval splits hold "
            f"{tokens} ({len(held_out)} prompts with their solutions): raise eval_size or eval_fraction on a task in "
            "data.tasks, or lower indexer_warmup.eval_sequences")
    return train, eval_sequences


def run_indexer_warmup(recipe: RecipeConfig) -> Path:
    """`slime-dsa indexer-warmup`: warm the indexers up, save the DSA model; returns the output directory."""
    from slime_dsa.run_dir import open_run_dir  # noqa: PLC0415

    with open_run_dir(recipe, "indexer_warmup.log", "indexer_warmup.output_dir") as run_dir:  # output locked too
        return _warm_up(recipe, run_dir)


def _warm_up(recipe: RecipeConfig, run_dir: Path) -> Path:
    """The warm-up itself, inside its run directory."""
    from rollout.progress import SampleProgress  # noqa: PLC0415
    from slime_dsa.checkpoint import load_model  # noqa: PLC0415
    from slime_dsa.logging import MetricsLogger  # noqa: PLC0415
    from slime_dsa.run_dir import load_tokenizer, output_dir, prepare_model_dir, save_output_model  # noqa: PLC0415

    cfg = recipe.indexer_warmup
    torch.manual_seed(recipe.trainer.seed)
    model_dir = prepare_model_dir(recipe, run_dir)
    tokenizer = load_tokenizer(recipe, model_dir)
    model = load_model(model_dir, dtype=torch.float32)
    topk = warmup_topk(cfg, model.config.index_topk)
    if cfg.reinit_indexers:
        reinit_indexers(model, seed=recipe.trainer.seed)
    train, eval_sequences = warmup_sequences(recipe, tokenizer)
    log = MetricsLogger(run_dir, recipe.logging.project, recipe.logging.run_name or run_dir.name,
                        recipe.logging.wandb_mode, config=recipe.model_dump(mode="json"))
    try:
        # the console's only sign of life until the model is written
        with SampleProgress("indexer warm-up", total=cfg.num_steps) as progress:
            result = train_indexers(
                model, train, eval_sequences, topk=topk, num_steps=cfg.num_steps, batch_size=cfg.batch_size,
                learning_rate=cfg.learning_rate, target=cfg.target, eval_every=cfg.eval_every,
                max_grad_norm=recipe.trainer.max_grad_norm, log_every=recipe.logging.log_every,
                log=lambda m, step: log.log({f"indexer_warmup/{k}": v for k, v in m.items()}, step=step),
                on_step=lambda step: progress.advance(1),
            )
    finally:
        log.close()
    out_dir = output_dir(recipe, run_dir, "indexer_warmup.output_dir")
    model.config.index_topk = topk
    for layer in model.model.layers:
        layer.self_attn.index_topk = topk
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = topk
    summary = {"index_topk": topk, "seq_len": cfg.seq_len, "steps": cfg.num_steps,
               "before": result["before"], "after": result["after"]}

    def extra(tmp: Path) -> None:  # published with the weights, not written after them
        tokenizer.save_pretrained(tmp)
        (tmp / "indexer_warmup_summary.json").write_text(json.dumps(summary, indent=2))

    save_output_model(model, out_dir, "indexer_warmup.output_dir", extra, model_dir)
    return out_dir
