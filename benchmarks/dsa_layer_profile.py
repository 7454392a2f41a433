"""Where the DSA layer's time goes on the GPU: torch.profiler's device time by kernel for the sparse MLA forward +
backward and for one IndexShare group's indexer KL loss (4 layers, forward + backward), at one length.

    PYTHONPATH=. python benchmarks/dsa_layer_profile.py --length 65536 --out $OUT/dsa_layer_profile.md

Same inputs as benchmarks/dsa_kernels.py (GLM-5 sizes, the indexer's own causal top-k rows on random inputs).
Each part runs twice to warm up, then `--reps` times under the profiler; the tables give each kernel's device
time per repetition and its share of the part's wall time, so that what lies outside the named kernels shows.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.dsa_kernels import D, DI, H, HI, V_DIM, _indices


def profiled(fn, reps: int, top: int) -> list[str]:
    """Markdown rows: wall ms per repetition, then the top kernels by device time."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / reps
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / 1e3 / reps
    lines = [f"wall {wall_ms:.2f} ms per repetition, kernels {total:.2f} ms ({100 * total / wall_ms:.0f}%)", "",
             "| kernel | calls / rep | device ms / rep | share of wall |", "|---|---:|---:|---:|"]
    for e in events[:top]:
        ms = e.self_device_time_total / 1e3 / reps
        lines.append(f"| `{e.key[:90]}` | {e.count / reps:.0f} | {ms:.2f} | {100 * ms / wall_ms:.1f}% |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=str, default=None)
    parser.add_argument("--probs-configs", nargs="*", default=[],
                        help="also time the KL loss with each of these gluon_attn_probs configs, and with the Triton "
                        "target ('triton')")
    args = parser.parse_args()
    from slime_dsa.ops import gluon_attn_probs, triton_indexer_loss  # noqa: PLC0415
    from slime_dsa.ops.triton_indexer_loss import indexer_kl_loss  # noqa: PLC0415
    from slime_dsa.ops.triton_sparse_mla import sparse_mla_attention  # noqa: PLC0415

    T = args.length
    torch.manual_seed(T)
    indices = _indices(T)
    cu = torch.tensor([0, T], device="cuda")
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(T, H, V_DIM, device="cuda", dtype=torch.bfloat16)
    scale = D**-0.5

    def sparse_fwd_bwd():
        o, _ = sparse_mla_attention(q, kv, indices, scale, V_DIM)
        torch.autograd.grad(o, (q, kv), dout)

    with torch.no_grad():
        _, lse = sparse_mla_attention(q, kv, indices, scale, V_DIM)
    iq = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ik = torch.randn(T, DI, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    iw = (torch.randn(T, HI, device="cuda") * HI**-0.5).requires_grad_(True)
    qd, kvd = q.detach(), kv.detach()

    def kl_fwd_bwd():
        loss = indexer_kl_loss(iq, ik, iw, DI**-0.5, [qd] * 4, [kvd] * 4, [lse] * 4, scale, cu, cu, indices)
        torch.autograd.grad(loss.sum(), (iq, ik, iw))

    out = [f"# DSA layer profile at T = {T} ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
           f"`{' '.join(sys.argv)}`", ""]
    for name, fn in (("sparse MLA forward + backward", sparse_fwd_bwd), ("indexer KL loss, 4 layers, fwd + bwd",
                                                                         kl_fwd_bwd)):
        out += [f"## {name}", ""] + profiled(fn, args.reps, args.top) + [""]
    default = gluon_attn_probs.DEFAULT_CONFIG
    for config in args.probs_configs:
        triton_indexer_loss.GLUON_PROBS = config != "triton"
        gluon_attn_probs.DEFAULT_CONFIG = default if config == "triton" else config
        out += [f"## indexer KL loss with the target's kernel: {config}", ""] + profiled(kl_fwd_bwd, args.reps, 4)
        out += [""]
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
