"""The batch-invariant Triton kernels (slime_dsa/ops/triton_invariant.py) against their torch / cuBLAS counterparts
at the 300m preset's shapes (hidden 1024, q_lora 384, kv_lora 256, MLP 2816, 16 heads, 32 experts of 256, vocab
32000), bf16, on CUDA: issue 23's kernel-speed table, measured in one run.

    PYTHONPATH=. python benchmarks/invariant_kernels.py --out $OUT/invk.md

Rows are decode (M = 1, 64, 256, 1024) and training (M = 8192, 65536) batch sizes. The last table times the sparse MLA
forward and the indexer top-k, invariant against the non-invariant Triton kernels, at decode batch 256 and a packed
training batch of 4,096 tokens (`--dsa-only` runs that table alone). Times are CUDA-graph replays
(triton.testing.do_bench_cudagraph, so no launch overhead: the engine decodes in CUDA graphs), median, over enough
weight copies that they do not sit in L2. For the linear kernel each candidate tile shape of --tiles is timed, and
a cell marked ≠ says its output differs from the default tile shape's somewhere: tiles that agree bit for bit at
every M could be chosen by M and keep the rows invariant; the others must not be mixed with the default.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import statistics

import torch
import torch.nn.functional as F

logger = logging.getLogger("invariant_kernels")

LINEAR_SHAPES = [  # (layer, N, K) of the 300m preset, nn.Linear layout
    ("q_a_proj", 384, 1024), ("q_b_proj", 1536, 384), ("kv_a_proj", 288, 1024), ("kv_b_proj", 2048, 256),
    ("o_proj", 1024, 1024), ("mlp gate/up", 2816, 1024), ("mlp down", 1024, 2816), ("shared expert up", 256, 1024),
    ("shared expert down", 1024, 256), ("lm_head", 32000, 1024),
]
EXPERT_SHAPES = [("experts gate_up", 32, 512, 1024), ("experts down", 32, 1024, 256)]  # (E, N, K), 4 experts a token
HEAD_SHAPES = [("q_nope @ w_uk", 16, 64, 256), ("latent out @ w_uvᵀ", 16, 256, 64)]  # (H, K, N)
NORM_WIDTHS = [1024, 384, 256]
VOCAB = 32000
DEVICE = "cuda"  # a module constant so that a CPU smoke run under TRITON_INTERPRET=1 can swap it
L2_BYTES = 128 << 20  # weights cycled through per timing: more than the H200's 50 MiB L2


def bench_us(op, weights: list[torch.Tensor] | None = None) -> float:
    """Median microseconds of one op(w) over the weight copies (op() without weights), outputs dropped at once."""
    import triton.testing  # noqa: PLC0415

    def run():
        for w in weights or [None]:
            op(w)

    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=20, return_mode="median") * 1000 / len(weights or [None])


def _copies(t: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """Copies of a weight to cycle through at decode row counts, where reading the weight is the cost; one above."""
    n = 1 if rows > 1024 else max(1, min(32, math.ceil(L2_BYTES / (t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(n - 1)]


def parse_tiles(text: str):
    """'128x128x64/8/3' -> Tiles(block_m, block_n, block_k, num_warps, num_stages)."""
    from slime_dsa.ops.triton_invariant import Tiles  # noqa: PLC0415

    blocks, warps, stages = text.split("/")
    m, n, k = (int(v) for v in blocks.split("x"))
    return Tiles(m, n, k, num_warps=int(warps), num_stages=int(stages))


def linear_rows(Ms: list[int], tiles: list, max_lm_head_m: int) -> list[list[str]]:
    from slime_dsa.ops import triton_invariant as inv  # noqa: PLC0415

    default = inv.TILES[torch.bfloat16]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for name, N, K in LINEAR_SHAPES:
        weight = torch.randn(N, K, device=DEVICE, generator=g, dtype=torch.bfloat16) / K**0.5
        for M in Ms:
            if name == "lm_head" and M > max_lm_head_m:
                continue  # the trainer computes logits in chunks (models/logprobs.py)
            x = torch.randn(M, K, device=DEVICE, generator=g, dtype=torch.bfloat16)
            ws = _copies(weight, M)
            ref_us = bench_us(lambda w: F.linear(x, w), ws)
            cells, want = [], None
            for t in tiles:
                inv.TILES[torch.bfloat16] = t
                try:
                    us = bench_us(lambda w: inv.linear(x, w), ws)
                    out = inv.linear(x, ws[0])
                finally:
                    inv.TILES[torch.bfloat16] = default
                want = out if want is None else want
                cells.append(f"{us:.1f} ({us / ref_us:.2f}x)" + ("" if torch.equal(out, want) else " ≠"))
            same = not any(c.endswith("≠") for c in cells)
            rows.append([name, f"{N}x{K}", str(M), f"{ref_us:.1f}", *cells, "yes" if same else "**no**"])
            logger.info("linear %s M=%d done", name, M)
    return rows


def grouped_rows(Ms: list[int]) -> list[list[str]]:
    from slime_dsa.models.glm_moe_dsa import _grouped_mm  # noqa: PLC0415
    from slime_dsa.ops import triton_invariant as inv  # noqa: PLC0415

    g = torch.Generator(device=DEVICE).manual_seed(1)
    rows = []
    for name, E, N, K in EXPERT_SHAPES:
        weight = torch.randn(E, N, K, device=DEVICE, generator=g, dtype=torch.bfloat16) / K**0.5
        for T in Ms:
            ws = _copies(weight, T)
            expert_ids = torch.randint(0, E, (T * 4,), device=DEVICE, generator=g).sort().values
            offs = torch.searchsorted(expert_ids, torch.arange(E, device=DEVICE), right=True).to(torch.int32)
            x = torch.randn(T * 4, K, device=DEVICE, generator=g, dtype=torch.bfloat16)
            ref_us = bench_us(lambda w: _grouped_mm(x, w.transpose(1, 2), offs=offs), ws)
            us = bench_us(lambda w: inv.grouped_linear(x, w, offs), ws)
            rows.append([name, f"{E}x{N}x{K}", f"{T} ({T * 4} rows)", f"{ref_us:.1f}", f"{us:.1f}",
                         f"{us / ref_us:.2f}x"])
    return rows


def head_rows(Ms: list[int]) -> list[list[str]]:
    """MLA's absorbed per-head products: q_nope @ w_uk and the latent output @ w_uvᵀ (16 heads)."""
    from slime_dsa.ops import triton_invariant as inv  # noqa: PLC0415

    g = torch.Generator(device=DEVICE).manual_seed(3)
    rows = []
    for name, H, K, N in HEAD_SHAPES:
        weight = torch.randn(H, K, N, device=DEVICE, generator=g, dtype=torch.bfloat16) / K**0.5
        for T in Ms:
            x = torch.randn(T, H, K, device=DEVICE, generator=g, dtype=torch.bfloat16)
            ws = _copies(weight, T)
            ref_us = bench_us(lambda w: torch.einsum("thk,hkn->thn", x, w), ws)
            us = bench_us(lambda w: inv.head_matmul(x, w), ws)
            rows.append([name, f"{H}x{K}x{N}", str(T), f"{ref_us:.1f}", f"{us:.1f}", f"{us / ref_us:.2f}x"])
    return rows


def row_op_rows(Ms: list[int], max_logits_m: int) -> list[list[str]]:
    from slime_dsa.ops import triton_invariant as inv  # noqa: PLC0415

    g = torch.Generator(device=DEVICE).manual_seed(2)
    rows = []
    for D in NORM_WIDTHS:
        w = torch.randn(D, device=DEVICE, generator=g, dtype=torch.bfloat16)
        for M in Ms:
            x = torch.randn(M, D, device=DEVICE, generator=g, dtype=torch.bfloat16)
            ref_us = bench_us(lambda _: w * F.rms_norm(x.float(), (D,), eps=1e-6).to(x.dtype))  # the model's RMSNorm
            us = bench_us(lambda _: inv.rms_norm(x, w, 1e-6))
            rows.append(["rms_norm", f"{D}", str(M), f"{ref_us:.1f}", f"{us:.1f}", f"{us / ref_us:.2f}x"])
    for M in Ms:
        if M > max_logits_m:
            continue
        logits = torch.randn(M, VOCAB, device=DEVICE, generator=g, dtype=torch.bfloat16)
        ids = torch.randint(0, VOCAB, (M,), device=DEVICE, generator=g)

        def torch_logprobs(_):  # models/logprobs.py's _chunk
            scaled = logits.float() / 0.7
            return scaled.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)

        ref_us = bench_us(torch_logprobs)
        us = bench_us(lambda _: inv.log_softmax_gather(logits, ids, 0.7))
        rows.append(["log_softmax_gather", f"{VOCAB}", str(M), f"{ref_us:.1f}", f"{us:.1f}", f"{us / ref_us:.2f}x"])
    return rows


def bench_eager_us(op) -> float:
    """Median microseconds of op() launched eagerly (for ops that read sizes on the host: no graph)."""
    import triton.testing  # noqa: PLC0415

    op()
    torch.cuda.synchronize()
    return triton.testing.do_bench(op, rep=50, return_mode="median") * 1000


@torch.no_grad()
def dsa_rows(decode_batch: int, train_tokens: int) -> list[list[str]]:
    """Sparse MLA forward and the indexer top-k, invariant (triton_invariant) against the non-invariant Triton
    kernels (triton_kernels): decode (one query per sequence against a paged pool of 1024-token contexts, graphs)
    and training (packed sequences of 256 tokens, eager: the packed indexer reads sizes on the host)."""
    from slime_dsa.ops import triton_invariant as inv  # noqa: PLC0415
    from slime_dsa.ops import triton_kernels as base  # noqa: PLC0415

    g = torch.Generator(device=DEVICE).manual_seed(4)
    H, d_v, d_r, topk, Hi, Di, ctx, seq = 16, 256, 32, 256, 16, 64, 1024, 256
    rows = []
    # Decode: B queries, each sequence's keys at scattered pool slots.
    B, pool = decode_batch, decode_batch * ctx
    q = torch.randn(B, H, d_v + d_r, device=DEVICE, generator=g, dtype=torch.bfloat16)
    kv_pool = torch.randn(pool, d_v + d_r, device=DEVICE, generator=g, dtype=torch.bfloat16)
    slots = torch.randperm(pool, device=DEVICE, generator=g).view(B, ctx)
    seq_lens = torch.randint(ctx // 2, ctx + 1, (B,), device=DEVICE, generator=g)
    iq = torch.randn(B, Hi, Di, device=DEVICE, generator=g, dtype=torch.bfloat16)
    ik = torch.randn(pool, Di, device=DEVICE, generator=g, dtype=torch.bfloat16)
    iw = torch.randn(B, Hi, device=DEVICE, generator=g) * Hi**-0.5
    local = base.indexer_topk_paged(iq, ik, iw, slots, seq_lens, topk, Di**-0.5)
    picked = torch.where(local >= 0, slots.gather(1, local.clamp(min=0)), -1)
    for name, ref, ours in (
        ("indexer top-k, paged decode", lambda _: base.indexer_topk_paged(iq, ik, iw, slots, seq_lens, topk, 0.125),
         lambda _: inv.indexer_topk_paged(iq, ik, iw, slots, seq_lens, topk, 0.125)),
        ("sparse MLA fwd, decode", lambda _: base.sparse_mla_attention(q, kv_pool, picked, 0.06, d_v),
         lambda _: inv.mla_attention(q, kv_pool, picked, 0.06, d_v)),
    ):
        ref_us, us = bench_us(ref), bench_us(ours)
        rows.append([name, f"B={B}, {ctx}-token contexts", f"{ref_us:.1f}", f"{us:.1f}", f"{us / ref_us:.2f}x"])
    # Training: packed sequences.
    T = train_tokens
    cu = torch.arange(0, T + 1, seq, device=DEVICE)
    q = torch.randn(T, H, d_v + d_r, device=DEVICE, generator=g, dtype=torch.bfloat16)
    kv = torch.randn(T, d_v + d_r, device=DEVICE, generator=g, dtype=torch.bfloat16)
    iq = torch.randn(T, Hi, Di, device=DEVICE, generator=g, dtype=torch.bfloat16)
    ik = torch.randn(T, Di, device=DEVICE, generator=g, dtype=torch.bfloat16)
    iw = torch.randn(T, Hi, device=DEVICE, generator=g) * Hi**-0.5
    local = base.indexer_topk(iq, ik, iw, cu, cu, topk // 2, 0.125)
    picked = torch.where(local >= 0, local + (torch.arange(T, device=DEVICE) // seq * seq)[:, None], -1)
    for name, ref, ours in (
        ("indexer top-k, packed", lambda: base.indexer_topk(iq, ik, iw, cu, cu, topk // 2, 0.125),
         lambda: inv.indexer_topk(iq, ik, iw, cu, cu, topk // 2, 0.125)),
        ("sparse MLA fwd, packed", lambda: base.sparse_mla_attention(q, kv, picked, 0.06, d_v),
         lambda: inv.mla_attention(q, kv, picked, 0.06, d_v)),
    ):
        ref_us, us = bench_eager_us(ref), bench_eager_us(ours)
        rows.append([name, f"T={T}, sequences of {seq}, top-k {topk // 2}", f"{ref_us:.1f}", f"{us:.1f}",
                     f"{us / ref_us:.2f}x"])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _ratio(cell: str) -> float:
    return float(cell.split("(")[1].split("x)")[0])


def summary(linear: list[list[str]], decode_ms: set[int]) -> str:
    """Geometric-mean ratio to cuBLAS of the default tiles, and of the fastest tiles whose output equals the
    default's at that shape and M (what choosing tiles by M would give), decode and training rows apart."""
    out = []
    for label, pick in (("decode", lambda m: m in decode_ms), ("training", lambda m: m not in decode_ms)):
        rows = [r for r in linear if pick(int(r[2]))]
        if not rows:
            continue
        default = [_ratio(r[4]) for r in rows]
        best = [min(_ratio(c) for c in r[4:-1] if not c.endswith("≠")) for r in rows]
        out.append(f"- linear, {label} M ({len(rows)} rows): default tiles {statistics.geometric_mean(default):.2f}x "
                   f"cuBLAS (worst {max(default):.2f}x); best bitwise-equal tiles per row "
                   f"{statistics.geometric_mean(best):.2f}x (worst {max(best):.2f}x)")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,64,256,1024,8192,65536", help="row counts (tokens)")
    parser.add_argument("--tiles", default="128x128x64/8/3,128x128x64/8/5,128x256x64/8/3,64x128x64/4/4,64x64x64/4/4",
                        help="bf16 linear tile shapes to time, BMxBNxBK/warps/stages; the first must be the default")
    parser.add_argument("--max-logits-m", type=int, default=8192, help="largest M for lm_head and log-softmax rows")
    parser.add_argument("--decode-batch", type=int, default=256, help="decode rows of the DSA ops' table")
    parser.add_argument("--train-tokens", type=int, default=4096, help="packed training tokens of the DSA ops' table")
    parser.add_argument("--dsa-only", action="store_true", help="only the DSA ops' table")
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/invariant_kernels.py needs a CUDA GPU")
    import triton  # noqa: PLC0415

    from slime_dsa.ops import triton_invariant as inv  # noqa: PLC0415

    Ms = [int(v) for v in args.m.split(",")]
    tiles = [parse_tiles(t) for t in args.tiles.split(",")]
    if tiles[0] != inv.TILES[torch.bfloat16]:
        raise SystemExit(f"--tiles must start with the default bf16 tiles {inv.TILES[torch.bfloat16]}")
    tile_names = args.tiles.split(",")
    emit(args.out, f"## Batch-invariant kernels vs torch, {torch.cuda.get_device_name()}, "
         f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
         f"torch {torch.__version__}, triton {triton.__version__}; bf16; microseconds per call (CUDA-graph replay, "
         "weights cycled beyond L2); ratio = ours / torch in the same run.", mode="w")
    if args.dsa_only:
        emit(args.out, "### DSA ops, invariant vs the non-invariant Triton kernels\n\n"
             + _table(["op", "batch", "non-invariant µs", "invariant µs", "ratio"],
                      dsa_rows(args.decode_batch, args.train_tokens)))
        return
    linear = linear_rows(Ms, tiles, args.max_logits_m)
    emit(args.out, summary(linear, {m for m in Ms if m <= 1024}) + "\n\n### linear (x @ Wᵀ) vs cuBLAS (F.linear)\n\n"
         + _table(["layer", "N x K", "M", "cuBLAS µs", *[f"tiles {n} µs" for n in tile_names],
                   "all tiles bitwise equal"], linear))
    emit(args.out, "### grouped_linear vs torch grouped_mm (tokens x 4 experts, random routing)\n\n"
         + _table(["layer", "E x N x K", "tokens", "grouped_mm µs", "ours µs", "ratio"], grouped_rows(Ms)))
    emit(args.out, "### head_matmul vs torch einsum (MLA's absorbed projections)\n\n"
         + _table(["product", "H x K x N", "tokens", "einsum µs", "ours µs", "ratio"], head_rows(Ms)))
    emit(args.out, "### RMSNorm (the model's: float32 norm, rounded, times weight) and log-softmax gather (float32, "
         "T=0.7)\n\n" + _table(["op", "width", "M", "torch µs", "ours µs", "ratio"],
                                 row_op_rows(Ms, args.max_logits_m)))
    emit(args.out, "### DSA ops, invariant vs the non-invariant Triton kernels (300m shapes: 16 heads over 256 + 32, "
         "indexer 16 x 64, top-k 256)\n\n" + _table(["op", "batch", "non-invariant µs", "invariant µs", "ratio"],
                                                      dsa_rows(args.decode_batch, args.train_tokens)))


def emit(path: str | None, text: str, mode: str = "a") -> None:
    """Print a section and write it to `path` at once, so that a run cut short keeps the sections it finished."""
    print(text + "\n", flush=True)
    if path:
        with open(path, mode) as f:
            f.write(text + "\n\n")

if __name__ == "__main__":
    main()
