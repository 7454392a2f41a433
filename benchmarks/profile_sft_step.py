"""One SFT step of the `small` preset on CUDA under torch.profiler: step time and the top ops by CUDA and CPU time.

The step `slime-dsa sft recipes/gpu_single_sft.yaml` takes: float32 master weights, bf16 autocast, 256 examples of
104 prompt + 18 solution tokens (countdown's sizes). Prints tables; writes nothing.
    python benchmarks/profile_sft_step.py                  # routed experts as the trainer runs them (grouped GEMM)
    python benchmarks/profile_sft_step.py --experts loop   # the per-expert loop instead, for comparison
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from slime_dsa.checkpoint import build_model
from slime_dsa.models.glm_moe_dsa import Experts
from slime_dsa.models.presets import preset_config
from slime_dsa.sft import SupervisedExample, sft_loss

PROMPT_TOKENS, SOLUTION_TOKENS, BATCH, VOCAB = 104, 18, 256, 384


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", choices=["auto", "loop"], default="auto",
                        help="routed experts: the automatic choice (grouped GEMM) or the per-expert loop")
    if parser.parse_args().experts == "loop":
        Experts.use_grouped_mm = False
    model = build_model(preset_config("small", vocab_size=VOCAB, eos_token_id=1), seed=0, dtype=torch.float32,
                        device="cuda").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    examples = [SupervisedExample(torch.randint(2, VOCAB, (PROMPT_TOKENS,), generator=g).tolist(),
                                  torch.randint(2, VOCAB, (SOLUTION_TOKENS,), generator=g).tolist(),
                                  [1] * SOLUTION_TOKENS) for _ in range(BATCH)]

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = sft_loss(model, examples)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    for _ in range(3):  # Triton compilation, allocator warm-up
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"step s {(time.perf_counter() - start) / 3:.3f} (experts: {'loop' if Experts.use_grouped_mm is False else 'auto'})")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
