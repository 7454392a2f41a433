"""The sparse MLA backward variants' bookkeeping on CPU: the modes' registry, where the inline PTX reduction may run,
and benchmarks/sparse_mla_bwd_variants.py's summary. Their numerics run in the interpreter (tests/interpret_checks.py)
and on the GPU (tests/test_ops_gpu.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks import sparse_mla_bwd_variants as bench  # noqa: E402
from slime_dsa.ops import triton_sparse_mla as mla  # noqa: E402
from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants  # noqa: E402
from slime_dsa.ops.triton_sparse_mla import KernelConfig  # noqa: E402


def test_every_variant_is_a_backward_mode_and_the_defaults_are_the_measured_ones():
    assert mla.BWD_MODES[:2] == ["fused", "split"]
    assert set(mla.BWD_MODES[2:]) == set(variants.MODES)
    assert mla.BWD_DEFAULT_MODES == ["fused", "split"]
    assert mla.BWD_DEFAULT_MODES_64_HEADS[0] == "split64" and not variants.cuda_only("split64")
    assert [m for m in variants.MODES if variants.cuda_only(m)] == [m for m in variants.MODES if "red" in m]


def test_red_only_on_tiles_checked_to_have_no_replicas():
    assert variants.red_fits(1, True, KernelConfig(64, 16, 8, 2), 512, 64)
    assert variants.red_fits(1, True, KernelConfig(64, 64, 8, 1), 128, 64)
    assert not variants.red_fits(1, True, KernelConfig(64, 16, 8, 2), 64, 16)  # small dims: replicated tiles
    assert not variants.red_fits(1, True, KernelConfig(64, 16, 16, 1), 512, 64)
    assert variants.red_fits(2, False, KernelConfig(32, 32, 8, 1), 512, 64)
    assert not variants.red_fits(1, False, KernelConfig(32, 64, 8, 1), 512, 64)
    assert not variants.red_fits(2, True, KernelConfig(64, 16, 8, 2), 512, 64)  # v4 pairs columns: untransposed only


def test_summary_adds_the_fastest_correct_config_of_each_launch():
    R = bench.Result
    results = [
        R(8192, "split64", "dq", "64, 32, 8, 1", ms=20.0), R(8192, "split64", "dq", "64, 16, 8, 1", ms=25.0),
        R(8192, "split64", "dkv", "64, 16, 8, 2", ms=None, note="wrong: rel L2 above 0.02"),
        R(8192, "split64", "dkv", "64, 32, 8, 1", ms=15.0),
        R(8192, "split64", "dkv", "64, 64, 8, 1", note="failed: OutOfResources"),
        R(32768, "split64", "dq", "64, 32, 8, 1", ms=80.0),  # dkv not run at 32K: no total there
        R(8192, "fused", "fused", "32, 32, 8, 1", ms=70.0),
        R(8192, "split64_par", "bwd_v_dq64", "64, 32, 8, 1", ms=20.0),
        R(8192, "split64_par", "bwd_v_dkv64", "64, 16, 8, 2", ms=15.0),
        R(8192, "split64_par", bench.WHOLE, "fastest of each", ms=28.0),  # the two kernels overlapped
    ]
    summary = bench.summarize(results, {8192: 7e12, 32768: 3e13})
    assert summary["split64"][8192]["ms"] == 35.0
    assert summary["split64"][8192]["tflops"] == pytest.approx(200.0)
    assert summary["split64"][8192]["configs"] == {"dkv": "64, 32, 8, 1", "dq": "64, 32, 8, 1"}
    assert 32768 not in summary["split64"] and summary["fused"][8192]["ms"] == 70.0
    assert summary["split64_par"][8192]["ms"] == 28.0  # measured whole, not the sum
    assert summary["split64_par"][8192]["configs"] == {"bwd_v_dkv64": "64, 16, 8, 2", "bwd_v_dq64": "64, 32, 8, 1"}
    table = bench.markdown(results, summary, [8192, 32768], ["a note"])
    lines = table.splitlines()
    assert lines[2].startswith("| split64_par | 28.00 | 250 |")  # fastest mode first
    assert "failed: OutOfResources" in table and "wrong: rel L2" in table and "- a note" in table


def test_the_stores_timing_launch_is_timed_never_run_as_a_backward():
    """split64_stores (dKV by plain stores: wrong sums) is a benchmark row, not a mode a run or a test can pick."""
    assert "split64_stores" not in mla.BWD_MODES and "split64_stores" not in variants.MODES
    units = bench.mode_units("split64_stores")
    assert [(u.label, u.timing_only) for u in units] == [("bwd_v_dq64", False), ("bwd_v_dkv64_stores", True)]
    assert bench.mode_units("split64")[1].timing_only is False


def test_the_window_selection_gives_each_row_as_many_keys_as_a_causal_top_k():
    import torch  # noqa: PLC0415

    rows = bench.window_indices(5, topk=3, device="cpu")
    assert rows.tolist() == [[0, -1, -1], [1, 0, -1], [2, 1, 0], [3, 2, 1], [4, 3, 2]]
    assert rows.dtype == torch.int32
