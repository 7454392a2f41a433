"""Benchmark of the Triton DSA kernels at GLM-5 sizes against dense causal attention (torch SDPA): issue 20's
table, before and after, in one run.

    PYTHONPATH=. python benchmarks/dsa_kernels.py --out $OUT/dsa_kernels.md

One sequence of T tokens per length, bf16, GLM-5 heads: MLA in MQA mode with 64 heads over latent 512 +
rope 64 (D = 576, value 512), indexer 32 heads x 128, top-k 2048. The top-k indices are the indexer's own
output on random inputs, so early queries have fewer than 2048 keys; FLOPs count the keys really used.
Packed rows: 64K tokens as 16 x 4K or 64 x 1K sequences, where most index slots hold -1.
Dense baseline: the expanded (MHA) form of the same attention as training would run it without DSA:
64 heads, qk 256 (192 nope + 64 rope), v 256, causal, through torch SDPA (flash or cuDNN, the faster).
"Before" runs the kernels as they were (benchmarks/dsa_kernels_before.py) in the same process.

FLOP convention (as flash-attention reports): forward = 2 matmuls, backward = 5 matmuls (with the
recomputation of the scores). DSA layer = indexer scoring + top-k (forward only; no gradient flows through
top-k) + sparse MLA forward + backward; "IndexShare" charges 1/4 of an indexer per layer (1 full layer per
4). Projections and RoPE are not part of the layer time; the KL loss of one IndexShare group (4 layers, sparse
stage, forward + backward) is reported beside it and charged 1/4 per layer in the "+ KL loss" column.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

H, D, V_DIM, HI, DI, TOPK = 64, 576, 512, 32, 128, 2048
DENSE_QK, DENSE_V = 256, 256
GOAL_FWD_TFLOPS, GOAL_BWD_TFLOPS = 350.0, 200.0
GOAL_SPEEDUP = {65536: 4.0, 131072: 8.0}  # DSA layer fwd+bwd with IndexShare vs dense, by length
GOAL_KL_SHARE_64K, GOAL_DECODE_RATIO = 0.25, 2.0


def timed(fn, budget_s: float, max_reps: int = 20) -> float:
    """Median milliseconds of fn() after one warm-up call; repetitions fit in budget_s."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    reps = max(1, min(max_reps, int(budget_s * 1000 / max(first, 1e-3))))
    times = [first]
    for _ in range(reps - 1):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_timed(fn, reps: int = 50, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of a CUDA-graph replay of fn, replays queued back to back: device time alone, as the
    engine's decode step runs these kernels (`timed`'s sync a repetition also counts the host's launch). flush: a
    buffer zeroed before each replay (more bytes than the L2 holds: every replay reads from memory)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@dataclass
class Row:
    T: int
    notes: list[str] = field(default_factory=list)
    r: dict = field(default_factory=dict)


def sweep_configs(T: int, log) -> list[str]:
    """Check and time every sparse MLA launch config; keep the fastest correct ones for the rest of the run.

    Correctness: relative L2 error against the float32 torch reference on a 1024-token problem.
    Speed: one 8K-token sequence. Backward is timed as one fused kernel or as its two halves (dQ, dKV).
    """
    from slime_dsa.ops import reference  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    def problem(n: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(n, D, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = _indices(n)
        dout = torch.randn(n, H, V_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        return q, kv, idx, dout

    scale = D**-0.5
    vq, vkv, vidx, vdout = problem(1024, 1)
    q32, kv32 = vq.float().requires_grad_(True), vkv.float().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, vidx, scale, V_DIM)
    ref_dq, ref_dkv = torch.autograd.grad(ref_out, (q32, kv32), vdout.float())
    ref_out, ref_lse = ref_out.detach(), ref_lse.detach()
    bq, bkv, bidx, bdout = problem(T, 2)
    key = (H, D, V_DIM, torch.bfloat16)

    def err(x, ref) -> float:
        return ((x.float() - ref).norm() / ref.norm()).item()

    lines = ["| kernel | heads/program, keys/step, warps, stages | ms at 8K | rel. L2 error (1K) | registers | spills |",
             "|---|---|---|---|---|---|"]

    def label(cfg) -> str:
        return f"{cfg.block_h}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}"

    def row(kind, cfg, ms, e, kernel):
        regs, spills = _resources(kernel)
        lines.append(f"| {kind} | {label(cfg)} | {ms:.2f} | {e:.1e} | {regs} | {spills} |")

    def failed(kind, cfg, e):
        lines.append(f"| {kind} | {label(cfg)} | failed: {type(e).__name__} | | | |")
        log(f"{kind} {cfg}: {type(e).__name__}: {str(e)[:300]}")

    best_fwd = None
    for cfg in mla.FWD_CONFIGS:
        mla._chosen[("fwd", key)] = cfg
        try:
            out, lse = mla.sparse_mla_fwd(vq, vkv, vidx, scale, V_DIM)
            e = max(err(out, ref_out), (lse - ref_lse).abs().max().item())
            ms = timed(lambda: mla.sparse_mla_fwd(bq, bkv, bidx, scale, V_DIM), 1.0, 5)
        except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit is reported, not fatal)
            failed("fwd", cfg, exc)
            continue
        row("fwd", cfg, ms, e, mla._sparse_mla_fwd_kernel)
        if e <= 1e-2 and (best_fwd is None or ms < best_fwd[0]):
            best_fwd = (ms, cfg)
    mla._chosen.pop(("fwd", key), None)
    if best_fwd:
        mla._chosen[("fwd", key)] = best_fwd[1]

    # backward inputs from the chosen forward
    vout, vlse = mla.sparse_mla_fwd(vq, vkv, vidx, scale, V_DIM)
    bout, blse = mla.sparse_mla_fwd(bq, bkv, bidx, scale, V_DIM)
    vdelta, bdelta = mla.bwd_delta(vout, vdout, None), mla.bwd_delta(bout, bdout, None)
    best = {}
    for kind, configs, do_dq, do_dkv in (("bwd fused", mla.BWD_FUSED_CONFIGS, True, True),
                                         ("bwd dQ", mla.BWD_DQ_CONFIGS, True, False),
                                         ("bwd dKV", mla.BWD_DKV_CONFIGS, False, True)):
        for cfg in configs:
            def run(q, kv, idx, dout, lse, delta):
                dq = torch.zeros_like(q)
                dkv = torch.zeros(kv.shape, device="cuda")
                mla.launch_bwd_kernel(cfg, do_dq, do_dkv, q, kv, idx, dout, lse, delta, dq, dkv, scale, V_DIM)
                return dq, dkv

            try:
                dq, dkv = run(vq, vkv, vidx, vdout, vlse, vdelta)
                e = max(err(dq, ref_dq) if do_dq else 0.0, err(dkv, ref_dkv) if do_dkv else 0.0)
                ms = timed(lambda: run(bq, bkv, bidx, bdout, blse, bdelta), 1.0, 5)
            except Exception as exc:  # noqa: BLE001
                failed(kind, cfg, exc)
                continue
            row(kind, cfg, ms, e, mla._sparse_mla_bwd_kernel)
            if e <= 1e-2 and (kind not in best or ms < best[kind][0]):
                best[kind] = (ms, cfg)
    split_ms = best["bwd dQ"][0] + best["bwd dKV"][0] if "bwd dQ" in best and "bwd dKV" in best else float("inf")
    fused_ms = best["bwd fused"][0] if "bwd fused" in best else float("inf")
    if math.isfinite(min(split_ms, fused_ms)):
        mode = "split" if split_ms <= fused_ms else "fused"
        mla._chosen[("bwd_mode", key)] = mode
        if mode == "split":
            mla._chosen[("bwd_dq", key)], mla._chosen[("bwd_dkv", key)] = best["bwd dQ"][1], best["bwd dKV"][1]
        else:
            mla._chosen[("bwd_fused", key)] = best["bwd fused"][1]
        log(f"sweep: fwd {best_fwd}, bwd {mode} (split {split_ms:.2f} ms, fused {fused_ms:.2f} ms)")
        lines.append(f"\nKept: forward {best_fwd[1] if best_fwd else '-'}; backward {mode} "
                     f"(split {split_ms:.2f} ms vs fused {fused_ms:.2f} ms at 8K).")
    return lines


def _resources(kernel) -> tuple[str, str]:
    """Registers and spills of the most recently compiled variant of a Triton kernel, if Triton exposes them."""
    try:
        cache = kernel.device_caches[torch.cuda.current_device()][0]
        compiled = list(cache.values())[-1]
        compiled._init_handles()
        return str(compiled.n_regs), str(compiled.n_spills)
    except Exception:  # noqa: BLE001 (Triton-version dependent; purely informational)
        return "?", "?"


_indices_cache: dict[tuple, torch.Tensor] = {}


def _indices(T: int, seq_len: int | None = None) -> torch.Tensor:
    """Causal top-k rows of T tokens (packed sequences of seq_len, default one sequence), chosen by the Triton
    indexer on random inputs, as global kv rows."""
    seq_len = seq_len or T
    key = (T, seq_len)
    if key not in _indices_cache:
        from slime_dsa.ops.triton_indexer import indexer_topk  # noqa: PLC0415

        g = torch.Generator(device="cuda").manual_seed(T + seq_len)
        iq = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16, generator=g)
        ik = torch.randn(T, DI, device="cuda", dtype=torch.bfloat16, generator=g)
        iw = torch.randn(T, HI, device="cuda", generator=g) * HI**-0.5
        cu = torch.arange(0, T + 1, seq_len, device="cuda")
        local = indexer_topk(iq, ik, iw, cu, cu, TOPK, DI**-0.5)
        start = torch.arange(T, device="cuda") // seq_len * seq_len  # (T,) first row of each row's sequence
        _indices_cache.clear()
        _indices_cache[key] = torch.where(local >= 0, local + start[:, None], -1)
    return _indices_cache[key]


def indexer_scores_only(q, k, w, cu, topk: int, scale: float) -> None:
    """The indexer's scoring pass alone (same chunks and kernel as indexer_topk, no selection)."""
    from slime_dsa.ops import triton_indexer as ti  # noqa: PLC0415

    cu_list = cu.tolist()
    block_m = ti.block_queries(q.shape[1], cu_list)
    for r0, r1, width, blocks in ti._plan_chunks(cu_list, cu_list, topk, block_m):
        scores = torch.empty(r1 - r0, width, dtype=torch.float32, device=q.device)
        ti.launch_scores(q, k, w, scores, blocks, r0, width, scale, block_m)


def sparse_flops(indices: torch.Tensor) -> tuple[float, float]:
    """(forward, backward) matmul FLOPs of sparse MLA over the keys `indices` really selects."""
    pairs = float((indices >= 0).sum())
    return 2.0 * H * pairs * (D + V_DIM), 2.0 * H * pairs * (D + V_DIM + D + D + V_DIM)


def time_sparse(q, kv, indices, dout, budget_s: float, before: bool, backward: bool = True) -> dict:
    """Sparse MLA forward (and forward + backward) ms, after (skipping empty slots) and, if asked, before."""
    from benchmarks.dsa_kernels_before import skip_empty_slots  # noqa: PLC0415
    from slime_dsa.ops.triton_sparse_mla import sparse_mla_attention  # noqa: PLC0415

    scale = D**-0.5

    def fwd():
        with torch.no_grad():
            sparse_mla_attention(q, kv, indices, scale, V_DIM)

    def fwd_bwd():
        o, _ = sparse_mla_attention(q, kv, indices, scale, V_DIM)
        torch.autograd.grad(o, (q, kv), dout)

    r = {}
    for label, on in (("", True), ("_before", False)) if before else (("", True),):
        with skip_empty_slots(on):
            r["sparse_fwd_ms" + label] = timed(fwd, budget_s)
            if backward:
                r["sparse_fwdbwd_ms" + label] = timed(fwd_bwd, budget_s)
    return r


def bench_length(T: int, budget_s: float, dense_backend, log, kl: bool, before: bool) -> Row:
    from benchmarks.dsa_kernels_before import indexer_topk_before  # noqa: PLC0415
    from slime_dsa.ops import triton_indexer  # noqa: PLC0415
    from slime_dsa.ops.triton_indexer_loss import indexer_kl_loss  # noqa: PLC0415
    from slime_dsa.ops.triton_sparse_mla import sparse_mla_attention  # noqa: PLC0415

    row = Row(T)
    r = row.r
    torch.manual_seed(T)
    cu = torch.tensor([0, T], device="cuda")
    pairs_dense = T * (T + 1) // 2

    # (b) indexer: scoring + top-k
    iq = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16)
    ik = torch.randn(T, DI, device="cuda", dtype=torch.bfloat16)
    iw = torch.randn(T, HI, device="cuda") * HI**-0.5
    r["indexer_ms"] = timed(lambda: triton_indexer.indexer_topk(iq, ik, iw, cu, cu, TOPK, DI**-0.5), budget_s)
    if before:
        r["indexer_ms_before"] = timed(lambda: indexer_topk_before(iq, ik, iw, cu, cu, TOPK, DI**-0.5), budget_s)
    r["indexer_flops"] = 2.0 * HI * DI * pairs_dense
    r["indexer_score_ms"] = timed(lambda: indexer_scores_only(iq, ik, iw, cu, TOPK, DI**-0.5), budget_s)
    indices = triton_indexer.indexer_topk(iq, ik, iw, cu, cu, TOPK, DI**-0.5)  # realistic causal rows
    log(f"T={T}: indexer {r['indexer_ms']:.2f} ms (before {r.get('indexer_ms_before', float('nan')):.2f}, "
        f"scoring alone {r['indexer_score_ms']:.2f} ms)")
    del iq, ik, iw

    # (a) sparse MLA, MQA mode
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    scale = D**-0.5
    dout = torch.randn(T, H, V_DIM, device="cuda", dtype=torch.bfloat16)
    r.update(time_sparse(q, kv, indices, dout, budget_s, before))
    fwd_flops, bwd_flops = sparse_flops(indices)
    r["sparse_fwd_flops"], r["sparse_bwd_flops"] = fwd_flops, bwd_flops
    log(f"T={T}: sparse fwd {r['sparse_fwd_ms']:.2f} ms ({tflops(fwd_flops, r['sparse_fwd_ms']):.0f} TFLOP/s, "
        f"before {r.get('sparse_fwd_ms_before', float('nan')):.2f} ms), fwd+bwd {r['sparse_fwdbwd_ms']:.2f} ms "
        f"(before {r.get('sparse_fwdbwd_ms_before', float('nan')):.2f} ms)")

    if kl:  # KL loss of one IndexShare group of 4 layers, sparse stage (same q/kv stand in for each layer)
        with torch.no_grad():
            _, lse = sparse_mla_attention(q, kv, indices, scale, V_DIM)
        qd, kvd = q.detach(), kv.detach()
        iq = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ik = torch.randn(T, DI, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        iw = (torch.randn(T, HI, device="cuda") * HI**-0.5).requires_grad_(True)

        def kl_fwd_bwd():
            loss = indexer_kl_loss(iq, ik, iw, DI**-0.5, [qd] * 4, [kvd] * 4, [lse] * 4, scale, cu, cu, indices)
            torch.autograd.grad(loss.sum(), (iq, ik, iw))

        r["kl_ms"] = timed(kl_fwd_bwd, budget_s)
        log(f"T={T}: indexer KL loss (4 layers) fwd+bwd {r['kl_ms']:.2f} ms")
        iq = ik = iw = lse = None
    q = kv = dout = indices = None  # freed before the dense baseline
    torch.cuda.empty_cache()

    # dense causal attention, expanded MHA form
    dense_fwd_flops = 2.0 * H * pairs_dense * (DENSE_QK + DENSE_V)
    dense_bwd_flops = 2.0 * H * pairs_dense * (DENSE_QK + DENSE_V + DENSE_QK + DENSE_QK + DENSE_V)
    try:
        qd = torch.randn(1, H, T, DENSE_QK, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kd = torch.randn(1, H, T, DENSE_QK, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        vd = torch.randn(1, H, T, DENSE_V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with torch.nn.attention.sdpa_kernel(dense_backend):
            with torch.no_grad():
                r["dense_fwd_ms"] = timed(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True),
                                          budget_s)
            do = torch.randn(1, H, T, DENSE_V, device="cuda", dtype=torch.bfloat16)

            def dense_fwd_bwd():
                o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                torch.autograd.grad(o, (qd, kd, vd), do)

            r["dense_fwdbwd_ms"] = timed(dense_fwd_bwd, budget_s)
        r["dense_fwd_tflops"] = tflops(dense_fwd_flops, r["dense_fwd_ms"])
        r["flop_ratio"] = (dense_fwd_flops + dense_bwd_flops) / (fwd_flops + bwd_flops)
        r["dense_fwdbwd_tflops"] = tflops(dense_fwd_flops + dense_bwd_flops, r["dense_fwdbwd_ms"])
        log(f"T={T}: dense fwd {r['dense_fwd_ms']:.2f} ms, fwd+bwd {r['dense_fwdbwd_ms']:.2f} ms")
    except torch.cuda.OutOfMemoryError:
        row.notes.append("dense attention ran out of memory")
    finally:
        qd = kd = vd = do = None
        torch.cuda.empty_cache()

    for label in ("", "_before"):
        if "sparse_fwdbwd_ms" + label in r and "indexer_ms" + label in r:
            r["layer_ms" + label] = r["indexer_ms" + label] + r["sparse_fwdbwd_ms" + label]
            r["layer_share_ms" + label] = r["indexer_ms" + label] / 4 + r["sparse_fwdbwd_ms" + label]
    if "kl_ms" in r:  # one group's loss spread over its 4 layers
        r["layer_share_kl_ms"] = r["layer_share_ms"] + r["kl_ms"] / 4
    return row


# (tokens, sequence length, time the backward): short packed sequences. At 1K every query takes all its causal
# keys, so the backward runs the key-range path, which never walked index slots: forward only there.
PACKED_CASES = ((65536, 4096, True), (65536, 1024, False))


def packed_rows(budget_s: float, log) -> list[str]:
    """Sparse MLA on packed short sequences under the 2048-slot top-k: most slots of most rows hold -1."""
    lines = ["| tokens | packed as | slots used | fwd ms before | fwd ms after | fwd TFLOP/s after (keys used) | "
             "fwd+bwd ms before | fwd+bwd ms after | fwd+bwd TFLOP/s after |", "|---|---|---|---|---|---|---|---|---|"]
    for T, seq_len, backward in PACKED_CASES:
        indices = _indices(T, seq_len)
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(T, H, V_DIM, device="cuda", dtype=torch.bfloat16)
        r = time_sparse(q, kv, indices, dout, budget_s, before=True, backward=backward)
        fwd_flops, bwd_flops = sparse_flops(indices)
        used = float((indices >= 0).float().mean())
        fwd_bwd = "| - | - | - |"
        if backward:
            fwd_bwd = (f"| {r['sparse_fwdbwd_ms_before']:.2f} | {r['sparse_fwdbwd_ms']:.2f} | "
                       f"{tflops(fwd_flops + bwd_flops, r['sparse_fwdbwd_ms']):.0f} |")
        lines.append(f"| {T} | {T // seq_len} x {seq_len} | {100 * used:.0f}% | {r['sparse_fwd_ms_before']:.2f} | "
                     f"{r['sparse_fwd_ms']:.2f} | {tflops(fwd_flops, r['sparse_fwd_ms']):.0f} {fwd_bwd}")
        log(lines[-1])
        q = kv = dout = indices = None
        _indices_cache.clear()
        torch.cuda.empty_cache()
    return lines


def dense_backend_choice(log):
    """The faster of SDPA's flash and cuDNN backends at 8K (both are exact causal attention)."""
    from torch.nn.attention import SDPBackend  # noqa: PLC0415

    T = 8192
    q = torch.randn(1, H, T, DENSE_QK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, H, T, DENSE_QK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, H, T, DENSE_V, device="cuda", dtype=torch.bfloat16)
    best = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with torch.nn.attention.sdpa_kernel(backend), torch.no_grad():
                ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 1.0, 5)
        except Exception as err:  # noqa: BLE001
            log(f"dense backend {backend.name}: unavailable ({type(err).__name__})")
            continue
        log(f"dense backend {backend.name}: {ms:.2f} ms fwd at 8K")
        if best is None or ms < best[0]:
            best = (ms, backend)
    return best[1]


@dataclass
class DecodeCase:
    """One decode step's inputs at `batch` requests of `ctx` keys: sparse MLA's (q, kv, rows: the indexer's top-k
    as kv rows), the packed indexer's (iq, ik, iw, cu_q, cu_k) and the paged one's (slots, lens; ik8 and key_scales:
    the keys in FP8 with a scale a row, as an engine's FP8 index-key cache holds them)."""

    q: torch.Tensor
    kv: torch.Tensor
    rows: torch.Tensor
    iq: torch.Tensor
    ik: torch.Tensor
    iw: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor
    ik8: torch.Tensor
    key_scales: torch.Tensor


def decode_case(batch: int, ctx: int) -> DecodeCase:
    """Random bf16 decode inputs on the GPU; each request's keys contiguous in the pool."""
    from slime_dsa.ops.fp8_keys import quantize_keys  # noqa: PLC0415
    from slime_dsa.ops.triton_indexer import indexer_topk  # noqa: PLC0415

    kv = torch.randn(batch * ctx, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    ik = torch.randn(batch * ctx, DI, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(batch, HI, DI, device="cuda", dtype=torch.bfloat16)
    iw = torch.randn(batch, HI, device="cuda")
    cu_q = torch.arange(batch + 1, device="cuda")
    cu_k = cu_q * ctx
    rows = indexer_topk(iq, ik, iw, cu_q, cu_k, TOPK, DI**-0.5) + cu_k[:-1, None]
    fp8 = quantize_keys(ik)  # quantised once, outside any timing
    return DecodeCase(q, kv, rows, iq, ik, iw, cu_q, cu_k, torch.arange(batch * ctx, device="cuda").view(batch, ctx),
                      torch.full((batch,), ctx, device="cuda"), fp8.values, fp8.scales)


def decode_rows(log, batches: list[int]) -> tuple[list[str], dict]:
    """Decode step (one query per request) at a 64K context, per layer: sparse MLA, the indexer top-k before and
    after (packed keys), and the paged indexer (keys read from a pool by slot, as the engine runs it) on bf16 keys and
    on FP8 keys with a float32 scale per row (quantised once, outside the timing). Sparse MLA and the paged indexer
    are timed as CUDA-graph replays (`graph_timed`), as the engine's decode step runs them; the packed indexer
    (host syncs: no graph) eagerly with a sync a repetition (`timed`), which also counts its host launch."""
    from benchmarks.dsa_kernels_before import indexer_topk_before  # noqa: PLC0415
    from slime_dsa.ops.triton_indexer import indexer_topk  # noqa: PLC0415
    from slime_dsa.ops.triton_indexer_paged import indexer_topk_paged  # noqa: PLC0415
    from slime_dsa.ops.triton_sparse_mla import sparse_mla_attention  # noqa: PLC0415

    ctx = 65536
    lines = ["| batch | context | sparse MLA ms | indexer top-k ms before | after | after / sparse MLA | "
             "paged indexer ms | paged / sparse MLA | paged indexer, fp8 keys ms | fp8 keys / sparse MLA |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for batch in batches:
        c = decode_case(batch, ctx)
        with torch.no_grad():
            mla_ms = graph_timed(lambda: sparse_mla_attention(c.q, c.kv, c.rows, D**-0.5, V_DIM))
        before_ms = timed(lambda: indexer_topk_before(c.iq, c.ik, c.iw, c.cu_q, c.cu_k, TOPK, DI**-0.5), 0.5)
        after_ms = timed(lambda: indexer_topk(c.iq, c.ik, c.iw, c.cu_q, c.cu_k, TOPK, DI**-0.5), 0.5)
        paged_ms = graph_timed(lambda: indexer_topk_paged(c.iq, c.ik, c.iw, c.slots, c.lens, TOPK, DI**-0.5))
        fp8_ms = graph_timed(lambda: indexer_topk_paged(c.iq, c.ik8, c.iw, c.slots, c.lens, TOPK, DI**-0.5,
                                                        c.key_scales))
        ratios[batch] = {"packed": after_ms / mla_ms, "paged": paged_ms / mla_ms, "paged_fp8": fp8_ms / mla_ms}
        lines.append(f"| {batch} | {ctx} | {mla_ms:.3f} | {before_ms:.3f} | {after_ms:.3f} | "
                     f"{ratios[batch]['packed']:.2f}x | {paged_ms:.3f} | {ratios[batch]['paged']:.2f}x | "
                     f"{fp8_ms:.3f} | {ratios[batch]['paged_fp8']:.2f}x |")
        log(lines[-1])
        c = None
        torch.cuda.empty_cache()
    return lines, ratios


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _arrow(r: dict, key: str, spec: str = ".2f") -> str:
    """'before -> after' when both were measured, else the one that was."""
    after, before = r.get(key), r.get(key + "_before")
    return f"{fmt(before, spec)} -> {fmt(after, spec)}" if before is not None else fmt(after, spec)


def render(rows: list[Row], sweep: list[str], decode: list[str], ratios: dict, packed: list[str], header: list[str],
           skipped: list[str]) -> str:
    lines = list(header)
    lines += ["", "### Sparse MLA (MQA mode, 64 heads, 512+64, top-k 2048) vs dense causal attention (64 heads, qk 256, v 256)",
              "", "before -> after: the plain forward kernel, key loops walking every index slot -> the prefill forward "
              "(idx_reg), key loops stopping at each row's last used slot. "
              "TFLOP/s count the keys used; bwd = fwd+bwd minus fwd.", "",
              "| T | sparse fwd ms | fwd TFLOP/s | sparse fwd+bwd ms | bwd TFLOP/s | fwd+bwd TFLOP/s | dense fwd ms | TFLOP/s | "
              "dense fwd+bwd ms | TFLOP/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r = row.r
        bwd_ms = r["sparse_fwdbwd_ms"] - r["sparse_fwd_ms"]
        tf = {k: tflops(r["sparse_fwd_flops"], r["sparse_fwd_ms" + k]) for k in ("", "_before") if "sparse_fwd_ms" + k in r}
        tf_fwd = f"{fmt(tf.get('_before'), '.0f')} -> {tf['']:.0f}" if "_before" in tf else f"{tf['']:.0f}"
        lines.append(f"| {row.T} | {_arrow(r, 'sparse_fwd_ms')} | {tf_fwd} | {_arrow(r, 'sparse_fwdbwd_ms')} | "
                     f"{fmt(tflops(r['sparse_bwd_flops'], bwd_ms), '.0f')} | "
                     f"{fmt(tflops(r['sparse_fwd_flops'] + r['sparse_bwd_flops'], r['sparse_fwdbwd_ms']), '.0f')} | "
                     f"{fmt(r.get('dense_fwd_ms'))} | {fmt(r.get('dense_fwd_tflops'), '.0f')} | "
                     f"{fmt(r.get('dense_fwdbwd_ms'))} | {fmt(r.get('dense_fwdbwd_tflops'), '.0f')} |")
    if packed:
        lines += ["", "### Rows with mostly -1 slots: packed short sequences, top-k 2048", "", *packed]
    lines += ["", "### Indexer and the whole DSA layer (attention core, fwd+bwd)", "",
              "Indexer before -> after: torch.topk + tie repair + sort -> the Triton radix select.", "",
              "| T | indexer ms | of which scoring ms | scoring TFLOP/s | DSA layer ms | DSA layer ms, IndexShare 1/4 | "
              "speedup vs dense fwd+bwd (no share / IndexShare) | same, before | share with IndexShare: indexer / sparse fwd / "
              "sparse bwd | KL loss, 4-layer group, fwd+bwd ms | speedup with IndexShare + KL loss | "
              "KL share: KL / 4 of (layer with IndexShare + KL / 4) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r = row.r
        dense = r.get("dense_fwdbwd_ms")

        def speedups(label: str) -> str:
            if not dense or "layer_ms" + label not in r:
                return "-"
            return f"{dense / r['layer_ms' + label]:.1f}x / {dense / r['layer_share_ms' + label]:.1f}x"

        idx4, fwd = r["indexer_ms"] / 4, r["sparse_fwd_ms"]
        bwd = r["sparse_fwdbwd_ms"] - fwd
        tot = r["layer_share_ms"]
        shares = f"{100 * idx4 / tot:.0f}% / {100 * fwd / tot:.0f}% / {100 * bwd / tot:.0f}%"
        with_kl = f"{dense / r['layer_share_kl_ms']:.1f}x" if dense and "layer_share_kl_ms" in r else "-"
        kl_share = f"{100 * r['kl_ms'] / 4 / r['layer_share_kl_ms']:.0f}%" if "layer_share_kl_ms" in r else "-"
        lines.append(f"| {row.T} | {_arrow(r, 'indexer_ms')} | {fmt(r['indexer_score_ms'])} | "
                     f"{fmt(tflops(r['indexer_flops'], r['indexer_score_ms']), '.0f')} | {fmt(r['layer_ms'])} | "
                     f"{fmt(r['layer_share_ms'])} | {speedups('')} | {speedups('_before')} | {shares} | "
                     f"{fmt(r.get('kl_ms'))} | {with_kl} | {kl_share} |")
    notes = [f"- T={row.T}: {n}" for row in rows for n in row.notes] + [f"- {s}" for s in skipped]
    if notes:
        lines += ["", "Notes:", *notes]
    lines += ["", "### Goals (issue 20)", "", *goals(rows, ratios)]
    if decode:
        lines += ["", "### Decode (one query per request, per layer)", "",
                  "FP8 indexer: removed (it quantised q and k on every call: 21.5 ms at batch 128 on 2026-11-30, "
                  "6x the bf16 path). \"fp8 keys\": the paged indexer on keys stored in FP8 with a float32 scale "
                  "per row, as an engine's FP8 index-key cache holds them (quantised once, not timed). Sparse MLA "
                  "and the paged indexer are CUDA-graph replays (device time, as the engine's decode step runs "
                  "them); the packed indexer, before and after, runs eagerly with a sync a repetition (host launch "
                  "included).", "", *decode]
    if sweep:
        lines += ["", "### Sparse MLA launch configs at 8K (fastest kept)", "", *sweep]
    return "\n".join(lines) + "\n"


def goals(rows: list[Row], ratios: dict) -> list[str]:
    """One line per goal of issue 20, with the number measured; a goal without its measurement says so."""
    def verdict(ok: bool) -> str:
        return "reached" if ok else "NOT reached"

    by_t = {row.T: row.r for row in rows}
    out = []
    long_rows = [row.r for row in rows if 32768 <= row.T <= 131072]
    if long_rows:
        fwd = min(tflops(r["sparse_fwd_flops"], r["sparse_fwd_ms"]) for r in long_rows)
        bwd = min(tflops(r["sparse_bwd_flops"], r["sparse_fwdbwd_ms"] - r["sparse_fwd_ms"]) for r in long_rows)
        out.append(f"- sparse MLA forward >= {GOAL_FWD_TFLOPS:.0f} TFLOP/s at 32K-128K: lowest {fwd:.0f} -> {verdict(fwd >= GOAL_FWD_TFLOPS)}")
        out.append(f"- sparse MLA backward >= {GOAL_BWD_TFLOPS:.0f} TFLOP/s at 32K-128K: lowest {bwd:.0f} -> {verdict(bwd >= GOAL_BWD_TFLOPS)}")
    else:
        out.append("- sparse MLA forward / backward at 32K-128K: not measured")
    for T, goal in GOAL_SPEEDUP.items():
        r = by_t.get(T)
        if not r or not r.get("dense_fwdbwd_ms"):
            out.append(f"- DSA layer fwd+bwd >= {goal:.0f}x dense at {T // 1024}K: not measured")
            continue
        s_sh = r["dense_fwdbwd_ms"] / r["layer_share_ms"]
        kl = f"; with the KL loss {r['dense_fwdbwd_ms'] / r['layer_share_kl_ms']:.1f}x" if "layer_share_kl_ms" in r else \
            "; KL loss not measured at this length"
        out.append(f"- DSA layer fwd+bwd (IndexShare) >= {goal:.0f}x dense at {T // 1024}K: {s_sh:.1f}x{kl} -> "
                   f"{verdict(s_sh >= goal)} (dense does {r['flop_ratio']:.1f}x the sparse matmul work)")
    r64 = by_t.get(65536)
    if r64 and "layer_share_kl_ms" in r64:
        share = r64["kl_ms"] / 4 / r64["layer_share_kl_ms"]
        out.append(f"- indexer KL loss <= {100 * GOAL_KL_SHARE_64K:.0f}% of the DSA layer fwd+bwd with IndexShare at 64K: "
                   f"{100 * share:.0f}% -> {verdict(share <= GOAL_KL_SHARE_64K)}")
    else:
        out.append("- indexer KL loss share at 64K: not measured")
    if 128 in ratios:  # the engine's decode steps run the paged indexer (rollout/engine/decode.py)
        paged, fp8, packed = ratios[128]["paged"], ratios[128]["paged_fp8"], ratios[128]["packed"]
        out.append(f"- decode indexer top-k <= {GOAL_DECODE_RATIO:.0f}x sparse MLA at batch 128, 64K: paged (the "
                   f"engine's decode path) on bf16 keys {paged:.2f}x -> {verdict(paged <= GOAL_DECODE_RATIO)}, on fp8 "
                   f"keys (rollout.index_key_cache_dtype fp8_e4m3) {fp8:.2f}x -> {verdict(fp8 <= GOAL_DECODE_RATIO)}; "
                   f"packed keys {packed:.2f}x. A model with IndexShare 1/4 (one indexer a 4 layers, as the layer "
                   f"rows count) runs it a quarter as often: per layer {paged / 4:.2f}x bf16, {fp8 / 4:.2f}x fp8 "
                   f"(GLM-5's own config indexes every layer)")
    else:
        out.append("- decode indexer at batch 128: not measured")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--out", type=str, default=None, help="also write the markdown tables here")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of repetitions per measurement")
    parser.add_argument("--time-limit", type=float, default=170.0, help="skip remaining lengths after this many s")
    parser.add_argument("--sweep", action="store_true", help="check and time every sparse MLA launch config first")
    parser.add_argument("--no-before", action="store_true", help="time only the current kernels")
    parser.add_argument("--no-packed", action="store_true", help="skip the packed short-sequence rows")
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 32, 128])
    parser.add_argument("--kl-max-len", type=int, default=65536, help="time the KL loss up to this length")
    parser.add_argument("--no-gluon", action="store_true", help="the sparse MLA prefill forward and general backward "
                        "and the KL loss's target on the Triton kernels, not the Gluon ones "
                        "(triton_sparse_mla.GLUON_FWD / GLUON_BWD, triton_indexer_loss.GLUON_PROBS off)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dsa_kernels.py needs a CUDA GPU")

    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    import triton  # noqa: PLC0415

    header = [
        f"Date: {datetime.date.today().isoformat()}; GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"triton {triton.__version__}",
        "Command: `PYTHONPATH=. python " + " ".join(sys.argv) + "`",
    ]
    from slime_dsa.ops import triton_indexer_loss as kl_loss  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    if args.no_gluon:
        mla.GLUON_FWD = mla.GLUON_BWD = kl_loss.GLUON_PROBS = False
    header.append("Sparse MLA: the Gluon forward (rows without a key split, and decode batches that fill the SMs) "
                  "and backward, and the KL loss's Gluon target, where they apply."
                  if mla.GLUON_FWD else "Sparse MLA: the Triton kernels only (--no-gluon).")
    sweep = sweep_configs(8192, log) if args.sweep else []
    dense_backend = dense_backend_choice(log)
    header.append(f"Dense baseline: torch SDPA backend {dense_backend.name}.")
    decode, ratios = decode_rows(log, args.decode_batches) if args.decode_batches else ([], {})
    packed = [] if args.no_packed else packed_rows(args.budget / 2, log)
    rows, skipped = [], []
    for T in args.lengths:
        if time.time() - t0 > args.time_limit:
            skipped.append(f"T={T} skipped: the run passed its time limit ({args.time_limit:.0f} s)")
            log(skipped[-1])
            continue
        try:
            rows.append(bench_length(T, args.budget if T < 65536 else args.budget / 2, dense_backend, log,
                                     kl=T <= args.kl_max_len, before=not args.no_before))
        except torch.cuda.OutOfMemoryError as err:
            skipped.append(f"T={T} skipped: out of memory ({str(err).splitlines()[0][:120]})")
            log(skipped[-1])
        torch.cuda.empty_cache()
    text = render(rows, sweep, decode, ratios, packed, header, skipped)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
