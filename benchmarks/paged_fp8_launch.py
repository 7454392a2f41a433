"""Launch configs of the paged indexer's scoring kernel on fp8 and bf16 keys: dsa_kernels.py's decode shape.

    PYTHONPATH=. python benchmarks/paged_fp8_launch.py                  # H200: batch 128, 64K context
    PYTHONPATH=. python benchmarks/paged_fp8_launch.py --batch 32 --time-limit 60
    PYTHONPATH=. python benchmarks/paged_fp8_launch.py --block-n 64 128 --tiles 4 8 --warps 4 --stages 3 5

Times `triton_indexer_paged._paged_scores_kernel` (scores only, no select) at each (keys a tile, tiles a program, warps,
stages) with triton.testing.do_bench, and the key bytes read per second. Every config's scores must equal the first
config's of the same key dtype (maxdiff: a different summation order over heads moves the last bits). The current
launches are `FP8_LAUNCH` (fp8) and (BLOCK_N, TILES, 3) (bf16).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import triton
from triton.testing import do_bench

from slime_dsa.ops import triton_indexer_paged as tip
from slime_dsa.ops.fp8_keys import quantize_keys

HI, DI, CTX = 32, 128, 65536  # dsa_kernels.py's decode rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--time-limit", type=float, default=200.0, help="stop starting configs after this many s")
    parser.add_argument("--keys", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256], help="keys a tile")
    parser.add_argument("--tiles", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="tiles a program")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 5])
    args = parser.parse_args()
    batch = args.batch
    keys = torch.randn(batch * CTX, DI, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, HI, DI, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(batch, HI, device="cuda")
    slots = torch.arange(batch * CTX, device="cuda").view(batch, CTX)
    lens = torch.full((batch,), CTX, device="cuda")
    fp8 = quantize_keys(keys)
    out = torch.empty(batch, CTX, device="cuda")
    first: dict[bool, torch.Tensor] = {}
    start = time.time()
    configs = itertools.product([k == "fp8" for k in args.keys], args.block_n, args.tiles, args.warps, args.stages)
    print(f"{torch.cuda.get_device_name()}, batch {batch}, context {CTX}, {HI} index heads x {DI}")
    for is_fp8, block_n, tiles, warps, stages in configs:
        if time.time() - start > args.time_limit:
            print("time limit: remaining configs skipped")
            break
        k, scales = (fp8.values, fp8.scales) if is_fp8 else (keys, keys)

        def launch() -> None:
            tip._paged_scores_kernel[(batch, triton.cdiv(CTX, block_n * tiles))](
                q, w, k, scales, slots, lens, out, CTX, DI**-0.5, HI=HI, DI=DI, BLOCK_HI=32, BLOCK_DI=128,
                BLOCK_N=block_n, TILES=tiles, HAS_KEY_SCALES=is_fp8, num_warps=warps, num_stages=stages)

        name = f"{'fp8' if is_fp8 else 'bf16'} keys, {block_n} keys x {tiles} tiles, {warps} warps, {stages} stages"
        try:
            launch()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 (a config that does not compile or fit is reported, not fatal)
            print(f"{name}: failed: {type(err).__name__}: {str(err)[:100]}")
            continue
        maxdiff = (out - first.setdefault(is_fp8, out.clone())).abs().max().item()
        ms = do_bench(launch, rep=100)
        key_bytes = batch * CTX * DI * (1 if is_fp8 else 2)
        print(f"{name}: {ms:.3f} ms, keys {key_bytes / ms / 1e9:.2f} TB/s, maxdiff {maxdiff:.1e}", flush=True)


if __name__ == "__main__":
    main()
