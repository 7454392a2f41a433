"""One SFT step of the `small` preset on CUDA under torch.profiler: step time and the top ops by CUDA and CPU time.

The step `slime-dsa sft recipes/gpu_single_sft.yaml` takes: float32 master weights, bf16 autocast, 256 examples of
104 prompt + 18 solution tokens (countdown's sizes). Prints tables; writes nothing.
    python benchmarks/profile_sft_step.py
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from slime_dsa.checkpoint import build_model
from slime_dsa.models.presets import preset_config
from slime_dsa.sft import sft_loss

PROMPT_TOKENS, SOLUTION_TOKENS, BATCH, VOCAB = 104, 18, 256, 384


def main() -> None:
    model = build_model(preset_config("small", vocab_size=VOCAB, eos_token_id=1), seed=0, dtype=torch.float32,
                        device="cuda").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    examples = [(torch.randint(2, VOCAB, (PROMPT_TOKENS,), generator=g).tolist(),
                 torch.randint(2, VOCAB, (SOLUTION_TOKENS,), generator=g).tolist()) for _ in range(BATCH)]

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
    print(f"step s {(time.perf_counter() - start) / 3:.3f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
