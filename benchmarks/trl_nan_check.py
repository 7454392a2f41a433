"""Where TRL's GRPO backward turns non-finite on a glm_moe_dsa policy (issue 19's long-answer run: loss 0, grad_norm
nan at step 4, with zero advantages in every group and one 30-token completion among ~330-token ones).

Each round builds one TRL training batch the way GRPOTrainer does (its own `_generate_and_score_completions`: chat
template, HF `generate`, left-padded prompts, right-padded completions, advantages from a reward that is always 0),
or, with --completions reference, the task's reference solutions as completions (no generation; TRL's padding). One
completion is cut to --short tokens + EOS (the step-4 shape). Then TRL's own `compute_loss` and a backward run under
`torch.autograd.detect_anomaly`, once per attention setting in --attn, on the same batch:
  sdpa       transformers' default (on CUDA with a padding mask: usually the memory-efficient kernel)
  sdpa-math  sdpa restricted to torch's math backend
  sdpa-eff   sdpa restricted to the memory-efficient kernel
  sdpa-cudnn sdpa restricted to cuDNN attention
  eager      transformers' eager attention
Per setting it prints the loss, the gradient norm and, when a gradient is not finite, the backward function that first
returned NaN (from the anomaly error). Nothing is trained: gradients are zeroed between settings.

    python benchmarks/trl_nan_check.py --device cuda --model runs/gpu-single-sft-long/model --rounds 4
    python benchmarks/trl_nan_check.py --model /tmp/tiny --completions reference --batch 8   # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vs_trl import trl_grpo_settings  # noqa: E402 (after the path)

logger = logging.getLogger("trl_nan_check")
ATTN = ("sdpa", "sdpa-math", "sdpa-eff", "sdpa-cudnn", "eager")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="HF model directory (with its tokenizer)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--task-args", type=json.loads,
                        default={"min_numbers": 5, "max_numbers": 6, "worked_steps": True},
                        help="countdown task_args (JSON); default: the failed run's 5-6 numbers with worked steps")
    parser.add_argument("--batch", type=int, default=256, help="samples per batch (16 prompts x 16 in the run)")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--short", type=int, default=30, help="cut one completion to this many tokens (0: none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--completions", choices=("generate", "reference"), default="generate")
    parser.add_argument("--attn", default=",".join(ATTN), help=f"comma-separated, of {', '.join(ATTN)}")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast on cuda")
    args = parser.parse_args(argv)
    args.attn = args.attn.split(",")
    if set(args.attn) - set(ATTN):
        parser.error(f"--attn {','.join(args.attn)}: expected names from {', '.join(ATTN)}")
    return args


def build_trainer(args: argparse.Namespace, prompts: list[str]) -> Any:
    """GRPOTrainer with vs_trl.py's settings (one micro-batch of --batch samples) and a reward that is always 0."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cuda = args.device == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=not cuda, bf16=cuda and not args.fp32, report_to="none",
        max_steps=1, per_device_train_batch_size=args.batch, num_generations=args.group_size,
        **trl_grpo_settings(args.max_new_tokens))
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
                          train_dataset=dataset, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); compute_loss reads it
    return trainer


def reference_batch(trainer: Any, prompts: list[str], solutions: list[str]) -> dict[str, Any]:
    """TRL's training inputs for the given completions: prompts left-padded, completions (+ EOS) right-padded."""
    import torch
    from trl.trainer.utils import pad

    tok, device = trainer.processing_class, trainer.accelerator.device
    prompt_ids = [torch.tensor(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]) for p in prompts]
    completion_ids = [torch.tensor(tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                      for s in solutions]
    ones = lambda xs: [torch.ones_like(x) for x in xs]  # noqa: E731
    mask = pad(ones(completion_ids), padding_value=0, padding_side="right").to(device)
    return {"prompt_ids": pad(prompt_ids, padding_value=tok.pad_token_id, padding_side="left").to(device),
            "prompt_mask": pad(ones(prompt_ids), padding_value=0, padding_side="left").to(device),
            "completion_ids": pad(completion_ids, padding_value=tok.pad_token_id, padding_side="right").to(device),
            "completion_mask": mask, "advantages": torch.zeros(len(prompts), device=device),
            "num_items_in_batch": mask.sum()}


def cut_one(inputs: dict[str, Any], keep: int, eos: int, pad: int) -> int:
    """Cut the longest completion to `keep` tokens, the last one EOS and padding after it, in place; returns its row."""
    mask = inputs["completion_mask"]
    row = int(mask.sum(1).argmax())
    inputs["completion_ids"][row, keep - 1] = eos
    inputs["completion_ids"][row, keep:] = pad
    mask[row, keep:] = 0
    inputs["num_items_in_batch"] = mask.sum()
    return row


def attention(trainer: Any, name: str) -> contextlib.AbstractContextManager:
    """Switch the model to the attention setting `name`; the returned context restricts sdpa's backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    trainer.model.set_attn_implementation("eager" if name == "eager" else "sdpa")
    backends = {"sdpa-math": [SDPBackend.MATH], "sdpa-eff": [SDPBackend.EFFICIENT_ATTENTION],
                "sdpa-cudnn": [SDPBackend.CUDNN_ATTENTION]}
    return sdpa_kernel(backends[name]) if name in backends else contextlib.nullcontext()


def backward(trainer: Any, inputs: dict[str, Any], name: str) -> str:
    """One loss and backward under anomaly detection: a line with the loss, grad norm and the first NaN function."""
    import torch

    model = trainer.model
    model.zero_grad(set_to_none=True)
    first_nan = "-"
    try:
        with attention(trainer, name), torch.autograd.detect_anomaly(check_nan=True):
            loss = trainer.compute_loss(model, inputs)
            loss.backward()
        shown = f"{loss.item():.4g}"
    except RuntimeError as e:  # detect_anomaly names the backward function that returned NaN
        found = re.search(r"Function '(\w+)' returned nan values in its (\d+)\w* output", str(e))
        first_nan = f"{found.group(1)} (output {found.group(2)})" if found else \
            "none; the run failed: " + str(e).splitlines()[0][:100]
        shown = "-"
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = f"{torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])):.4g}" \
        if grads else "-"
    bad = sum(1 for g in grads if not torch.isfinite(g).all())
    model.zero_grad(set_to_none=True)
    return f"  {name:10s} loss {shown:>8s}  grad_norm {norm}  non-finite grads {bad}  first NaN: {first_nan}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    import torch

    from slime_dsa.data.tasks import build_task_splits

    prompts_per_round = args.batch // args.group_size
    rows = build_task_splits("countdown", train_size=prompts_per_round * args.rounds, eval_size=0, seed=7,
                             **args.task_args)["train"]
    trainer = build_trainer(args, rows["prompt"])
    eos = trainer.processing_class.eos_token_id
    logger.info("torch %s, device %s, attention settings %s", torch.__version__, args.device, args.attn)
    for r in range(args.rounds):
        part = slice(r * prompts_per_round, (r + 1) * prompts_per_round)
        prompts = [p for p in rows["prompt"][part] for _ in range(args.group_size)]
        trainer.model.train()
        if args.completions == "generate":
            with attention(trainer, "sdpa"):
                inputs = trainer._generate_and_score_completions([{"prompt": [{"role": "user", "content": p}]}
                                                                  for p in prompts])
        else:
            solutions = [s for s in rows["solution"][part] for _ in range(args.group_size)]
            inputs = reference_batch(trainer, prompts, solutions)
        row = cut_one(inputs, args.short, eos, trainer.processing_class.pad_token_id) if args.short else None
        lengths = inputs["completion_mask"].sum(1)
        print(f"round {r + 1}: prompts {tuple(inputs['prompt_ids'].shape)}, completions "
              f"{tuple(inputs['completion_ids'].shape)}, lengths {int(lengths.min())}-{int(lengths.max())} "
              f"(mean {lengths.float().mean():.0f}), row {row} cut to {args.short}, advantages "
              f"{'all 0' if not inputs['advantages'].any() else 'not all 0'}", flush=True)
        for name in args.attn:
            print(backward(trainer, inputs, name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
