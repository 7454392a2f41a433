"""bf16 conformance on one GPU: DeepSpeed ZeRO-3 (on the device, and with optimizer and parameters in host memory)
against FSDP2 with bf16 mixed precision, five steps of the same batches on the tiny GLM-MoE-DSA (the CPU test's,
tests/test_deepspeed_conformance.py, with bf16 compute).

Tolerances (bf16): both compute with bf16 weights rounded from float32 masters that start from the checkpoint's
float32 values, and update in float32; DeepSpeed reduces and accumulates a step's micro-batch gradients in bf16, FSDP2
in float32. Each step's loss is taken at π_old = π_θ, where it is the advantages' mean whatever the weights: the
gradient norms carry the comparison (2e-2 relative). Adam's normalised update turns a bf16 difference in a near-zero
gradient into a step of up to lr the other way, so one weight can differ by up to 2 · lr · steps = 1e-2 after five
steps; the mean gap must stay a small share of that (1e-3). The measured gaps are printed (-s).
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.hf_reference import make_hf_checkpoint
from tests.test_deepspeed_conformance import needs_deepspeed, run_variants
from trainers.process_group import free_port

pytestmark = [pytest.mark.gpu, needs_deepspeed]

GPU_VARIANTS = {
    "fsdp": None,
    "zero3": {"zero_stage": 3, "param_persistence_threshold": 0},
    "zero3_offload": {"zero_stage": 3, "param_persistence_threshold": 0, "offload_optimizer": "cpu",
                      "offload_param": "cpu"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ds_gpu")
    make_hf_checkpoint(directory / "ckpt", index_topk=4)
    mp.start_processes(run_variants, args=(1, free_port(), str(directory / "ckpt"), str(directory), GPU_VARIANTS, True),
                       nprocs=1, start_method="spawn")
    results = json.loads((directory / "results.json").read_text())
    return results, {name: load_file(directory / f"{name}.safetensors") for name in GPU_VARIANTS}


@pytest.mark.parametrize("name", ["zero3", "zero3_offload"])
def test_bf16_zero3_follows_fsdp2(runs, name):
    results, weights = runs
    expected, got = results["fsdp"]["metrics"], results[name]["metrics"]
    gaps = [abs(g["grad_norm"] - e["grad_norm"]) / max(abs(e["grad_norm"]), 1e-6) for e, g in zip(expected, got)]
    diffs = [(weights[name][k].float() - v.float()).abs() for k, v in weights["fsdp"].items()]
    largest = max(d.max().item() for d in diffs)
    mean = sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs)
    print(f"{name}: grad-norm relative gaps {[f'{x:.1e}' for x in gaps]}, weight gap largest {largest:.1e} mean {mean:.1e}")
    assert max(gaps) < 2e-2
    assert largest <= 1e-2 and mean < 1e-3


@pytest.mark.parametrize("name", list(GPU_VARIANTS))
def test_bf16_checkpoint_resumes(runs, name):
    """Up to the GPU's run-to-run noise (atomic adds in the experts' backward)."""
    results, _ = runs
    for again, first in zip(results[name]["resumed"], results[name]["metrics"][3:]):
        assert again["loss"] == pytest.approx(first["loss"], rel=1e-3)
