"""Shared memory, registers, spills and key-loop length of the sparse MLA kernels compiled for sm_90a, on a machine
without a GPU.

    PYTHONPATH=. python tools/kernel_resources.py --modes fused fused64 split64 --heads 64 --dims 512 64
    PYTHONPATH=. python tools/kernel_resources.py --forward    the forward's configs, skipping empty slots or not
    PYTHONPATH=. python tools/kernel_resources.py --gluon      the Gluon forward's configs and backward kernels

Triton compiles ahead of time for a target it does not have (sm_90, Hopper) and the ptxas shipped in the triton wheel
reports registers and bytes spilled per thread. Arguments are specialised as a launch specialises them (pointers and
16-divisible integers get divisibility 16), so this is the code a GPU with the same Triton runs; the numbers change
with the Triton version (3.6 and 3.8 differ by hundreds of spilled bytes on the 64-head kernels). Also printed: the
tensor-core instruction (wgmma or mma.sync), the global atomics/reductions in the PTX and the machine instructions of
the key loop (per key block; issue-bound code runs about that much longer).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_PTR_TYPES = {torch.float8_e4m3fn: "*fp8e4nv", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
              torch.int64: "*i64", torch.int32: "*i32"}


def compile_sm90(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile `kernel` for sm_90a: args maps each runtime argument to a torch dtype (a pointer), an int or a float;
    returns shared bytes, registers, spilled bytes (stores), the MMA kind and the atomic instructions. KERNEL_PTX /
    KERNEL_SASS name files to write the PTX / SASS to."""
    signature, attrs, consts = {}, {}, dict(constexprs)
    for i, name in enumerate(kernel.arg_names):
        value = args.get(name)
        if name in consts:
            signature[name] = "constexpr"
        elif isinstance(value, torch.dtype):
            signature[name] = _PTR_TYPES[value]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int) and value == 1:  # launches specialise 1 as a constant
            consts[name], signature[name] = 1, "constexpr"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise ValueError(f"argument {name}: expected a torch dtype, an int or a float, got {value!r}")
    source_type = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415 (Triton 3.5+)

        source_type = GluonASTSource
    source = source_type(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", path, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    if os.environ.get("KERNEL_PTX"):
        with open(os.environ["KERNEL_PTX"], "w") as f:
            f.write(ptx)
    if os.environ.get("KERNEL_SASS"):
        with open(os.environ["KERNEL_SASS"], "w") as f:
            f.write(sass)
    return dict(shared=compiled.metadata.shared, regs=int(regs.group(1)) if regs else None,
                spilled=int(spills.group(1)) if spills else None,
                mma="wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "-"),
                atomics=sorted(set(re.findall(r"\b(?:red|atom)\.global\.[a-z0-9.]+", ptx))),
                loop=largest_loop(sass), mma_loop=mma_loop(sass),
                serialized=re.findall(r"wgmma[^\n]*serialized[^\n]*", report))


def largest_loop(sass: str) -> int:
    """Machine instructions in the longest loop of a SASS listing (a kernel's key loop): the span of its longest
    backward branch. Instructions are 16 bytes on sm_90."""
    spans = [int(at, 16) - int(target, 16)
             for at, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", sass)]
    return max([span // 16 + 1 for span in spans if span > 0], default=0)


def mma_loop(sass: str) -> int:
    """Machine instructions in the shortest loop that holds a tensor-core instruction: a warp-specialised kernel's
    computing loop, where the longest backward branch spans its partitions' code."""
    at = {int(a, 16): ins for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)}
    loops = [(int(target, 16), int(a, 16))
             for a, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", sass)]
    spans = [hi - lo for lo, hi in loops if lo < hi
             and any(("HGMMA" in ins or "HMMA" in ins) for a, ins in at.items() if lo <= a <= hi)]
    return min(spans, default=-16) // 16 + 1


def bwd_launches(modes: list[str], H: int, d_v: int, d_r: int):
    """(mode, launch, config, kernel, constexprs) for each kernel config of the given backward modes."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants  # noqa: PLC0415

    dims = dict(D_V=d_v, D_R=d_r, BLOCK_DV=mla._pow2(d_v), BLOCK_DR=mla._pow2(d_r), SCAN=1024,
                SKIP_EMPTY=mla.SKIP_EMPTY_SLOTS)
    gathers = dict(DIMS_POW2=d_v == mla._pow2(d_v) and d_r == mla._pow2(d_r), ROW64=False)

    def consts(cfg, **flags):
        return dict(dims, BLOCK_H=min(cfg.block_h, mla._pow2(H)), BLOCK_N=cfg.block_n, **flags)

    for mode in modes:
        if mode in ("fused", "split"):
            halves = [("fused", True, True, mla.BWD_FUSED_CONFIGS)] if mode == "fused" else [
                ("dq", True, False, mla.BWD_DQ_CONFIGS), ("dkv", False, True, mla.BWD_DKV_CONFIGS)]
            for label, do_dq, do_dkv, configs in halves:
                for cfg in configs:
                    yield mode, label, cfg, mla._sparse_mla_bwd_kernel, consts(cfg, DO_DQ=do_dq, DO_DKV=do_dkv,
                                                                                **gathers)
            continue
        for launch in variants.MODES[mode]:
            for cfg in launch.configs:
                fits = variants.red_fits(launch.red, launch.dkv_t, cfg, mla._pow2(d_v), mla._pow2(d_r))
                red = launch.red if launch.do_dkv and fits else 0
                yield mode, launch.kind, cfg, variants._bwd_variant_kernel, consts(
                    cfg, DO_DQ=launch.do_dq, DO_DKV=launch.do_dkv, DKV_T=launch.dkv_t, RED=red, ROTATE=launch.rotate)


def bwd_args(H: int, d_v: int, d_r: int, K: int = 2048) -> dict:
    """Runtime arguments of the backward kernels for contiguous bf16 q, kv, dout and int64 indices."""
    D = d_v + d_r
    bf16, f32 = torch.bfloat16, torch.float32
    return dict(q_ptr=bf16, kv_ptr=bf16, idx_ptr=torch.int64, dout_ptr=bf16, lse_ptr=f32, delta_ptr=f32, dq_ptr=bf16,
                dkv_ptr=f32, stride_qt=H * D, stride_qh=D, stride_kvt=D, stride_it=K, stride_dot=H * d_v,
                stride_doh=d_v, stride_lt=H, stride_dqt=H * D, stride_dqh=D, stride_dkvt=D, H=H, K=K,
                scale=D**-0.5, scale_log2=D**-0.5 * 1.4426950408889634)


def fwd_launches(H: int, d_v: int, d_r: int):
    """(mode, label, config, kernel, constexprs) of the forward's configs, with and without skipping empty slots."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    dims = dict(D_V=d_v, D_R=d_r, BLOCK_DV=mla._pow2(d_v), BLOCK_DR=mla._pow2(d_r), SCAN=1024,
                DIMS_POW2=d_v == mla._pow2(d_v) and d_r == mla._pow2(d_r), ROW64=False)
    for cfg in mla.FWD_CONFIGS:
        for skip in (True, False):
            yield "fwd", f"skip {'on' if skip else 'off'}", cfg, mla._sparse_mla_fwd_kernel, dict(
                dims, BLOCK_H=min(cfg.block_h, mla._pow2(H)), BLOCK_N=cfg.block_n, SKIP_EMPTY=skip)


def fwd_args(H: int, d_v: int, d_r: int, K: int = 2048) -> dict:
    """Runtime arguments of the forward kernel for contiguous bf16 q and kv, int64 indices and one key split."""
    D = d_v + d_r
    return dict(q_ptr=torch.bfloat16, kv_ptr=torch.bfloat16, idx_ptr=torch.int64, out_ptr=torch.bfloat16,
                lse_ptr=torch.float32, stride_qt=H * D, stride_qh=D, stride_kvt=D, stride_it=K, stride_ot=H * d_v,
                stride_os=0, stride_oh=d_v, stride_lt=H, stride_ls=0, H=H, K=K, keys_per_split=K,
                scale_log2=D**-0.5 * 1.4426950408889634)


def gluon_launches(K: int = 2048):
    """(mode, label, config, kernel, runtime args, constexprs) of the Gluon kernels at GLM-5's shapes (64 heads a
    program, 512 + 64): every forward config, the backward's dQ, dKV and fused kernels and the KL loss's head-summed
    probabilities (Triton 3.5+)."""
    from slime_dsa.ops import gluon_sparse_mla as fwd  # noqa: PLC0415
    from slime_dsa.ops import gluon_sparse_mla_bwd as bwd  # noqa: PLC0415

    H, D = fwd.BLOCK_H, fwd.D_V + fwd.D_R
    bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64
    fwd_runtime = dict(q_ptr=bf16, kv_ptr=bf16, idx_ptr=i64, out_ptr=bf16, lse_ptr=f32, stride_qt=H * D, stride_qh=D,
                       stride_kvt=D, stride_it=K, stride_ot=H * fwd.D_V, stride_oh=fwd.D_V, stride_lt=H, K=K,
                       scale_log2=D**-0.5 * 1.4426950408889634)
    dims = dict(D_V=fwd.D_V, D_R=fwd.D_R, BLOCK_H=H, SCAN=1024, ROW64=False, num_warps=fwd.NUM_WARPS)
    for name, cfg in fwd.CONFIGS.items():
        constexprs = dict(dims, BLOCK_N=cfg.block_n, STAGES=cfg.stages, ROW_SUM_AT_END=cfg.row_sum_at_end,
                          OVERLAP=cfg.overlap)
        kernel = fwd._sparse_mla_fwd_ws_kernel if cfg.warp_specialized else fwd._sparse_mla_fwd_kernel
        if cfg.warp_specialized:
            constexprs.update(PRODUCER_WARPS=fwd.PRODUCER_WARPS, PRODUCER_REGS=fwd.PRODUCER_REGS)
        yield "gluon fwd", name, f"{H}, {cfg.block_n}, {fwd.NUM_WARPS}, {cfg.stages}", kernel, fwd_runtime, constexprs
    bwd_runtime = {k: v for k, v in bwd_args(H, fwd.D_V, fwd.D_R, K).items() if k != "H"}
    for label, do_dq, do_dkv, late_dq, vec, staged in (
            ("dQ", True, False, False, 1, False), ("dKV", False, True, False, 1, False),
            ("fused", True, True, False, 1, False), ("fused late dQ", True, True, True, 1, False),
            ("fused v2", True, True, False, 2, False), ("dKV v4", False, True, False, 4, False),
            ("fused v4", True, True, False, 4, False), ("dKV staged v4", False, True, False, 1, True),
            ("fused staged v4", True, True, False, 1, True)):
        constexprs = dict(dims, BLOCK_N=bwd.BLOCK_N, STAGES=bwd.STAGES, DO_DQ=do_dq, DO_DKV=do_dkv, LATE_DQ=late_dq,
                          RED_STORES=False, RED_VEC=vec, RED_SMEM=staged)
        yield ("gluon bwd", label, f"{H}, {bwd.BLOCK_N}, {fwd.NUM_WARPS}, {bwd.STAGES}", bwd._sparse_mla_bwd_kernel,
               bwd_runtime, constexprs)
    from slime_dsa.ops import gluon_attn_probs as probs  # noqa: PLC0415

    probs_runtime = dict(q_ptr=bf16, kv_ptr=bf16, lse_ptr=f32, idx_ptr=i64, probs_ptr=f32, c0=0, stride_qt=H * D,
                         stride_qh=D, stride_kvt=D, stride_lt=H, stride_it=K, stride_pt=K, K=K,
                         scale_log2=D**-0.5 * 1.4426950408889634)
    for name, (block_n, stages) in probs.CONFIGS.items():
        yield ("gluon KL probs", name, f"{H}, {block_n}, {fwd.NUM_WARPS}, {stages}", probs._attn_probs_kernel,
               probs_runtime, dict(dims, BLOCK_N=block_n, STAGES=stages))


def main() -> None:
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(mla.BWD_MODES), choices=mla.BWD_MODES)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dims", type=int, nargs=2, default=[512, 64], metavar=("LATENT", "ROPE"))
    parser.add_argument("--forward", action="store_true", help="the forward's configs instead of backward modes")
    parser.add_argument("--gluon", action="store_true", help="the Gluon kernels (slime_dsa/ops/gluon_sparse_mla*.py)")
    args = parser.parse_args()
    H, (d_v, d_r) = args.heads, args.dims
    if args.gluon:
        launches = [(mode, label, config, kernel, runtime, constexprs, constexprs["num_warps"], 1)
                    for mode, label, config, kernel, runtime, constexprs in gluon_launches()]
        H, d_v, d_r = 64, 512, 64
    else:
        kernel_args = fwd_args(H, d_v, d_r) if args.forward else bwd_args(H, d_v, d_r)
        launches = [(mode, label, f"{cfg.block_h}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}", kernel,
                     kernel_args, constexprs, cfg.num_warps, cfg.num_stages)
                    for mode, label, cfg, kernel, constexprs in
                    (fwd_launches(H, d_v, d_r) if args.forward else bwd_launches(args.modes, H, d_v, d_r))]
    print(f"triton {triton.__version__}, sm_90a, {H} heads, {d_v} + {d_r}, bf16")
    loop_column = "shortest loop with an MMA" if args.gluon else "key loop"
    print("| mode | launch | heads, keys, warps, stages | shared KB | registers | spilled B | mma | atomics | "
          f"{loop_column} instrs |\n|---|---|---|---|---|---|---|---|---|")
    for mode, label, config, kernel, kernel_args, constexprs, num_warps, num_stages in launches:
        try:
            r = compile_sm90(kernel, kernel_args, constexprs, num_warps, num_stages)
        except Exception as exc:  # noqa: BLE001 (a config that does not compile is a row)
            print(f"| {mode} | {label} | {config} | failed: {type(exc).__name__} | | | | | |", flush=True)
            continue
        loop = r["mma_loop"] if args.gluon else r["loop"]
        mma = r["mma"] + (" (serialised by ptxas)" if r["serialized"] else "")
        print(f"| {mode} | {label} | {config} | {r['shared'] / 1024:.0f} | {r['regs']} | {r['spilled']} | "
              f"{mma} | {', '.join(r['atomics'])} | {loop} |", flush=True)


if __name__ == "__main__":
    main()
