"""GRPO per-step wall time and reward: TRL's GRPOTrainer vs ours (`run_training`), side by side on CPU or one GPU.

Both sides, in one invocation, start from the same HF checkpoint (default recipes/assets/quickstart-sft) and train
on the same prompts with the same reward and hyper-parameters:
- prompts: the built-in arithmetic task's train split (1-2 digits, seed 7, chat template), in the order our
  TaskMixture draws them. TRL gets exactly that stream as its dataset with shuffle_dataset off, so step k of both
  sees the same prompts k*P..(k+1)*P-1. TRL renders the chat template itself (conversational prompts); the script
  checks that its prompt ids equal ours. The sampled responses differ: each side has its own random stream.
- reward: `rollout.rewards.arithmetic.arithmetic_reward`, wrapped for TRL's reward_funcs signature.
- GRPO: group size G (num_generations = rollout.n_samples_per_prompt), advantages (r - mean) / std per group
  (unbiased std both; eps 1e-6 ours, 1e-4 TRL), Clip-Higher eps 0.2 / 0.28, no KL (TRL beta=0), token-mean loss
  (TRL loss_type dapo), one optimiser step per rollout batch, AdamW (0.9, 0.999), wd 0, grad clip 1.0, constant lr,
  no warm-up, temperature / top_p 1, max completion length, truncated responses kept in the loss.
- pi_old: TRL with num_iterations=1 takes the detached current log-probs and runs no extra forward pass; ours by
  default here takes the engine's rollout log-probs (bypass mode, equal to the trainer's within 1e-5 in float32),
  so neither side pays a pi_old forward; --recompute-old-logprobs makes ours recompute them (its recipe default).
- differences that remain: ours generates with embedded engines in Ray actors
  and trains in trainer Ray actors (1 CPU each, colocated: they take turns; float32 replicas, unsharded),
  TRL generates with HF `generate` and trains with transformers' GlmMoeDsaForCausalLM in this process
  (--trl-threads torch threads). Ours computes each group's prompt once in generation and in training
  (trainer.share_prompt_prefix) and syncs weights through /dev/shm, or by CUDA IPC when engine and trainer share
  a GPU (rollout.weight_sync auto): its defaults.

Step time: wall time between consecutive weight versions (ours: the `on_weights` hook; TRL: `on_step_end`), so each
includes rollout, reward, training, weight sync and logging; median over steps 2..N (step 1 includes warm-up).
CPU time per step, over the same intervals: CPU seconds used by this process and all its descendants (for ours
that includes the Ray actors, raylet and GCS). On a shared machine wall time includes waiting for a core; CPU time
does not, so it is the steadier measure of the work each side does per step.
Reward verdict: ours' reward of the last 3 steps and its eval pass@1 must each be TRL's or better, or less by at
most two standard errors of the difference (`at_least_equal`): the two sides draw different samples, so equal
policies differ by a few hundredths (as at step 1, where both sample the same weights on the same prompts).
Eval (off the clock): greedy pass@1 on the same held-out prompts with `slime_dsa.sft.greedy_eval`, for the
initial model and both final models (ours: the last weights pushed to the engines; TRL: `save_model`), each
loaded through `slime_dsa.load_model` in float32 (on the GPU with --device cuda).

--device cuda (one GPU; --task countdown with the small-preset SFT model is the realistic setting): ours as
recipes/gpu_single.yaml, 1 embedded engine + 1 FSDP2 trainer rank colocated on the GPU (0.5 + 0.5;
--ours-kv-cache: what the engine does with its KV cache while the trainer steps, default auto = keep a small one),
bf16 engine, bf16 mixed-precision training (float32 master weights), Triton kernels (ops_backend auto); TRL loads the
model (attn_implementation --trl-attn, transformers' default sdpa) in float32 with bf16=True (accelerate's bf16
autocast around the model's forward, in generation and training alike: float32 master weights and optimiser state, as
ours), use_cpu=False, HF `generate` (no vLLM). Everything else is the CPU mode's. Both sides' step clocks wait for
the GPU (torch.cuda.synchronize in TRL's callback; ours stamps after the weight push, which waits for the trainer).
Ours' weight push reads the weights back for this script's hook only at the last step there (--hook-state last; every
step cost ~0.5 s a step for the small preset on an H200, a cost of the measurement, not of ours); on CPU at every
step, as before (--hook-state every). Either way the read-back (its seconds: perf/weights_readback_s) is taken out of
ours' step times: TRL's steps do no such work.
--ours-loop async swaps ours' algorithm and loop for the asynchronous ones: async_reinforce (REINFORCE with
double-sided IS against the rollout's log-probs, group-centred rewards, no π_old), --ours-max-staleness steps ahead
(default 1), and on cuda the engine and the trainer rank on the GPU at once (placement disaggregated, 0.5 + 0.5):
the next steps' rollouts run while the trainer steps. It is not TRL's algorithm; the report says so, and the reward
verdict is what says whether it learned as well.
GPU busy (cuda, with pynvml from nvidia-ml-py): a thread in this process reads the device's utilisation through NVML
every 20 ms while each side trains (device-wide: ours' engine and trainer actors are other processes), and, where the
driver keeps them, its own time-stamped utilisation samples; the report gives the mean over steps 2..N per side, and
per step, by each (benchmarks/gpu_busy.py says how they differ). Without pynvml or a GPU: "-".

    pip install -e '.[bench]'
    python benchmarks/vs_trl.py --steps 10 --prompts-per-step 8 --group-size 8 --out benchmarks/RESULTS.md
    python benchmarks/vs_trl.py --ours-engines 2 --ours-workers 2 --trl-threads 2 ...
        # the whole 2-core machine on each side: ours splits the batch over 2 engines and 2 trainer replicas,
        # TRL runs torch with 2 threads
    python benchmarks/vs_trl.py --steps 10 --prompts-per-step 8 --group-size 16 --max-new-tokens 128 \
        --out benchmarks/RESULTS.md                      # larger groups, long cap
    python benchmarks/vs_trl.py --task countdown --model benchmarks/assets/countdown-sft --steps 20 --lr 1e-4 \
        --prompts-per-step 8 --group-size 16 --max-new-tokens 64 --eval-prompts 256 --ours-engines 2 \
        --ours-workers 2 --trl-threads 2 --out benchmarks/RESULTS.md
        # CPU, countdown (~104-token prompts, ~19-token answers), G = 16: the quickstart-sized policy of
        # benchmarks/countdown_sft.yaml
    python benchmarks/vs_trl.py --preset quickstart --group-size 16 --max-new-tokens 64 ...
        # a random model of a preset instead of the SFT policy: long responses of varied length, reward ~0
    python benchmarks/vs_trl.py --device cuda --task countdown --model runs/gpu-single-sft/model --steps 10 \
        --prompts-per-step 16 --group-size 16 --max-new-tokens 64 --lr 1e-5 --out benchmarks/RESULTS.md
        # one GPU, countdown, the small-preset policy of recipes/gpu_single_sft.yaml
    python benchmarks/vs_trl.py --device cuda --task countdown --model runs/gpu-single-sft-long/model \
        --task-args '{"min_numbers": 3, "max_numbers": 3, "worked_steps": true, "worked_search": true}' --steps 10 \
        --prompts-per-step 16 --group-size 16 --max-new-tokens 384 --lr 1e-5 --out benchmarks/RESULTS.md
        # one GPU, long answers (~280 tokens: the search's pairs and worked steps in <think>):
        # recipes/gpu_single_sft_long.yaml's policy
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_busy import (  # noqa: E402 (after the path)
    Source, busy_cell, busy_figures, nvml_sources, sampling, windows,
)

logger = logging.getLogger("vs_trl")

DEFAULT_MODEL = Path("recipes/assets/quickstart-sft")
FINAL_STEPS = 3  # "final reward" = mean rollout reward of the last this-many steps
# Ours' step in parts (perf/ keys of its metrics, median of steps 2..N): the rollout phase on the driver
# (rollout.timing), the engine's own time in it, and the hand-over of memory around training (colocated GPUs).
BREAKDOWN = ("rollout_dispatch_s", "rollout_generate_s", "rollout_tail_s", "rollout_call_ms", "rollout_transport_ms",
             "rollout_assemble_s", "rollout_reward_s", "engine_busy_s", "engine_decode_steps", "engine_decode_step_ms",
             "engine_command_s", "engine_gather_s", "engine_graph_captures", "engine_graph_capture_s", "engine_memory_resume_s",
             "rollout_sleep_s", "rollout_wake_s", "batch_build_s", "engine_weights_update_s", "weights_readback_s",
             "trainer_gpu_busy_share")
# per side, in result.json (TRL's failure, if any)
RESULT_KEYS = ("step_times", "cpu_times", "rewards", "response_lengths", "total_s", "gpu_busy",
               "gpu_busy_steps", "gpu_busy_driver", "gpu_busy_driver_steps", "failed", "grad_norms")


# ---------------------------------------------------------------------------------------------------- shared setup


# --ours-loop async: recipes/async_reinforce.yaml's algorithm (GLM-5's asynchronous stage), --ours-max-staleness steps
# ahead at most: REINFORCE with double-sided IS against the rollout's own log-probs, on group-centred rewards.
ASYNC_ALGORITHM = {"name": "async_reinforce", "max_staleness": 1, "partial_rollout": "retract", "kl_coef": 0.0,
                   "loss_aggregation": "token_mean"}


def recipe_dict(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """Our recipe for the benchmark: the quickstart's GRPO (CPU) or recipes/gpu_single.yaml's placement and
    precision (cuda), on the benchmark's task and sizes."""
    task: dict[str, Any] = {"kind": args.task, "eval_size": args.eval_prompts, "train_size": args.train_size}
    if args.task == "arithmetic":
        task["task_args"] = {"max_digits": 2}
    task["task_args"] = {**task.get("task_args", {}), **args.task_args}
    cuda = args.device == "cuda"
    recipe = {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"tasks": [task], "apply_chat_template": True, "max_prompt_length": args.max_prompt_length,
                 "seed": args.seed},
        "rollout": {"num_engines": args.ours_engines, "n_samples_per_prompt": args.group_size,
                    "prompts_per_step": args.prompts_per_step, "max_response_length": args.max_new_tokens,
                    "temperature": args.temperature, "top_p": 1.0, "top_k": -1},
        "algorithm": ({"name": "grpo", "eps_clip_low": 0.2, "eps_clip_high": 0.28, "kl_coef": 0.0,
                       "advantage_std_normalize": True, "loss_aggregation": "token_mean",
                       "use_rollout_logprobs": not args.recompute_old_logprobs}
                      if args.ours_loop == "sync" else {**ASYNC_ALGORITHM, "max_staleness": args.ours_max_staleness,
                                            "partial_rollout": args.ours_partial_rollout}),
        "trainer": {"num_workers": args.ours_workers, "data_parallel": "replicate", "learning_rate": args.lr, "num_steps": args.steps, "micro_batch_tokens": args.micro_batch_tokens,
                    "warmup_steps": 0, "lr_schedule": "constant", "weight_decay": 0.0, "adam_betas": [0.9, 0.999],
                    "max_grad_norm": 1.0, "num_steps_per_rollout": 1, "seed": args.seed},
        "logging": {"wandb_mode": "disabled", "run_dir": str(run_dir), "eval_every": 0},
        "checkpoint": {"save_every": 0, "keep_last": 1},
    }
    if cuda:  # recipes/gpu_single.yaml: engine and trainer take turns on the one GPU, bf16 mixed precision
        recipe["model"]["ops_backend"] = "auto"
        recipe["trainer"]["mixed_precision"] = True
        del recipe["trainer"]["data_parallel"]  # replicate trains in float32 only: the default, fsdp
        recipe["cluster"] = {"placement": "colocated", "num_gpus_per_engine": 0.5, "num_gpus_per_trainer": 0.5,
                             "engine_kv_cache_in_training": args.ours_kv_cache}
        if args.ours_loop == "async":  # the engine generates while the trainer steps, both on the one GPU
            recipe["cluster"] = {"placement": "disaggregated", "num_gpus_per_engine": 0.5, "num_gpus_per_trainer": 0.5}
    recipe["rollout"]["overlap_schedule"] = args.ours_overlap == "on"
    if args.ours_decode_steps is not None:
        recipe["rollout"]["num_continuous_decode_steps"] = args.ours_decode_steps
    recipe["rollout"]["enable_torch_compile"] = args.ours_engine_compile == "on"
    recipe["trainer"]["compile"] = args.ours_compile == "on"
    recipe["rollout"]["prefetch_next_step"] = args.ours_prefetch == "on"
    recipe["logging"]["profile_steps"] = args.profile_steps
    recipe["logging"]["profile_activities"] = args.profile_activities
    return recipe


def trl_micro_batch(args: argparse.Namespace) -> int:
    """TRL's per-device train batch: the step's samples, or --trl-micro-batch of them per accumulated micro-batch."""
    batch = args.prompts_per_step * args.group_size
    return min(batch, args.trl_micro_batch)


def resolve_model(args: argparse.Namespace, workdir: Path) -> tuple[Path, str]:
    """(model directory, how it was chosen); builds a random quickstart-preset model when none is given or shipped."""
    if args.model is not None:
        if not (args.model / "config.json").exists():
            raise SystemExit(f"--model {args.model}: no config.json there; expected an HF model directory")
        return args.model, str(args.model)
    if args.preset is None and (DEFAULT_MODEL / "config.json").exists():
        return DEFAULT_MODEL, str(DEFAULT_MODEL)
    from slime_dsa.checkpoint import build_model, save_pretrained
    from slime_dsa.data.tokenizer import build_tokenizer
    from slime_dsa.models.presets import preset_config

    preset = args.preset or "quickstart"
    if args.preset is None:
        logger.warning("%s not found: using a randomly initialised quickstart-preset model", DEFAULT_MODEL)
    tokenizer = build_tokenizer()
    config = preset_config(preset, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    target = workdir / f"random_{preset}"
    model = build_model(config, seed=args.seed)
    save_pretrained(model, target)
    tokenizer.save_pretrained(target)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    why = "" if args.preset else "; recipes/assets/quickstart-sft absent"
    return target, f"random {preset} preset ({params:.1f}M params, seed {args.seed}{why})"


def cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and all its live descendants."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # exited meanwhile
            pass
    return total


def _trl_rewards(reward_fn: Any, completions: list, answer: list) -> list[float]:
    """`reward_fn` (one of ours) over TRL's completions; a crashing call scores that completion 0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        try:
            rewards.append(float(reward_fn(None, text, expected)["reward"]))
        except Exception:  # noqa: BLE001 - as in ours: a reward crash costs the sample, not the run
            logger.exception("reward failed on %r", text)
            rewards.append(0.0)
    return rewards


# Plain functions, not partials: TRL names each reward's metrics after its __name__.
def trl_arithmetic_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """Our arithmetic reward in TRL's reward_funcs signature."""
    from rollout.rewards.arithmetic import arithmetic_reward

    return _trl_rewards(arithmetic_reward, completions, answer)


def trl_countdown_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """Our countdown reward in TRL's reward_funcs signature (`answer`: the ground truth as a JSON string)."""
    from rollout.rewards.countdown import countdown_reward

    return _trl_rewards(countdown_reward, completions, answer)


TRL_REWARDS = {"arithmetic": trl_arithmetic_reward, "countdown": trl_countdown_reward}


def trl_answer(answer: Any) -> str:
    """A prompt's ground truth as a TRL dataset string: as is for arithmetic, JSON for countdown's dict (which
    a datasets column would otherwise turn into a struct)."""
    return json.dumps(answer) if isinstance(answer, dict) else str(answer)


def step_times(stamps: list[float]) -> list[float]:
    """Per-step seconds from consecutive timestamps (the first is the loop's start)."""
    return [b - a for a, b in zip(stamps, stamps[1:])]


# ---------------------------------------------------------------------------------------------------- ours


def run_ours(args: argparse.Namespace, model_dir: Path, workdir: Path,
             gpu: dict[str, Source] | None = None) -> dict[str, Any]:
    """Our synchronous GRPO loop (--ours-engines embedded engines + --ours-workers trainer ranks as Ray actors).
    gpu: the GPU utilisation sources sampled while it runs (gpu_busy.nvml_sources; none: not measured)."""
    import ray
    import yaml

    from slime_dsa.config import load_recipe
    from slime_dsa.logging.metrics import read_metrics
    from slime_dsa.orchestrator.train import run_training

    stamps: list[float] = []
    cpu: list[float] = []
    final: dict[str, Any] = {}

    def on_weights(version: int, state: dict | None) -> None:
        stamps.append(time.perf_counter())
        cpu.append(cpu_seconds())
        final["version"] = version
        if state is not None:
            final["state"] = state  # a fresh copy from the trainer: no clone needed

    path = workdir / "ours.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, model_dir, workdir / "ours")))
    t0 = time.perf_counter()
    try:
        with sampling(gpu or {}) as samplers:
            run_dir = run_training(load_recipe(path), on_weights=on_weights, hook_state=args.hook_state)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    total = time.perf_counter() - t0
    records = read_metrics(run_dir)
    # The weights read back for this script's hook (the eval's state) are not ours' step work: out of the clock.
    readback = [r.get("perf/weights_readback_s", 0.0) for r in records if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
    lengths = [r["rollout/response_length_mean"] for r in records if "rollout/response_length_mean" in r]
    if final.get("version") != args.steps or len(rewards) != args.steps or "state" not in final:
        raise RuntimeError(f"ours: expected {args.steps} steps, got weight version {final.get('version')} and "
                           f"{len(rewards)} logged rewards (see {run_dir}/train.log)")
    later = records[1:] or records
    parts = {key: statistics.median(r.get(f"perf/{key}_time_s", 0.0) for r in later)
             for key in ("rollout", "train", "sync")}
    breakdown = {key: statistics.median(r[f"perf/{key}"] for r in later) for key in BREAKDOWN
                 if all(f"perf/{key}" in r for r in later)}
    steps = windows(stamps, readback)
    return {"step_times": [end - start for start, end in steps], "cpu_times": step_times(cpu), "rewards": rewards,
            "response_lengths": lengths, "state": final["state"], "total_s": total, "run_dir": run_dir, "parts": parts,
            "breakdown": breakdown,
            "readback_s": readback, **busy_figures(samplers, steps)}


# ---------------------------------------------------------------------------------------------------- TRL


def trl_grpo_settings(max_new_tokens: int, temperature: float = 1.0) -> dict[str, Any]:
    """GRPOConfig's sampling and loss settings that match ours: the whole vocabulary at `temperature`, no KL,
    Clip-Higher (0.2 / 0.28), token-mean (dapo) loss, group-scaled rewards, one update per batch."""
    return dict(max_completion_length=max_new_tokens, temperature=temperature, top_p=1.0, top_k=0, beta=0.0,
                epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", num_iterations=1,
                mask_truncated_completions=False, gradient_checkpointing=False, router_aux_loss_coef=0.0,
                shuffle_dataset=False, disable_tqdm=True)


def run_trl(args: argparse.Namespace, model_dir: Path, workdir: Path, messages: list[str],
            answers: list[str], gpu: dict[str, Source] | None = None) -> dict[str, Any]:
    """TRL's GRPOTrainer on --device with the same prompts (in our order), reward and hyper-parameters; `gpu` as
    run_ours'."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = args.device == "cuda"

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu: list[float] = []

        def stamp(self) -> None:
            if cuda:  # the optimiser step's kernels may still be queued
                torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())
            self.cpu.append(cpu_seconds())

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.stamp()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.stamp()

    torch.set_num_threads(args.trl_threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # float32 weights on both devices; on cuda bf16=True autocasts the forward (mixed precision, as ours)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=args.trl_attn)
    dataset = datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": m}] for m in messages], "answer": answers,
    })
    batch = args.prompts_per_step * args.group_size
    micro = trl_micro_batch(args)
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), use_cpu=not cuda, bf16=cuda, fp16=False, report_to="none", logging_steps=1,
        save_strategy="no", max_steps=args.steps, seed=args.seed, data_seed=args.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro, num_generations=args.group_size,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, max_grad_norm=1.0, dataloader_num_workers=0, remove_unused_columns=False,
        **trl_grpo_settings(args.max_new_tokens, args.temperature),
    )
    clock = StepClock()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=TRL_REWARDS[args.task], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    failed = None
    with sampling(gpu or {}) as samplers:
        try:
            trainer.train()
        except Exception as err:  # noqa: BLE001 - the steps TRL finished are still measured (and ours' whole run)
            failed = f"step {len(clock.stamps)}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
            logger.exception("TRL failed at %s", failed)
    total = time.perf_counter() - t0
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    grad_norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    out_dir = None
    if failed is None:
        out_dir = workdir / "trl_final"
        trainer.save_model(str(out_dir))
        tokenizer.save_pretrained(out_dir)
        if len(rewards) != args.steps:
            raise RuntimeError(f"trl: expected {args.steps} logged rewards, got {len(rewards)}")
    done = min(len(clock.stamps), len(rewards) + 1)  # stamps of finished steps, after the start's
    return {"step_times": step_times(clock.stamps[:done]), "cpu_times": step_times(clock.cpu[:done]),
            "rewards": rewards[: done - 1], "response_lengths": lengths[: done - 1], "grad_norms": grad_norms,
            "model_dir": out_dir, "total_s": total, "failed": failed,
            **busy_figures(samplers, windows(clock.stamps[:done]))}


def user_messages(task: Any, prompts: list) -> list[str]:
    """The raw user message (before the chat template) of each of our prompts."""
    columns = task.train.dataset.select_columns(["prompt_text", "prompt"]).to_dict()
    raw = dict(zip(columns["prompt_text"], columns["prompt"]))
    return [raw[p.prompt_text] for p in prompts]


def trl_prompt_ids_match(tokenizer: Any, messages: list[str], prompts: list) -> bool:
    """Whether TRL's chat-template tokenization (tokenize=True) gives our prompt ids for every prompt."""
    ids = tokenizer.apply_chat_template([[{"role": "user", "content": m}] for m in messages],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    return all(list(a) == list(p.prompt_ids) for a, p in zip(ids, prompts))


# ---------------------------------------------------------------------------------------------------- eval, report


def evaluate(model_dir: Path, tokenizer: Any, tasks: list, args: argparse.Namespace,
             state: dict | None = None) -> float:
    """Greedy pass@1 of `model_dir` (or of `state` loaded into it) on the held-out prompts."""
    import torch

    from slime_dsa import load_model
    from slime_dsa.sft import greedy_eval

    model = load_model(model_dir, dtype=torch.float32, device=args.device)
    if state is not None:
        model.load_state_dict(state)
    result = greedy_eval(model, tokenizer, tasks, args.eval_prompts, args.max_new_tokens)["eval/pass@1"]
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def summary(side: dict[str, Any]) -> dict[str, float]:
    """Medians over steps 2..N (step 1 alone when that is all), step 1, and rewards; NaN where a side that failed
    finished no step."""
    times, cpu, rewards = side["step_times"], side["cpu_times"], side["rewards"]
    nan = float("nan")
    k = min(FINAL_STEPS, len(rewards))
    return {"median_step_s": statistics.median(times[1:] or times) if times else nan,
            "first_step_s": times[0] if times else nan, "median_cpu_s": statistics.median(cpu[1:] or cpu) if cpu else nan,
            "first_reward": rewards[0] if rewards else nan, "final_reward": sum(rewards[-k:]) / k if k else nan}


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def at_least_equal(ours: float, trl: float, n: int) -> tuple[bool, str]:
    """Whether ours' mean reward over n samples is better than TRL's or equal within noise (less by at most two
    standard errors of the difference), and a note saying which. A strict >= on such estimates fails at random
    for equal policies: at step 1 both sides sample the same weights on the same prompts, and their rewards differ
    by a few hundredths. Rewards in [0, 1]: p(1 - p) bounds the variance (equal for 0/1 rewards)."""
    se = math.sqrt(sum(max(p * (1 - p), 0.0) for p in (ours, trl)) / max(n, 1))
    diff = ours - trl
    if diff >= 0:
        return True, f"better or equal (+{diff:.3f})"
    if diff >= -2 * se:
        return True, f"equal within noise ({diff:.3f}, two standard errors {2 * se:.3f})"
    return False, f"worse ({diff:.3f}, beyond two standard errors {2 * se:.3f})"


def hardware(device: str = "cpu") -> str:
    """The CPU (model, count) and, for cuda, the GPU in front of it."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
        cpu = f"{info.get('Model name', platform.processor())}, {info.get('CPU(s)', os.cpu_count())} CPUs"
    except (OSError, subprocess.CalledProcessError):
        cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    if device != "cuda":
        return cpu
    import torch

    props = torch.cuda.get_device_properties(0)
    return f"1x {props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs); {cpu}"


def task_desc(args: argparse.Namespace) -> str:
    what = "arithmetic (1-2 digits" if args.task == "arithmetic" else "countdown (built-in defaults"
    if args.task_args:
        what += ", task_args " + json.dumps(args.task_args)
    return f"{what}, chat template, max prompt {args.max_prompt_length} tokens, data seed {args.seed})"


def mean_length(side: dict[str, Any]) -> str:
    """The side's mean response tokens over its steps' means ('n/a' when its logs had none)."""
    lengths = side.get("response_lengths") or []
    return f"{statistics.mean(lengths):.1f}" if lengths else "n/a"


def setup_desc(args: argparse.Namespace) -> tuple[str, str]:
    """(the precision, how each side runs) for the report."""
    loop = ("GRPO in the synchronous loop" if args.ours_loop == "sync" else
            f"async_reinforce in the asynchronous loop (max_staleness {args.ours_max_staleness}, partial_rollout "
            f"{args.ours_partial_rollout}: the next steps' rollouts run while the trainer steps; DIS on group-centred rewards, no π_old; "
            "not TRL's algorithm)")
    if args.device == "cuda":
        placement = ("colocated on the one GPU (0.5 + 0.5; Ray actors that take turns; "
                     f"cluster.engine_kv_cache_in_training {args.ours_kv_cache}: what the engine does with its KV "
                     "cache while the trainer steps; " if args.ours_loop == "sync" else
                     "on the one GPU at the same time (0.5 + 0.5, placement disaggregated: the engine never pauses "
                     "for the trainer but for the weight push; ")
        return ("bf16 mixed precision (float32 master weights and AdamW state on both sides)",
                f"ours: `run_training`, {loop}, with its defaults and recipes/gpu_single.yaml's resources, 1 embedded "
                f"engine (bf16 weights, CUDA graphs in decode) + 1 FSDP2 trainer rank (trainer.mixed_precision) "
                f"{placement}overlap scheduler {args.ours_overlap}, "
                f"{args.ours_decode_steps or 'the default'} decode step(s) a launch, "
                f"rollout.enable_torch_compile {args.ours_engine_compile}, "
                f"prefetch of the next step's calls "
                f"{args.ours_prefetch}, trainer.compile {args.ours_compile}), "
                f"Triton kernels (ops_backend auto), micro_batch_tokens {args.micro_batch_tokens}; "
                f"TRL: GRPOTrainer in-process on the GPU, model loaded in float32 with bf16=True (accelerate's bf16 "
                f"autocast in generation and training), use_cpu=False, HF `generate` (no vLLM), "
                f"micro-batches of {trl_micro_batch(args)} samples accumulated into one optimizer step, "
                f"attn_implementation {args.trl_attn}, {args.trl_threads} torch thread(s)")
    return ("float32",
            f"ours: `run_training`, {loop}, with its defaults, {args.ours_engines} embedded engine(s) + {args.ours_workers} "
            f"trainer rank(s) (data_parallel replicate; Ray actors, 1 CPU / 1 torch thread each, colocated: engines "
            f"and trainers take turns); TRL: GRPOTrainer on CPU in-process, {args.trl_threads} torch thread(s), HF "
            f"`generate`, attn_implementation {args.trl_attn}")


def busy_line(ours: dict[str, Any], trl_side: dict[str, Any]) -> str:
    """The report's GPU-busy line: both sides' mean utilisation over steps 2..N, or why there is none."""
    cells = f"{busy_cell(ours.get('gpu_busy'))} / {busy_cell(trl_side.get('gpu_busy'))}"
    if ours.get("gpu_busy") is None and trl_side.get("gpu_busy") is None:
        return f"GPU busy, ours / TRL: {cells} (not measured: no GPU, or no pynvml)"
    line = (f"GPU busy, ours / TRL: **{cells}** (NVML device utilisation read every 20 ms, mean over steps "
            f"2..N; device-wide, so ours' engine and trainer actors count)")
    if ours.get("gpu_busy_driver") is None and trl_side.get("gpu_busy_driver") is None:
        return line
    return (f"{line}; by the driver's own time-stamped samples: "
            f"**{busy_cell(ours.get('gpu_busy_driver'))} / {busy_cell(trl_side.get('gpu_busy_driver'))}**")


def markdown(args: argparse.Namespace, model_desc: str, ours: dict, trl_side: dict, evals: dict[str, float],
             ids_match: bool, versions: str, load: tuple[float, float]) -> str:
    so, st = summary(ours), summary(trl_side)
    ratio = st["median_step_s"] / so["median_step_s"]
    cpu_ratio = st["median_cpu_s"] / so["median_cpu_s"]
    k = min(FINAL_STEPS, args.steps)
    roll_ok, roll_note = at_least_equal(so["final_reward"], st["final_reward"], k * args.prompts_per_step * args.group_size)
    eval_ok, eval_note = (at_least_equal(evals["ours"], evals["trl"], args.eval_prompts) if evals["trl"] is not None
                          else (False, "no TRL eval"))
    failed = trl_side.get("failed")
    reached = ratio >= 3.0 and roll_ok and eval_ok and not failed
    cmd = "python benchmarks/vs_trl.py " + shlex.join(sys.argv[1:])
    precision, sides = setup_desc(args)
    where = "one GPU" if args.device == "cuda" else "CPU"
    shared = "" if args.device == "cuda" else "shared; "
    lines = [
        f"### GRPO vs TRL GRPOTrainer: per-step time and reward ({where})",
        "",
        f"- date: {args.date}; device: {args.device}; hardware: {hardware(args.device)} ({shared}load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end); {versions}",
        f"- command: `{cmd}`",
        f"- model: {model_desc}; {task_desc(args)}; "
        f"{args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples, max {args.max_new_tokens} "
        f"new tokens, T={args.temperature}, lr {args.lr}, eps 0.2/0.28, no KL, token-mean loss, {precision}",
        f"- {sides}",
        f"- same prompts in the same order per step (TRL prompt ids equal ours: {'yes' if ids_match else 'NO'}); "
        f"step time = wall time between weight versions, median over steps 2..{args.steps}; eval = greedy pass@1 on "
        f"{args.eval_prompts} held-out prompts (`slime_dsa.sft.greedy_eval`), initial model {evals['initial']:.3f}",
        *([f"- **TRL failed at {failed}**: its figures are over the {len(trl_side['step_times'])} steps it finished "
           f"(grad_norm per logged step: {' '.join(str(g) for g in trl_side.get('grad_norms', []))}); no TRL eval"]
          if failed else []),
        "",
        f"| trainer | median step s | median CPU s / step | GPU busy | step 1 s (warm-up) | {args.steps} steps s "
        f"| with setup s | reward step 1 | reward last {k} steps | eval pass@1 after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, side, s, ev in (("ours", ours, so, evals["ours"]), ("TRL", trl_side, st, evals["trl"])):
        lines.append(f"| {name} | {s['median_step_s']:.2f} | {s['median_cpu_s']:.2f} "
                     f"| {busy_cell(side.get('gpu_busy'))} | {s['first_step_s']:.2f} "
                     f"| {sum(side['step_times']):.1f} | {side['total_s']:.1f} | {s['first_reward']:.3f} "
                     f"| {s['final_reward']:.3f} | {_score(ev)} |")
    lines.append("")
    lines += [
        f"- step-time ratio TRL / ours: **{ratio:.2f}x** (wall); CPU-time ratio TRL / ours: {cpu_ratio:.2f}x",
        f"- {busy_line(ours, trl_side)}",
        "- ours per step (median of steps 2..N, from its metrics): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in ours["parts"].items())
        + f"; pi_old {'recomputed by the trainer' if args.recompute_old_logprobs else 'from the rollout log-probs'}"
        + "; the weight push read the weights back for this script's hook "
        + ("at every step" if args.hook_state == "every" else "at the last step only")
        + f" (in its sync time, out of its step time: {sum(ours.get('readback_s', [])):.2f} s in all)",
        "- ours' step in parts (perf/ keys of its metrics.jsonl, median of steps 2..N): "
        + (", ".join(f"{k} {v:.3g}" for k, v in ours.get("breakdown", {}).items()) or "none logged"),
        f"- goal (ours >= 3x faster per step with equal or better reward): "
        f"{'reached' if reached else 'NOT reached'}{' (not decided: TRL failed)' if failed else ''} ({ratio:.2f}x; "
        f"reward of the last {k} steps ours {so['final_reward']:.3f} vs TRL {st['final_reward']:.3f}: {roll_note}; "
        f"eval pass@1 ours {evals['ours']:.3f} vs TRL {_score(evals['trl'])}: {eval_note})",
        "- 'with setup': ours from `run_training` to its return (Ray start, engine and trainer actors, final "
        "checkpoint, shutdown); TRL from building GRPOTrainer to the end of `train()`",
        f"- mean response tokens (mean of the steps' means): ours {mean_length(ours)}, TRL {mean_length(trl_side)}",
        "- per-step mean response tokens ours: " + " ".join(f"{n:.1f}" for n in ours.get("response_lengths", [])),
        "- per-step mean response tokens TRL: " + " ".join(f"{n:.1f}" for n in trl_side.get("response_lengths", [])),
        "- per-step rewards ours: " + " ".join(f"{r:.3f}" for r in ours["rewards"]),
        "- per-step rewards TRL: " + " ".join(f"{r:.3f}" for r in trl_side["rewards"]),
        "- per-step seconds ours: " + " ".join(f"{t:.2f}" for t in ours["step_times"]),
        "- per-step seconds TRL: " + " ".join(f"{t:.2f}" for t in trl_side["step_times"]),
        "- per-step CPU seconds ours: " + " ".join(f"{t:.2f}" for t in ours["cpu_times"]),
        "- per-step CPU seconds TRL: " + " ".join(f"{t:.2f}" for t in trl_side["cpu_times"]),
        "- per-step GPU busy ours: " + (" ".join(busy_cell(b) for b in ours.get("gpu_busy_steps", [])) or "-"),
        "- per-step GPU busy TRL: " + (" ".join(busy_cell(b) for b in trl_side.get("gpu_busy_steps", [])) or "-"),
        *(f"- per-step GPU busy {name}, the driver's samples: " + " ".join(busy_cell(b) for b in per_step)
          for name, per_step in (("ours", ours.get("gpu_busy_driver_steps")),
                                 ("TRL", trl_side.get("gpu_busy_driver_steps"))) if per_step),
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help=f"HF model directory (default {DEFAULT_MODEL})")
    parser.add_argument("--preset", default=None,
                        help="instead: a randomly initialised model of this preset (e.g. small), saved for both sides")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default), or cuda: both sides on one GPU in bf16 mixed precision")
    parser.add_argument("--task", choices=("arithmetic", "countdown"), default="arithmetic",
                        help="built-in task: arithmetic (1-2 digits, the quickstart's) or countdown (the GPU recipes')")
    parser.add_argument("--task-args", type=_json_object, default={},
                        help="JSON object of the built-in task's parameters (data.tasks.0.task_args), e.g. "
                             "'{\"min_numbers\": 3, \"max_numbers\": 3, \"worked_steps\": true, "
                             "\"worked_search\": true}' for recipes/gpu_single_sft_long.yaml's policy")
    parser.add_argument("--max-prompt-length", type=int, default=None,
                        help="prompt tokens (longer prompts are dropped); default 64 for arithmetic, 160 for countdown")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="ours: trainer micro-batch token budget; default 4096 on CPU, on cuda the whole "
                             "step's batch (prompts x samples x (max prompt + max new tokens))")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (TRL num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--train-size", type=int, default=15000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--recompute-old-logprobs", action="store_true",
                        help="ours: recompute pi_old with a trainer forward instead of using the rollout log-probs")
    parser.add_argument("--trl-micro-batch", type=int, default=256,
                        help="TRL: samples per training micro-batch (gradient accumulation over the step's samples; "
                             "transformers' dense indexer scores of 1,024 samples at once do not fit an H200)")
    parser.add_argument("--trl-threads", type=int, default=1, help="torch threads of the TRL side (and the eval)")
    parser.add_argument("--trl-attn", choices=("sdpa", "eager"), default="sdpa",
                        help="TRL: the model's attn_implementation in from_pretrained (transformers' default sdpa; "
                             "eager if sdpa's CUDA backward is what turns the gradients non-finite: "
                             "benchmarks/trl_nan_check.py tells)")
    parser.add_argument("--ours-engines", type=int, default=1, help="ours: embedded engines (1 CPU each)")
    parser.add_argument("--ours-workers", type=int, default=1,
                        help="ours: trainer ranks (1 CPU each; whole-model replicas, one gradient all-reduce)")
    parser.add_argument("--ours-kv-cache", choices=("auto", "release", "keep"), default="auto",
                        help="ours on cuda: cluster.engine_kv_cache_in_training, what the engine does with its KV "
                             "cache (and decode CUDA graphs) while the trainer steps (default auto: keep a small one)")
    parser.add_argument("--ours-loop", choices=("sync", "async"), default="sync",
                        help="ours: sync = GRPO in the synchronous loop, as TRL (default); async = async_reinforce "
                             "with max_staleness 1: rollout of the next step overlaps training (on cuda the engine "
                             "and the trainer rank share the GPU without taking turns, placement disaggregated). "
                             "Not the same algorithm as TRL's: the report names it, and the reward verdict decides")
    parser.add_argument("--ours-max-staleness", type=int, default=1,
                        help="ours with --ours-loop async: algorithm.max_staleness, how many steps rollout may run "
                             "ahead of training (default 1)")
    parser.add_argument("--ours-partial-rollout", choices=("retract", "in_place", "off"), default="retract",
                        help="ours with --ours-loop async: algorithm.partial_rollout, what answers in flight at a "
                             "weight push do (default retract: re-prefilled under the new weights; in_place: keep "
                             "the cache computed under the old ones; off: aborted and regenerated)")
    parser.add_argument("--ours-prefetch", choices=("on", "off"), default=None,
                        help="ours with --ours-loop sync: rollout.prefetch_next_step, the next step's calls sent to "
                             "the paused engine while the trainer steps (default: on with --device cuda, as "
                             "recipes/gpu_single.yaml; off on cpu, the recipe default)")
    parser.add_argument("--ours-compile", choices=("on", "off"), default="off",
                        help="ours: trainer.compile, each decoder layer of the trained model torch.compile'd (default "
                             "off, the recipe default; on a GPU its log-probs then differ from the engine's by ~5e-3, "
                             "and the warm-up takes about a minute longer)")
    parser.add_argument("--ours-overlap", choices=("on", "off"), default="on",
                        help="ours: rollout.overlap_schedule, the engine launches each decode step before it reads "
                             "the previous one's tokens (default on, the recipe's default for embedded engines)")
    parser.add_argument("--ours-decode-steps", type=int, default=None,
                        help="ours: rollout.num_continuous_decode_steps, decode steps an engine launches at once while "
                             "every request decodes (default: the recipe's, 4 for embedded engines)")
    parser.add_argument("--ours-engine-compile", choices=("on", "off"), default="off",
                        help="ours: rollout.enable_torch_compile, the engine's pointwise chains (norms, rotations, "
                             "routing) compiled into fused kernels (default off, the recipe default)")
    parser.add_argument("--hook-state", choices=("every", "last"), default=None,
                        help="ours: the weight push reads the weights back for this script's hook at every step "
                             "(default on cpu, as before; ~ms for the quickstart model) or at the last one only "
                             "(default on cuda: ~0.5 s a step for the small preset on an H200, not ours' cost)")
    parser.add_argument("--profile-steps", type=int, nargs="*", default=[],
                        help="ours: steps traced with torch.profiler in the engines and trainer ranks "
                             "(logging.profile_steps: <workdir>/ours/profile/step_N). They run slower and their "
                             "traces are written between steps, inside this report's step windows: a run for the "
                             "timeline, not for the ratio (benchmarks/vs_trl_ours.py runs ours alone)")
    parser.add_argument("--profile-activities", nargs="+", choices=("CPU", "GPU"), default=["CPU", "GPU"],
                        help="what --profile-steps records (logging.profile_activities): GPU alone perturbs the step "
                             "least")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="date written in the report")
    parser.add_argument("--workdir", type=Path, default=None, help="run directories (default: a temporary one)")
    parser.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = parser.parse_args(argv)
    for name in ("steps", "prompts_per_step", "max_new_tokens", "eval_prompts", "trl_threads", "ours_engines",
                 "ours_workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    if args.model is not None and args.preset is not None:
        parser.error("--model and --preset exclude each other: give one model")
    if args.group_size < 2:
        parser.error(f"--group-size ({args.group_size}) must be >= 2 (GRPO needs a group)")
    if args.device == "cuda" and (args.ours_engines != 1 or args.ours_workers != 1):
        parser.error(f"--device cuda runs 1 engine + 1 trainer rank on one GPU; got --ours-engines "
                     f"{args.ours_engines} --ours-workers {args.ours_workers}")
    if args.device != "cuda" and args.ours_kv_cache != "auto":
        parser.error("--ours-kv-cache applies to --device cuda (on CPU nothing is handed over)")
    if args.ours_loop == "async" and args.ours_kv_cache != "auto":
        parser.error("--ours-kv-cache applies to --ours-loop sync (in the asynchronous loop the engine never pauses "
                     "for the trainer)")
    if args.ours_max_staleness < 1 or (args.ours_loop == "sync" and args.ours_max_staleness != 1):
        parser.error("--ours-max-staleness (>= 1) applies to --ours-loop async")
    if args.ours_loop == "sync" and args.ours_partial_rollout != "retract":
        parser.error("--ours-partial-rollout applies to --ours-loop async (the synchronous loop pushes between steps)")
    if args.ours_loop == "async" and args.ours_prefetch == "on":
        parser.error("--ours-prefetch applies to --ours-loop sync (the asynchronous loop always generates ahead)")
    if args.ours_prefetch is None:
        args.ours_prefetch = "on" if args.device == "cuda" and args.ours_loop == "sync" else "off"
    if args.ours_loop == "async" and args.recompute_old_logprobs:
        parser.error("--recompute-old-logprobs applies to --ours-loop sync (async_reinforce computes no π_old)")
    if args.hook_state is None:
        args.hook_state = "last" if args.device == "cuda" else "every"
    if args.max_prompt_length is None:
        args.max_prompt_length = 64 if args.task == "arithmetic" else 160
    step_samples = args.prompts_per_step * args.group_size
    if args.trl_micro_batch < 1 or step_samples % min(step_samples, args.trl_micro_batch):
        parser.error(f"--trl-micro-batch {args.trl_micro_batch} must divide the step's {step_samples} samples")
    if args.micro_batch_tokens is None:
        whole_batch = args.prompts_per_step * args.group_size * (args.max_prompt_length + args.max_new_tokens)
        args.micro_batch_tokens = whole_batch if args.device == "cuda" else 4096
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        import trl
    except ImportError:
        logger.error("trl is not installed: pip install -e '.[bench]' (or pip install trl)")
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        logger.error("--device cuda: torch sees no CUDA device")
        return 2
    import transformers
    from transformers import AutoTokenizer

    from slime_dsa.config import RecipeConfig
    from slime_dsa.data.prompts import TaskMixture, build_tasks

    load_start = os.getloadavg()[0]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vs_trl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, model_desc = resolve_model(args, workdir)
    torch.set_num_threads(args.trl_threads)

    recipe = RecipeConfig.model_validate(recipe_dict(args, model_dir, workdir / "ours"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tasks = build_tasks(recipe.data, tokenizer)
    # The exact stream our RolloutManager draws: step k takes prompts k*P..(k+1)*P-1 (no dynamic sampling).
    prompts = TaskMixture(tasks, seed=recipe.data.seed).take(args.steps * args.prompts_per_step)
    messages = user_messages(tasks[0], prompts)
    ids_match = trl_prompt_ids_match(tokenizer, messages, prompts)
    if not ids_match:
        logger.warning("TRL's chat-template prompt ids differ from ours for some prompts")

    gpu = nvml_sources() if args.device == "cuda" else {}
    logger.info("ours: %d steps", args.steps)
    ours = run_ours(args, model_dir, workdir, gpu)
    # Evaluated before TRL runs: an error on TRL's side can leave the CUDA context unusable (a device-side assert).
    logger.info("greedy eval of the initial model and ours' final one")
    evals = {"initial": evaluate(model_dir, tokenizer, tasks, args),
             "ours": evaluate(model_dir, tokenizer, tasks, args, state=ours["state"])}
    logger.info("TRL %s: %d steps", trl.__version__, args.steps)
    trl_side = run_trl(args, model_dir, workdir, messages, [trl_answer(p.answer) for p in prompts], gpu)
    evals["trl"] = None if trl_side["failed"] else evaluate(trl_side["model_dir"], tokenizer, tasks, args)
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    report = markdown(args, model_desc, ours, trl_side, evals, ids_match, versions, (load_start, os.getloadavg()[0]))
    print(report)
    (workdir / "result.json").write_text(json.dumps({
        "ours": {k: v for k, v in ours.items() if k in (*RESULT_KEYS, "parts", "breakdown", "readback_s")},
        "trl": {k: v for k, v in trl_side.items() if k in RESULT_KEYS},
        "eval": evals}))
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
