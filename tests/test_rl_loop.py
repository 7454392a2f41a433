"""The main job end to end on CPU: 3 GRPO steps, 2 embedded engines, 2 FSDP ranks, then resume and export.

Real parts throughout: a local Ray cluster, engines behind real HTTP on 127.0.0.1, FSDP2 over gloo, wandb offline.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from slime_dsa.config import load_recipe

RECIPE = {
    "model": {"preset": "tiny"},
    "data": {"tasks": [{"kind": "arithmetic", "eval_size": 8, "reward_fn": "tests.plugins.rewards:digit_fraction"}],
             "apply_chat_template": True, "max_prompt_length": 96},
    "rollout": {"num_engines": 2, "n_samples_per_prompt": 4, "prompts_per_step": 4, "max_response_length": 8},
    "trainer": {"num_workers": 2, "num_steps": 3, "num_steps_per_rollout": 2, "learning_rate": 3.0e-3,
                "micro_batch_tokens": 256},
    "logging": {"eval_every": 3, "wandb_mode": "offline", "peak_tflops": 1.0, "profile_steps": [2]},
    "checkpoint": {"save_every": 1, "keep_last": 0},
}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(record):
    return {k: v for k, v in record.items() if not k.startswith("perf/") and k not in ("time", "elapsed_s")}


def train_recipe(root, recipe: dict):
    """Write `recipe` to root/recipe.yaml and train it in root/run; the run directory."""
    from slime_dsa.orchestrator.train import run_training

    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return run_training(load_recipe(path, [f"logging.run_dir={root / 'run'}"]))


def rerun_from_step_2(root, run_dir):
    """Resume root/recipe.yaml from run_dir's step-2 checkpoint in a fresh directory: (the first run's step 3
    comparable, the resumed run's step-3 records, all the resumed run's records)."""
    import shutil

    from slime_dsa.orchestrator.train import run_training

    resumed = root / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step_000002", resumed / "checkpoints" / "step_000002")
    shutil.copytree(run_dir / "initial_model", resumed / "initial_model")
    run_training(load_recipe(root / "recipe.yaml", [f"logging.run_dir={resumed}"]), resume=True)
    step3 = _comparable(next(r for r in _records(run_dir) if r["step"] == 3))
    return step3, [r for r in _records(resumed) if r["step"] == 3], _records(resumed)


# The engines' own log-probs vary at 1e-7 with how requests happen to share a decode batch, and these metrics
# measure exactly that noise.
ENGINE_NOISE = ("train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max",
                "train/train_rollout_logprob_exact_frac")


def assert_equal_but_engine_noise(resumed: dict, first: dict) -> None:
    """A resumed step's metrics equal the first run's bit for bit, but the engine-noise ones (within 1e-6)."""
    resumed, first = dict(resumed), dict(first)
    for key in ENGINE_NOISE:
        a, b = resumed.pop(key, None), first.pop(key, None)
        assert (a is None) == (b is None), key
        assert a is None or key.endswith("exact_frac") or abs(a - b) < 1e-6, (key, a, b)
    assert _comparable(resumed) == first


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("rl")
    return root, train_recipe(root, RECIPE)


def test_three_steps_train_sync_and_log(first_run):
    from safetensors.torch import load_file

    _, run_dir = first_run
    initial, *records = _records(run_dir)
    # the starting policy's eval (logging.eval_at_start), logged as step 0
    assert initial["step"] == 0 and "eval/pass@1" in initial and all(k in ("step", "time", "elapsed_s") or k.startswith("eval/") for k in initial)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        assert r["train/skipped_updates"] == 0
        # The engines sampled with exactly the weights the trainer holds: the sync after every step worked.
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5
        assert r["train/train_rollout_logprob_abs_diff"] <= r["train/train_rollout_logprob_abs_diff_max"] < 1e-4
        assert 0.0 <= r["train/train_rollout_logprob_exact_frac"] <= 1.0
        assert r["rollout/num_samples"] == 16
    assert any(r["train/grad_norm"] > 0 for r in records)
    assert "eval/pass@1" in records[-1]
    initial = load_file(run_dir / "initial_model" / "model.safetensors")
    final = load_file(run_dir / "checkpoints" / "step_000003" / "model.safetensors")
    changed = [k for k in initial if not torch.equal(initial[k], final[k])]
    assert len(changed) > len(initial) // 2, f"only {len(changed)} tensors changed"
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "no offline wandb run files"


def test_every_step_logs_engine_and_trainer_performance(first_run):
    _, run_dir = first_run
    _, *records = _records(run_dir)
    for r in records:
        # the engines' step loops over the step's rollouts (rollout.engine.perf): both engines stepped
        # each engine: a prefill step and 7 decode steps for its 2 groups together, 16 for them one after the other
        # (a loaded machine); evaluation is left out (tests/test_perf_metrics.py)
        assert 2 * 8 <= r["perf/engine_steps"] <= 2 * 2 * 8
        assert r["perf/engine_decode_steps"] > 0 and r["perf/engine_tok_s"] > 0
        assert 0 < r["perf/engine_occupancy"] <= 1 and 0 < r["perf/engine_batch"] <= 16
        assert 0 <= r["perf/engine_host_gap_share"] <= 1 and 0 <= r["perf/engine_decode_host_gap_share"] <= 1
        assert r["perf/engine_step_ms"] > 0 and r["perf/engine_decode_step_ms"] > 0 and r["perf/engine_busy_s"] > 0
        assert r["perf/engine_host_gap_s"] >= 0
        # 4 /generate calls (a call's requests go in as one command) and a weight update on each of the 2 engines
        assert r["perf/engine_commands"] >= 4 + 2 and r["perf/engine_weights_update_s"] > 0
        # the rollout phase on the driver (rollout.timing): one /generate per group, the phase split in three
        assert r["perf/rollout_calls"] == 4 and r["perf/rollout_call_ms"] >= r["perf/rollout_transport_ms"] >= 0
        parts = r["perf/rollout_dispatch_s"] + r["perf/rollout_generate_s"] + r["perf/rollout_tail_s"]
        assert parts == pytest.approx(r["perf/rollout_time_s"], abs=0.05)
        assert r["perf/rollout_assemble_s"] > 0 and r["perf/rollout_reward_s"] >= 0 and r["perf/batch_build_s"] > 0
        # the trainers: tokens/s and model FLOPs against logging.peak_tflops (1 TFLOP/s here)
        assert r["perf/train_tok_s"] > 0 and r["perf/train_model_tflops"] > 0
        assert r["perf/train_mfu"] == pytest.approx(r["perf/train_model_tflops"])
        # rank 0's garbage collections during the train call (slime_dsa/gc_watch.py), apart from the engines'
        assert r["perf/trainer_gc_s"] >= 0 and r["perf/trainer_gc_full"] >= 0 and r["perf/trainer_gc_paused_s"] == 0
        assert r["perf/engine_gc_s"] >= 0 and r["perf/engine_gc_paused_s"] >= 0
        # the driver's own, its start-up objects frozen for the run (tests/test_gc_watch.py)
        assert r["perf/driver_gc_s"] >= 0 and r["perf/driver_gc_full"] >= 0
    summaries = list((run_dir / "wandb").glob("offline-run-*/files/wandb-summary.json"))
    if summaries:  # W&B writes the summary at finish
        assert "perf/engine_tok_s" in json.loads(summaries[0].read_text())
    # each engine actor's own log, in the run directory
    for i in range(2):
        text = (run_dir / f"engine_{i}.log").read_text()
        assert "INFO rollout.engine.engine: engine:" in text and "weight_version=3" in text
        assert "objects alive after start-up frozen out of garbage collection" in text


def test_a_profiled_step_writes_every_process_trace_and_its_phases(first_run):
    from slime_dsa.logging.timeline import load_trace, report

    _, run_dir = first_run
    assert [p.name for p in (run_dir / "profile").iterdir()] == ["step_2"]
    directory = run_dir / "profile" / "step_2"
    engines = sorted(directory.glob("engine-*.trace.json.gz"))
    ranks = sorted(directory.glob("trainer-rank*.trace.json.gz"))
    assert len(engines) == 2 and [p.name for p in ranks] == ["trainer-rank0.trace.json.gz", "trainer-rank1.trace.json.gz"]
    assert {"engine.step", "engine.launch"} <= {e.name for e in load_trace(engines[0]).cpu}
    assert {"train.forward", "train.backward", "train.optimizer"} <= {e.name for e in load_trace(ranks[0]).cpu}
    phases = json.loads((directory / "phases.json").read_text())
    assert phases["step"] == 2 and [p["name"] for p in phases["phases"]] == ["engines", "rollout", "batch", "train", "sync", "log"]
    assert all(p["start_ns"] <= p["end_ns"] for p in phases["phases"])
    assert "No GPU activity" in report(directory)  # a CPU run: phases only
    assert "step 2 profiled (no GPU activity)" in (run_dir / "train.log").read_text()


def test_resume_from_step_2_reproduces_step_3(first_run):
    step3, again, resumed_records = rerun_from_step_2(*first_run)
    assert len(again) == 1
    assert all(r["step"] != 0 for r in resumed_records)  # no second step-0 eval on resume
    assert_equal_but_engine_noise(again[0], step3)


def export_step_3(run_dir, tmp_path):
    """`slime-dsa export` of the run's step-3 checkpoint, loaded by transformers with no key missing or unexpected:
    (transformers' model, ours, the export directory)."""
    from transformers import AutoModelForCausalLM

    import slime_dsa
    from slime_dsa.cli import main

    out = tmp_path / "export"
    assert main(["export", str(run_dir / "checkpoints" / "step_000003"), "--out", str(out)]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return hf, slime_dsa.load_model(out).eval(), out


def test_export_loads_in_transformers(first_run, tmp_path):
    from transformers import AutoTokenizer

    hf, ours, out = export_step_3(first_run[1], tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Compute 12+34.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max().item() < 1e-4


def test_report_renders_pngs(first_run, tmp_path):
    from slime_dsa.cli import main

    _, run_dir = first_run
    assert main(["report", str(run_dir), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "reward.png").stat().st_size > 1000


def test_bypass_with_replicated_trainers_still_checks_the_weight_sync(tmp_path, ray_cluster):
    """Bypass mode (π_old := π_roll) runs no π_old pass; the first optimiser step's forward is the sync check. The
    engines run the overlap scheduler (rollout.overlap_schedule): pauses and weight pushes drain its step in flight."""
    from slime_dsa.orchestrator.train import run_training

    recipe = {**RECIPE, "algorithm": {"use_rollout_logprobs": True},
              "rollout": {**RECIPE["rollout"], "overlap_schedule": True},
              "trainer": {**RECIPE["trainer"], "num_steps": 2, "data_parallel": "replicate"},
              "logging": {"eval_every": 0, "wandb_mode": "disabled"}, "checkpoint": {"save_every": 0}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = run_training(load_recipe(path, [f"logging.run_dir={tmp_path / 'run'}"]))
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0 < r["train/train_rollout_logprob_abs_diff"] < 1e-5  # measured (not a constant 0), and in sync
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
