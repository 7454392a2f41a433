"""Sparse MLA backward: the key-range path against the general (atomic) kernel, in one process on one GPU.

    PYTHONPATH=. python benchmarks/sparse_mla_bwd.py

Shapes (bf16, one layer's `sparse_mla_bwd`, dlse given):
- sft_small: the `small` preset's SFT step (benchmarks/profile_sft_step.py): 256 sequences of 122 tokens packed,
  12 heads, latent 256 + rope 32, index_topk 256 > sequence length, so every query takes all its causal keys.
- glm5_short: GLM-5 heads and dims (64 heads, 512 + 64), 8 sequences of 1024 tokens, top-k 2048: the same regime.
- glm5_8k: one 8K sequence, random causal top-2048 (not a key range: both settings run the general kernel;
  the ratio shows what the range check costs).
For sft_small the general kernel's two halves (dQ alone, dKV alone) are timed too: the dKV half is the one with
atomics. Every range-path config is checked against the general kernel and timed. Prints a markdown table.
"""

from __future__ import annotations

import statistics

import torch

from slime_dsa.ops import triton_sparse_mla as mla


def cuda_times(fn, reps: int) -> list[float]:
    """Milliseconds of `reps` runs of fn() (CUDA events), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def timed(fn, reps: int = 10) -> float:
    """Median milliseconds of fn() over `reps` runs after one warm-up."""
    return statistics.median(cuda_times(fn, reps))


def timed_spread(fn, reps: int) -> str:
    """'min / median / max' milliseconds of fn() over `reps` runs after one warm-up."""
    times = cuda_times(fn, reps)
    return f"{min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f}"


def resources(kernel) -> tuple[str, str]:
    """Registers and spills of the most recently compiled variant of a Triton kernel, if Triton exposes them."""
    try:
        compiled = list(kernel.device_caches[torch.cuda.current_device()][0].values())[-1]
        compiled._init_handles()
        return str(compiled.n_regs), str(compiled.n_spills)
    except Exception:  # noqa: BLE001 (Triton-version dependent; purely informational)
        return "?", "?"


def all_causal(lens: list[int], K: int) -> torch.Tensor:
    """(T, K) every causal key of each packed sequence, ascending, -1 padded (what index_topk >= length gives)."""
    rows = []
    start = 0
    for n in lens:
        pos = torch.arange(n, device="cuda")
        col = torch.arange(K, device="cuda")
        rows.append(torch.where(col[None, :] <= pos[:, None], start + col[None, :], -1))
        start += n
    return torch.cat(rows)


def random_causal(n: int, K: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    r = torch.rand(n, n, device="cuda", generator=g).tril()
    r = r.masked_fill(torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1), -1.0)
    top = r.topk(K, dim=-1)
    return torch.where(top.values >= 0, top.indices, -1).sort(-1).values  # order does not matter here


def problem(T: int, H: int, v_dim: int, d_r: int, idx: torch.Tensor):
    g = torch.Generator(device="cuda").manual_seed(1)
    D = v_dim + d_r
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = D**-0.5
    out, lse = mla.sparse_mla_fwd(q, kv, idx, scale, v_dim)
    dout = torch.randn_like(out)
    dlse = torch.randn(lse.shape, device="cuda", generator=g)
    return q, kv, idx, out, lse, dout, dlse, scale, v_dim


def rel(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    cases = {
        "sft_small": ([122] * 256, 12, 256, 32, 256),
        "glm5_short": ([1024] * 8, 64, 512, 64, 2048),
        "glm5_8k": (None, 64, 512, 64, 2048),
    }
    lines = ["| shape | general ms | range path ms | ratio | max rel L2 (dq, dkv) range vs general |", "|---|---|---|---|---|"]
    extra = []
    for name, (lens, H, v_dim, d_r, K) in cases.items():
        idx = all_causal(lens, K) if lens else random_causal(8192, K)
        args = problem(idx.shape[0], H, v_dim, d_r, idx)
        print(name, "key ranges:", mla.key_ranges(idx) is not None, flush=True)
        mla.USE_KEY_RANGES = False
        ref = mla.sparse_mla_bwd(*args)
        old_ms = timed(lambda: mla.sparse_mla_bwd(*args), 5 if name != "glm5_8k" else 3)
        mla.USE_KEY_RANGES = True
        new = mla.sparse_mla_bwd(*args)
        new_ms = timed(lambda: mla.sparse_mla_bwd(*args), 10 if name != "glm5_8k" else 3)
        e = (rel(new[0], ref[0]), rel(new[1], ref[1]))
        lines.append(f"| {name} | {old_ms:.2f} | {new_ms:.2f} | {old_ms / new_ms:.1f}x | {e[0]:.1e}, {e[1]:.1e} |")
        print(lines[-1], flush=True)
        if name == "glm5_8k":
            continue
        q, kv, idx, out, lse, dout, dlse, scale, v_dim = args
        delta = mla.bwd_delta(out, dout, dlse)
        if name == "sft_small":  # where does the general kernel's time go: dQ alone vs dKV alone (atomics)
            for label, do_dq, do_dkv, cfg in (("general dQ only", True, False, mla.BWD_DQ_CONFIGS[0]),
                                              ("general dKV only", False, True, mla.BWD_DKV_CONFIGS[0]),
                                              ("general fused", True, True, mla.BWD_FUSED_CONFIGS[0])):
                dq, dkv = torch.empty_like(q), torch.zeros(kv.shape, device="cuda")
                ms = timed_spread(lambda: mla.launch_bwd_kernel(cfg, do_dq, do_dkv, q, kv, idx, dout, lse, delta, dq,
                                                                dkv, scale, v_dim), 3)
                extra.append(f"| {name} | {label} {tuple(vars(cfg).values())} | {ms} | | |")
                print(extra[-1], flush=True)
        lo, hi = mla.key_ranges(idx)
        for sweep in (1, 2):  # twice: a config whose time moves between sweeps is flaky, not slow
            for kind, configs, kernel in (("range dQ", mla.RANGE_DQ_CONFIGS, mla._range_mla_bwd_dq_kernel),
                                          ("range dKV", mla.RANGE_DKV_CONFIGS, mla._range_mla_bwd_dkv_kernel)):
                for cfg in configs:
                    dq, dkv = torch.empty_like(q), torch.empty_like(kv)
                    half = dict(dq_cfg=cfg, do_dkv=False) if kind == "range dQ" else dict(dkv_cfg=cfg, do_dq=False)
                    try:
                        run = lambda: mla.range_mla_bwd(q, kv, lo, hi, dout, lse, delta, dq, dkv, scale, v_dim, **half)  # noqa: E731
                        run()
                        e = rel(dq, ref[0]) if kind == "range dQ" else rel(dkv, ref[1])
                        ms = timed_spread(run, 8)
                        regs, spills = resources(kernel)
                        extra.append(f"| {name} | {kind} {tuple(vars(cfg).values())} sweep {sweep} | {ms} | {e:.1e} | "
                                     f"{regs} / {spills} |")
                    except Exception as exc:  # noqa: BLE001 (a config that does not fit is reported)
                        extra.append(f"| {name} | {kind} {tuple(vars(cfg).values())} | failed: {type(exc).__name__} | | |")
                    print(extra[-1], flush=True)
        print(name, "kept:", {k: v for k, v in mla._chosen.items() if k[0].startswith("range")}, flush=True)
    print("\n".join(lines))
    print("\n| shape | kernel, config (rows, kv rows, warps, stages) | ms min / median / max | rel L2 vs general | "
          "registers / spills |\n|---|---|---|---|---|")
    print("\n".join(extra))


if __name__ == "__main__":
    main()
