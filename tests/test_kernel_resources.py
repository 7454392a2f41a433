"""tools/kernel_resources.py: a backward kernel compiled for sm_90a without a GPU, with its resources read back."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


@pytest.mark.slow  # one compile to a cubin, ~2 s
def test_a_64_head_variant_compiles_for_hopper_with_wgmma_and_vector_atomics():
    from tools.kernel_resources import bwd_args, bwd_launches, compile_sm90

    H, d_v, d_r = 64, 128, 64
    mode, label, cfg, kernel, constexprs = next(bwd_launches(["split64"], H, d_v, d_r))
    constexprs = dict(constexprs, DO_DQ=False, DO_DKV=True)  # the dKV half: its atomics
    r = compile_sm90(kernel, bwd_args(H, d_v, d_r), constexprs, cfg.num_warps, cfg.num_stages)
    assert r["mma"] == "wgmma" and 0 < r["shared"] <= 227 * 1024 and 0 < r["regs"] <= 255
    assert any(".v4.f32" in a for a in r["atomics"]), r["atomics"]  # fp32 atomic adds vectorised on sm_90
