"""benchmarks/gpu_busy.py and its use in benchmarks/vs_trl.py on CPU. NVML cannot run here: the sampler reads a FAKE
source (a scripted utilisation), and the aggregation and the report's cells are checked on those readings."""

from __future__ import annotations

import argparse
import time

import pytest

from benchmarks.gpu_busy import (
    UtilizationSampler, busy_after_first, busy_cell, busy_figures, nvml_sources, sampling, step_busy,
    windows,
)


def test_windows_leave_out_the_work_the_step_clock_does_not_count():
    assert windows([0.0, 1.0, 2.5, 3.0]) == [(0.0, 1.0), (1.0, 2.5), (2.5, 3.0)]
    assert windows([0.0, 1.0, 4.0], excluded=[0.0, 2.5]) == [(0.0, 1.0), (1.0, 1.5)]


def test_busy_is_the_mean_of_the_readings_in_each_step_and_over_steps_2_to_n():
    samples = [(0.1, 100.0), (0.6, 80.0), (1.2, 10.0), (1.7, 30.0), (2.2, 50.0), (3.5, 99.0)]
    steps = windows([0.0, 1.0, 2.0, 3.0])
    assert step_busy(samples, steps) == [90.0, 20.0, 50.0]
    assert busy_after_first(samples, steps) == pytest.approx((10 + 30 + 50) / 3)  # step 1 and after the end: out
    assert step_busy(samples, [(5.0, 6.0)]) == [None]
    assert busy_after_first(samples, [(0.0, 1.0)]) == 90.0  # one step: itself
    assert busy_after_first([], steps) is None
    assert busy_cell(None) == "-" and busy_cell(42.4) == "42%"


def test_the_sampler_reads_a_fake_source_until_stopped():
    readings = iter(range(1000))
    with UtilizationSampler(lambda: [(time.perf_counter(), float(next(readings)))], interval_s=0.001) as sampler:
        time.sleep(0.05)
    count = len(sampler.samples)
    assert count >= 3 and [u for _, u in sampler.samples] == list(range(count))
    times = [t for t, _ in sampler.samples]
    assert times == sorted(times)
    time.sleep(0.01)
    assert len(sampler.samples) == count  # stopped


def test_a_failing_source_ends_the_sampling_not_the_caller():
    def broken() -> list:
        raise RuntimeError("NVML gone")

    with UtilizationSampler(broken, interval_s=0.001) as sampler:
        time.sleep(0.01)
    assert sampler.samples == []


def test_no_nvml_source_on_this_cpu_machine():
    assert nvml_sources() == {}  # no pynvml, or no driver: the report then says "-"


def test_both_views_are_sampled_and_aggregated_per_step():
    polled = iter([50.0] * 10_000)
    start = time.perf_counter()
    driver_batches = iter([[(start + 0.001, 30.0), (start + 0.2, 80.0)]])
    sources = {"polled": lambda: [(time.perf_counter(), next(polled))], "driver": lambda: next(driver_batches, [])}
    with sampling(sources) as samplers:
        time.sleep(0.05)
    assert set(samplers) == {"polled", "driver"} and samplers["driver"].samples[1][1] == 80.0
    steps = [(start, start + 0.1), (start + 0.1, start + 0.3)]
    figures = busy_figures(samplers, steps)
    assert figures["gpu_busy_driver_steps"] == [30.0, 80.0] and figures["gpu_busy_driver"] == 80.0
    assert figures["gpu_busy_steps"][0] == 50.0
    assert busy_figures({}, steps) == {"gpu_busy": None, "gpu_busy_steps": [], "gpu_busy_driver": None,
                                       "gpu_busy_driver_steps": []}


def _side(busy, busy_steps, **extra):
    return {"step_times": [3.0, 1.0, 1.2], "cpu_times": [2.0, 1.0, 1.0], "rewards": [0.1, 0.2, 0.3],
            "response_lengths": [19.0, 19.5, 20.0], "total_s": 9.0, "gpu_busy": busy, "gpu_busy_steps": busy_steps,
            **extra}


def test_the_report_has_both_sides_gpu_busy_from_fake_readings(monkeypatch):
    import benchmarks.vs_trl as vs_trl

    monkeypatch.setattr(vs_trl, "hardware", lambda device="cpu": "fake hardware")
    # FAKE readings: ours busy 30% then 50% in steps 2-3, TRL 70% and 90%
    stamps = [0.0, 1.0, 2.0, 3.0]
    fake_ours = [(0.5, 5.0), (1.5, 30.0), (2.5, 50.0)]
    fake_trl = [(0.5, 60.0), (1.5, 70.0), (2.5, 90.0)]
    steps = windows(stamps)
    ours = _side(busy_after_first(fake_ours, steps), step_busy(fake_ours, steps),
                 parts={"rollout": 0.5, "train": 0.2, "sync": 0.1}, readback_s=[0.0, 0.0, 2.5])
    trl_side = _side(busy_after_first(fake_trl, steps), step_busy(fake_trl, steps))
    args = argparse.Namespace(steps=3, prompts_per_step=2, group_size=2, eval_prompts=8, date="d", device="cuda",
                              max_new_tokens=8, temperature=1.0, lr=1e-5, task="countdown", task_args={},
                              max_prompt_length=160, seed=7, recompute_old_logprobs=False, hook_state="last",
                              micro_batch_tokens=64, trl_threads=1, ours_kv_cache="auto",
                              ours_overlap="off", ours_decode_steps=None, ours_loop="sync", ours_max_staleness=1,
                              ours_prefetch="off", ours_compile="off", ours_engine_compile="off",
                              ours_partial_rollout="retract",
                              trl_micro_batch=256, trl_attn="sdpa")
    text = vs_trl.markdown(args, "m", ours, trl_side, {"initial": 0.1, "ours": 0.2, "trl": 0.2}, True, "v",
                           (0.0, 0.0))
    assert "| GPU busy |" in text and "| ours | 1.10 | 1.00 | 40% |" in text and "| TRL | 1.10 | 1.00 | 80% |" in text
    assert "GPU busy, ours / TRL: **40% / 80%**" in text
    assert "per-step GPU busy ours: 5% 30% 50%" in text
    assert "out of its step time: 2.50 s in all" in text
    cpu_text = vs_trl.markdown(args, "m", {**ours, "gpu_busy": None, "gpu_busy_steps": []}, _side(None, []),
                               {"initial": 0.1, "ours": 0.2, "trl": 0.2}, True, "v", (0.0, 0.0))
    assert "| ours | 1.10 | 1.00 | - |" in cpu_text and "- per-step GPU busy TRL: -\n" in cpu_text
    ours_driver = {**ours, "gpu_busy_driver": 61.0, "gpu_busy_driver_steps": [9.0, 60.0, 62.0]}
    trl_driver = {**trl_side, "gpu_busy_driver": 75.0, "gpu_busy_driver_steps": [70.0, 80.0]}
    with_driver = vs_trl.markdown(args, "m", ours_driver, trl_driver,
                                  {"initial": 0.1, "ours": 0.2, "trl": 0.2}, True, "v", (0.0, 0.0))
    assert "2..N; device-wide, so ours' engine and trainer actors count); by the driver's own time-stamped samples: " \
           "**61% / 75%**" in with_driver
    assert "- per-step GPU busy ours, the driver's samples: 9% 60% 62%\n" in with_driver
    assert "driver's" not in text  # no driver samples: the line as before
    unmeasured = vs_trl.busy_line(_side(None, []), _side(None, []))
    assert unmeasured.startswith("GPU busy, ours / TRL: - / - (not measured")


def test_a_trl_side_that_failed_is_reported_over_the_steps_it_finished(monkeypatch):
    """TRL stopped in its 3rd step (the long-answer run's NaN): the report keeps ours' whole run, TRL's two finished
    steps and its grad norms, has no TRL eval, and leaves the goal undecided."""
    import benchmarks.vs_trl as vs_trl

    monkeypatch.setattr(vs_trl, "hardware", lambda device="cpu": "fake hardware")
    ours = _side(None, [], parts={"rollout": 0.5, "train": 0.2, "sync": 0.1}, readback_s=[0.0])
    trl_side = {"step_times": [9.0, 4.0], "cpu_times": [9.0, 4.0], "rewards": [0.1, 0.2], "response_lengths": [250.0, 260.0],
                "total_s": 20.0, "gpu_busy": None, "gpu_busy_steps": [], "grad_norms": [0.0, "nan"],
                "failed": "step 3: AcceleratorError: CUDA error: device-side assert triggered"}
    args = vs_trl.parse_args(["--device", "cuda", "--task", "countdown", "--steps", "3"])
    text = vs_trl.markdown(args, "m", ours, trl_side, {"initial": 0.1, "ours": 0.2, "trl": None}, True, "v", (0.0, 0.0))
    assert "**TRL failed at step 3: AcceleratorError" in text and "over the 2 steps it finished" in text
    assert "grad_norm per logged step: 0.0 nan" in text
    assert "| TRL | 4.00 | 4.00 | - | 9.00 | 13.0 | 20.0 | 0.100 | 0.150 | - |" in text
    assert "NOT reached (not decided: TRL failed) (3.64x" in text


def test_ours_alone_prints_its_median_step_and_busy_share():
    from benchmarks.vs_trl_ours import summary

    line = summary({"step_times": [2.0, 0.5, 0.3, 0.4], "gpu_busy": 55.4, "gpu_busy_steps": [10.0, 50.0, 60.0, 55.0]})
    assert line == ("ours: 4 steps, median step 0.400 s (steps 2..N), GPU busy 55% (steps 2..N); "
                    "per step: 10% 50% 60% 55%")
    driver = summary({"step_times": [2.0, 0.5], "gpu_busy": 40.0, "gpu_busy_steps": [10.0, 40.0],
                      "gpu_busy_driver": 63.0, "gpu_busy_driver_steps": [20.0, 63.0]})
    assert driver.endswith("; by the driver's samples 63%, per step: 20% 63%")
    assert "GPU busy - (steps 2..N); per step: -" in summary({"step_times": [1.0], "gpu_busy": None,
                                                              "gpu_busy_steps": []})
