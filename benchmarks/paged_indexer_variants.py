"""Decode indexer top-k over the paged key pool, split into its two kernels, for the current kernels and candidate
variants: issue 20 item 4 (indexer top-k <= 2x sparse MLA at batch 128, 64K context).

    PYTHONPATH=. python benchmarks/paged_indexer_variants.py --out $OUT/paged_variants.json
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/paged_indexer_variants.py --smoke   # CPU, tiny shapes

Shapes are `dsa_kernels.py`'s decode rows: 32 index heads x 128, top-k 2048, one query per request, every
request at context 65536, bf16 keys, read through key slots laid out as the engine lays them (pages of 16 slots,
pages in random pool order). Scoring variants (`_scores_variant_kernel`: tile width, warps, several tiles a
program, k @ q^T, page-start slot loads) are timed with the current select; select variants (`topk_select`'s kernel
at other widths, `triton_topk_split.topk_select_split` at several slice counts, `triton_topk_sampled`'s select: one
full read of the scores, then the entries it keeps, logged) on the current scores; "best" joins the fastest of
each. A variant's time counts only if its selection equals the current kernels' exactly on small-integer inputs
(exact scores, many ties: higher score first, lower position on a tie); `rand diff` is the share of slots that
differ on the random inputs, where a different summation order may move a near-tie. Times are CUDA-graph replays
(the engine decodes in graphs), median, L2 flushed before each; the sparse MLA forward at the same batch, the
goal's yardstick, is timed eagerly as `dsa_kernels.py` does.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slime_dsa.ops.triton_indexer_paged import paged_scores
from slime_dsa.ops.triton_topk import _topk_select_kernel, topk_select
from slime_dsa.ops.triton_topk_sampled import keep_above_floor, topk_select_sampled
from slime_dsa.ops.triton_topk_split import split_slices, topk_select_split

logger = logging.getLogger("paged_indexer_variants")

HI, DI, TOPK, CTX, PAGE = 32, 128, 2048, 65536, 16  # dsa_kernels.py's decode rows; the engine's block size
MLA_HEADS, MLA_D, MLA_V = 64, 576, 512
BATCHES = (128, 32, 1)  # the goal's batch first: a run cut short still has it
L2_FLUSH_BYTES = 256 << 20  # more than the H200's L2


@triton.jit
def _scores_variant_kernel(
    q_ptr, w_ptr, k_ptr, slots_ptr, lens_ptr, scores_ptr, width, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES: tl.constexpr, PAGE: tl.constexpr, KQ: tl.constexpr,
):
    """`_paged_scores_kernel` with TILES tiles a program (q and w loaded once), page-start slot loads (PAGE > 0:
    slots contiguous within each page, as the engine's are) and the dot as k @ q^T (KQ: heads summed in-warp)."""
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    h_ok, d_ok = offs_h < HI, offs_d < DI
    q = tl.load(q_ptr + b * HI * DI + offs_h[:, None] * DI + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + b * HI + offs_h, mask=h_ok, other=0.0).to(tl.float32) * scale
    n_keys = tl.load(lens_ptr + b)
    for t in range(TILES):
        offs_n = (tl.program_id(1) * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_row = offs_n < width
        valid = offs_n < n_keys
        if PAGE > 0:
            page_start = tl.load(slots_ptr + b * width + (offs_n // PAGE) * PAGE, mask=in_row, other=0)
            slot = page_start.to(tl.int64) + offs_n % PAGE
        else:
            slot = tl.load(slots_ptr + b * width + offs_n, mask=in_row, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * DI + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if KQ:
            s = tl.maximum(tl.dot(k.to(q.dtype), tl.trans(q)), 0.0) * w[None, :]  # (BN, BH) fp32
            score = tl.sum(s, axis=1)
        else:
            s = tl.maximum(tl.dot(q, tl.trans(k.to(q.dtype))), 0.0) * w[:, None]  # (BH, BN) fp32
            score = tl.sum(s, axis=0)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0
        tl.store(scores_ptr + b * width + offs_n, tl.where(valid, score, float("-inf")), mask=in_row)


@dataclass(frozen=True)
class ScoreVariant:
    """Launch parameters of `_scores_variant_kernel`."""

    name: str
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    tiles: int = 1
    page: int = 0
    kq: bool = False

    def __call__(self, q, k_pool, weights, key_slots, seq_lens, scale: float) -> torch.Tensor:
        B, Hi, Di = q.shape
        width = key_slots.shape[1]
        scores = torch.empty(B, width, dtype=torch.float32, device=q.device)
        _scores_variant_kernel[(B, triton.cdiv(width, self.block_n * self.tiles))](
            q, weights, k_pool, key_slots, seq_lens, scores, width, float(scale), HI=Hi, DI=Di,
            BLOCK_HI=max(16, triton.next_power_of_2(Hi)), BLOCK_DI=max(16, triton.next_power_of_2(Di)),
            BLOCK_N=self.block_n, TILES=self.tiles, PAGE=self.page, KQ=self.kq, num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
        return scores


SCORE_VARIANTS: list[Callable] = [
    paged_scores,  # the current kernel: BLOCK_N 64, 4 tiles a program, 4 warps
    ScoreVariant("n64 w2", num_warps=2),
    ScoreVariant("n128 w4", block_n=128),
    ScoreVariant("n128 w8", block_n=128, num_warps=8),
    ScoreVariant("n256 w8", block_n=256, num_warps=8),
    ScoreVariant("n64 w4 kq", kq=True),
    ScoreVariant("n128 w4 kq", block_n=128, kq=True),
    ScoreVariant("n128 w8 kq", block_n=128, num_warps=8, kq=True),
    ScoreVariant("n64 w4 x4 tiles", tiles=4),
    ScoreVariant("n128 w4 x4 tiles kq", block_n=128, tiles=4, kq=True),
    ScoreVariant("n64 w4 page16", page=PAGE),
    ScoreVariant("n128 w4 kq page16", block_n=128, kq=True, page=PAGE),
    ScoreVariant("n128 w4 x4 tiles kq page16", block_n=128, tiles=4, kq=True, page=PAGE),
]


def radix_select(block: int, num_warps: int) -> Callable:
    """`topk_select`'s one-program-a-row kernel at another step width and warp count."""

    def select(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> torch.Tensor:
        out = torch.empty(scores.shape[0], topk, dtype=torch.int64, device=scores.device)
        _topk_select_kernel[(scores.shape[0],)](scores, n_valid, out, scores.stride(0), out.stride(0),
                                                scores.shape[1], topk, BLOCK=block, num_warps=num_warps)
        return out

    return select


def split_select(block: int, num_warps: int, per_sm: int) -> Callable:
    """`topk_select_split` with `per_sm` programs an SM."""

    def select(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> torch.Tensor:
        slices = split_slices(scores.shape[0], scores.shape[1], block, scores.device, per_sm)
        return topk_select_split(scores, n_valid, topk, slices=slices, block=block, num_warps=num_warps)

    return select


def sampled_select(block: int, num_warps: int, per_sm: int) -> Callable:
    """`topk_select_sampled` with `per_sm` programs an SM."""

    def select(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> torch.Tensor:
        slices = split_slices(scores.shape[0], scores.shape[1], block, scores.device, per_sm)
        return topk_select_sampled(scores, n_valid, topk, slices=slices, block=block, num_warps=num_warps)

    return select


SELECT_VARIANTS: dict[str, Callable] = {
    "radix (current)": topk_select,
    "radix b4096 w16": radix_select(4096, 16),
    "radix b8192 w16": radix_select(8192, 16),
    "radix b1024 w4": radix_select(1024, 4),
    "split b1024 w4 4/SM": split_select(1024, 4, 4),
    "split b2048 w8 4/SM": split_select(2048, 8, 4),
    "split b512 w4 8/SM": split_select(512, 4, 8),
    "split b1024 w4 64/SM": split_select(1024, 4, 64),  # one step a program: no loop left to wait in
    "sampled b1024 w4 4/SM": sampled_select(1024, 4, 4),
    "sampled b512 w4 8/SM": sampled_select(512, 4, 8),
    "sampled b2048 w8 4/SM": sampled_select(2048, 8, 4),
    "sampled b1024 w4 2/SM": sampled_select(1024, 4, 2),
}


def variant_name(fn: Callable) -> str:
    return "current (n64 w4 x4 tiles)" if fn is paged_scores else fn.name


@dataclass
class Case:
    """One batch's inputs: random (timed) and small-integer (exact scores, for the equality check)."""

    q: torch.Tensor
    k_pool: torch.Tensor
    w: torch.Tensor
    q_int: torch.Tensor
    k_int: torch.Tensor
    w_int: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor
    topk: int


def make_case(batch: int, ctx: int, hi: int, di: int, topk: int, device: str, dtype: torch.dtype, ragged: bool) -> Case:
    """Keys of each request in pages of PAGE slots, pages in random pool order (as the engine's block table)."""
    g = torch.Generator(device=device).manual_seed(batch)
    pages = torch.randperm(batch * ctx // PAGE, device=device, generator=g).view(batch, ctx // PAGE)
    slots = (pages[:, :, None] * PAGE + torch.arange(PAGE, device=device)).reshape(batch, ctx)  # (B, ctx)
    lens = (torch.randint(1, ctx + 1, (batch,), device=device, generator=g) if ragged
            else torch.full((batch,), ctx, device=device))
    ints = lambda *s: torch.randint(-2, 3, s, device=device, generator=g).to(dtype)  # noqa: E731
    return Case(torch.randn(batch, hi, di, device=device, generator=g).to(dtype),
                torch.randn(batch * ctx, di, device=device, generator=g).to(dtype),
                torch.randn(batch, hi, device=device, generator=g) * hi**-0.5,
                ints(batch, hi, di), ints(batch * ctx, di), ints(batch, hi).float(), slots, lens, topk)


def time_ms(fn: Callable[[], object], reps: int, flush: torch.Tensor | None) -> float:
    """Median ms of a CUDA-graph replay of fn, L2 flushed before each; NaN off CUDA."""
    if flush is None:
        return math.nan
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def sparse_mla_ms(case: Case, reps: int) -> float:
    """Sparse MLA forward at the same decode shape (64 heads, latent 512 + rope 64) on the current selection, timed
    eagerly as `dsa_kernels.py` times it: the goal's yardstick (indexer top-k <= 2x this)."""
    from slime_dsa.ops.triton_sparse_mla import sparse_mla_attention  # noqa: PLC0415

    B, ctx = case.slots.shape
    scores = paged_scores(case.q, case.k_pool, case.w, case.slots, case.lens, DI**-0.5)
    local = topk_select(scores, case.lens, case.topk)
    rows = torch.where(local >= 0, local + torch.arange(B, device="cuda")[:, None] * ctx, -1)  # packed kv rows
    kv = torch.randn(B * ctx, MLA_D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, MLA_HEADS, MLA_D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            sparse_mla_attention(q, kv, rows, MLA_D**-0.5, MLA_V)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            sparse_mla_attention(q, kv, rows, MLA_D**-0.5, MLA_V)
            end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def measure(case: Case, score_fn: Callable, select_fn: Callable, reps: int, flush, scale: float) -> dict:
    """Exactness against the current kernels, then score / select / whole times of one combination."""
    c = case
    want_int = topk_select(paged_scores(c.q_int, c.k_int, c.w_int, c.slots, c.lens, 1.0), c.lens, c.topk)
    got_int = select_fn(score_fn(c.q_int, c.k_int, c.w_int, c.slots, c.lens, 1.0), c.lens, c.topk)
    cur_scores = paged_scores(c.q, c.k_pool, c.w, c.slots, c.lens, scale)
    want = topk_select(cur_scores, c.lens, c.topk)
    got = select_fn(score_fn(c.q, c.k_pool, c.w, c.slots, c.lens, scale), c.lens, c.topk)
    row = {"exact": bool(torch.equal(got_int, want_int)), "rand_diff": (got != want).float().mean().item()}
    if select_fn is not topk_select:  # the select alone is exact on any scores
        row["exact"] &= bool(torch.equal(select_fn(cur_scores, c.lens, c.topk), want))
    if not row["exact"]:
        return row
    scores = score_fn(c.q, c.k_pool, c.w, c.slots, c.lens, scale)
    row["score_ms"] = time_ms(lambda: score_fn(c.q, c.k_pool, c.w, c.slots, c.lens, scale), reps, flush)
    row["select_ms"] = time_ms(lambda: select_fn(scores, c.lens, c.topk), reps, flush)
    row["total_ms"] = time_ms(lambda: select_fn(score_fn(c.q, c.k_pool, c.w, c.slots, c.lens, scale), c.lens, c.topk),
                              reps, flush)
    return row


def run(batches: list[int], ctx: int, hi: int, di: int, topk: int, device: str, dtype: torch.dtype, reps: int,
        smoke: bool) -> Iterator[list[dict]]:
    """Every scoring and select variant at each batch, then the fastest exact pair: one list of rows per batch."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if device == "cuda" else None
    for batch in batches:
        case = make_case(batch, ctx, hi, di, topk, device, dtype, ragged=smoke)
        if smoke:  # the current kernels against the torch reference too
            from slime_dsa.ops import reference  # noqa: PLC0415

            args = (case.q_int, case.k_int, case.w_int, case.slots, case.lens)
            want = reference.indexer_topk_paged(*args, topk, 1.0)
            got = topk_select(paged_scores(*args, 1.0), case.lens, topk)
            assert torch.equal(got, want), "current paged indexer differs from the torch reference"
        key_bytes = case.lens.sum().item() * di * case.k_pool.element_size()
        log_kept(case, di**-0.5)
        if not smoke:
            mla_ms = sparse_mla_ms(case, reps)
            logger.info("| sparse MLA forward (the goal: indexer <= 2x = %.3f ms) | %d | - | - | %.3f | - | - | - |",
                        2 * mla_ms, batch, mla_ms)
        combos = [(variant_name(f), f, topk_select) for f in SCORE_VARIANTS]
        combos += [(name, paged_scores, f) for name, f in SELECT_VARIANTS.items() if f is not topk_select]
        batch_rows = []
        for name, score_fn, select_fn in combos:
            row = {"variant": name, "batch": batch, "context": ctx,
                   **measure(case, score_fn, select_fn, reps, flush, di**-0.5)}
            batch_rows.append((row, score_fn, select_fn))
            log_row(row, key_bytes)
        ok = [r for r in batch_rows if r[0]["exact"]]
        if ok and not smoke:
            best_score = min(ok, key=lambda r: r[0]["score_ms"])[1]
            best_select = min(ok, key=lambda r: r[0]["select_ms"])[2]
            row = {"variant": f"best: {variant_name(best_score)} + "
                              f"{next(n for n, f in SELECT_VARIANTS.items() if f is best_select)}",
                   "batch": batch, "context": ctx, **measure(case, best_score, best_select, reps, flush, di**-0.5)}
            batch_rows.append((row, best_score, best_select))
            log_row(row, key_bytes)
        if not smoke:
            current, fastest = batch_rows[0][0], min((r[0] for r in ok), key=lambda r: r["total_ms"])
            logger.info("| goal: indexer / sparse MLA <= 2x: %.2fx now, %.2fx with %s | %d | - | - | - | - | - | - |",
                        current["total_ms"] / mla_ms, fastest["total_ms"] / mla_ms, fastest["variant"], batch)
        for row, *_ in batch_rows:
            row["key_gbps"] = key_bytes / (row["score_ms"] * 1e-3) / 1e9 if row.get("score_ms") else None
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
        mla_row = [] if smoke else [{"variant": "sparse MLA forward", "batch": batch, "context": ctx, "exact": True,
                                     "rand_diff": 0.0, "total_ms": mla_ms}]
        yield mla_row + [row for row, *_ in batch_rows]


def log_kept(case: Case, scale: float) -> None:
    """Entries a row that `topk_select_sampled` keeps past its one full read, on the random scores: the rest of its
    work. A row that kept fewer than its top k falls back to reading everything again."""
    scores = paged_scores(case.q, case.k_pool, case.w, case.slots, case.lens, scale)
    block = 1024
    slices = split_slices(scores.shape[0], scores.shape[1], block, scores.device)
    total = keep_above_floor(scores, case.lens, case.topk, slices, block, 4).total.float()
    fell_back = (total < case.lens.clamp(max=case.topk)).sum().item()
    logger.info("| sampled select: a row keeps %.0f entries (%.0f-%.0f) for top-%d, %d rows fall back | %d | - | - | - "
                "| - | - | - |", total.mean(), total.min(), total.max(), case.topk, fell_back, scores.shape[0])


def log_row(row: dict, key_bytes: int) -> None:
    cells = [f"{row[k]:.3f}" if isinstance(row.get(k), float) else "-" for k in ("score_ms", "select_ms", "total_ms")]
    gbps = key_bytes / (row["score_ms"] * 1e-3) / 1e9 if row.get("score_ms") else math.nan
    logger.info("| %s | %d | %s | %.0f | %s | %.1e |", row["variant"], row["batch"], " | ".join(cells), gbps,
                "yes" if row["exact"] else "NO", row["rand_diff"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.smoke:  # float32 small integers: the interpreter's bf16 dot is not faithful
        shape = dict(batches=[1, 3], ctx=1280, hi=4, di=16, topk=32, device="cpu", dtype=torch.float32)
    else:
        shape = dict(batches=args.batches, ctx=CTX, hi=HI, di=DI, topk=TOPK, device="cuda", dtype=torch.bfloat16)
    versions = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "triton": triton.__version__}
    logger.info("%s; torch %s, Triton %s", versions["device"], versions["torch"], versions["triton"])
    logger.info("context %d, %d index heads x %d, top-k %d; times in ms", shape["ctx"], shape["hi"], shape["di"],
                shape["topk"])
    logger.info("\n| variant | batch | score ms | select ms | total ms | key GB/s | exact | rand diff |\n"
                "|---|---|---|---|---|---|---|---|")
    rows = []
    for batch_rows in run(**shape, reps=args.reps, smoke=args.smoke):
        rows += batch_rows
        if args.out:  # after every batch, so that a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"shape": {k: str(v) for k, v in shape.items()}, "versions": versions, "rows": rows}, f,
                          indent=1)
    differ = [f"{r['variant']} at batch {r['batch']}" for r in rows if not r["exact"]]
    if differ:  # a variant that differs is a bug in it: its row carries no times
        logger.error("selection differs from the current kernels': %s", ", ".join(differ))
        if args.smoke:
            sys.exit(1)


if __name__ == "__main__":
    main()
